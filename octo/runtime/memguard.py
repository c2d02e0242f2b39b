"""How much a model will take, and how much the host has: the memory guard of loads on demand.

Without flags a request may load a model on demand only while fewer than ``DEFAULT_MAX_LOADED`` models are loaded
(Ollama's default on a CPU host, ``OLLAMA_MAX_LOADED_MODELS``; more when more were named at start) and only if its
estimate fits in the host's available memory (``MemAvailable`` of /proc/meminfo) with a margin. The estimate is the
weights' size on disk, the KV cache a GGUF model's default context needs (from its header: layers x KV heads x head
size x context cells, f16) and the model's share of the prefix cache. Other formats count their weights only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_MAX_LOADED = 3
MARGIN_FRACTION = 0.05  # of MemTotal kept free for the system and the requests' own buffers
MARGIN_MIN = 256 * 2**20


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def available() -> tuple[int, int] | None:
    """(bytes available to a new model: MemAvailable less the margin, MemAvailable); None when unknown."""
    info = meminfo()
    if "MemAvailable" not in info:
        return None
    margin = max(MARGIN_MIN, int(info.get("MemTotal", 0) * MARGIN_FRACTION))
    return info["MemAvailable"] - margin, info["MemAvailable"]


def gguf_kv_bytes(path: Path, n_ctx: int | None = None) -> int:
    """The f16 KV cache llama.cpp allocates for a GGUF model at its default context (the trained one, or
    ``n_ctx``); 0 when the header does not say (recurrent models, unreadable files)."""
    from octo.models.formats import gguf_metadata

    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")

    def num(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    layers, embd, heads = num("block_count"), num("embedding_length"), num("attention.head_count")
    kv_heads = num("attention.head_count_kv") or heads
    ctx_train = num("context_length")
    cells = max(ctx_train, n_ctx or 0)
    if not (layers and embd and heads and cells):
        return 0
    return cells * layers * 2 * kv_heads * (embd // heads) * 2


def model_bytes(path: Path, options: dict[str, Any] | None = None) -> int:
    """Estimated memory of the model at ``path`` once loaded: its files, plus a GGUF model's KV cache and its projector
    (a vision-language model's ``mmproj*.gguf``, which llama.cpp loads with it): the ``mmproj`` option's file
    (``--mmproj``; ``none``: no projector), else the one beside it."""
    try:
        if path.is_file():
            size = path.stat().st_size
            if path.suffix.lower() == ".gguf":
                size += gguf_kv_bytes(path) + projector_bytes(path, (options or {}).get("mmproj"))
            return size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0
    return 0


def projector_bytes(model: Path, option: Any = None) -> int:
    """The size of the projector the llama.cpp engine loads with the GGUF ``model`` (``option``: ``-o mmproj``)."""
    if option is not None:
        if str(option).strip().lower() in ("none", "off", "false", ""):
            return 0
        found = [Path(str(option)).expanduser()]
    else:
        found = [p for p in model.parent.glob("mmproj*.gguf") if p != model]
    return found[0].stat().st_size if len(found) == 1 and found[0].is_file() else 0


def gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


def no_room(config: Any, limit: int, need: int, declared: bool, others: list[int]) -> tuple[str, bool]:
    """Why a model of ``need`` bytes cannot load beside loaded models of ``others`` bytes now ("" when it can), and
    whether unloading them all could make room at all. ``limit``: models at once (0: no limit); the memory check is
    --memory-budget when set (0: none), else, for a load on demand (not ``declared``), the host's available
    memory."""
    if limit and len(others) + 1 > limit:
        return f"{len(others)} models are loaded (--max-loaded {limit})", True
    if config.memory_budget_gb:
        budget, used = int(config.memory_budget_gb * 2**30), sum(others)
        if used + need > budget and (others or not declared):  # a model named at start loads alone regardless
            return (f"it needs about {gb(need)} and the loaded models {gb(used)} of --memory-budget "
                    f"{config.memory_budget_gb:g} GB"), need <= budget or declared
    elif config.memory_budget_gb is None and not declared:
        room = available()
        if room is not None and need > room[0]:
            return (f"it needs about {gb(need)} (weights, KV cache and cache share, estimated) and the host has "
                    f"{gb(room[1])} available ({gb(room[1] - room[0])} kept free; --memory-budget sets a budget "
                    "instead)"), need <= room[0] + sum(others)
    return "", True
