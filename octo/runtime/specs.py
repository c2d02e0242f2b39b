"""What the server is told about a model: a :class:`ModelSpec` from the command line or a ``--models-file`` entry
(engine, options, ``keep_alive``, LoRA adapters) and its --cluster settings (replicas, autoscaling, resources), parsed
without importing Ray or the registry."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octo.errors import ConfigError, InvalidRequest

_AUTOSCALING_KEYS = {"min", "max", "target", "min_replicas", "max_replicas", "target_ongoing_requests",
                     "upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"}


_RESOURCE_KEYS = {"num_cpus", "num_gpus", "memory", "memory_gb"}


# -- configuration ------------------------------------------------------------------------------------------
def parse_cluster(value: str | None) -> str | None:
    """``ray`` (start a local head) -> "", ``ray://HOST:PORT`` or ``ray:auto`` -> the address for ``ray.init``."""
    if value is None or value == "":
        return None
    v = value.strip()
    if v == "ray":
        return ""
    if v.startswith("ray://"):
        return v
    if v.startswith("ray:") and len(v) > 4:  # ray:auto, ray:HOST:6379 (a cluster this machine is a node of)
        return v[4:]
    raise ConfigError(f"--cluster {value!r}: expected 'ray' (a local Ray head) or 'ray://HOST:10001'.",
                      param="cluster")


def parse_autoscaling(value: Any, where: str = "--autoscaling") -> dict[str, Any] | None:
    """``MIN:MAX[:TARGET]`` or a mapping (min, max, target, upscale_delay_s, downscale_delay_s, ...) -> Ray Serve's
    ``autoscaling_config``."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        parts = value.split(":")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3):
            raise ConfigError(f"{where}: expected MIN:MAX[:TARGET_ONGOING_REQUESTS], got {value!r}.")
        value = {"min": nums[0], "max": nums[1], **({"target": nums[2]} if len(nums) == 3 else {})}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: autoscaling must be a mapping (min, max, target) or MIN:MAX[:TARGET].")
    unknown = set(value) - _AUTOSCALING_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown autoscaling key(s) {', '.join(sorted(unknown))}; known: min, max, "
                          "target, upscale_delay_s, downscale_delay_s, metrics_interval_s, look_back_period_s.")
    out: dict[str, Any] = {}
    try:
        lo = int(value.get("min", value.get("min_replicas", 1)))
        hi = int(value.get("max", value.get("max_replicas", max(lo, 1))))
        target = float(value.get("target", value.get("target_ongoing_requests", 2)))
        for k in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"):
            if k in value:
                out[k] = float(value[k])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: autoscaling values must be numbers.") from None
    if lo < 0 or hi < 1 or hi < lo or target <= 0:
        raise ConfigError(f"{where}: autoscaling needs 0 <= min <= max, max >= 1 and target > 0.")
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target, **out}


def parse_resources(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - _RESOURCE_KEYS:
        raise ConfigError(f"{where}: resources must be a mapping of num_cpus, num_gpus, memory_gb.")
    try:
        out = {k: float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: resources must be numbers.") from None
    if any(v < 0 for v in out.values()):
        raise ConfigError(f"{where}: resources must not be negative.")
    if "memory" in out:
        out["memory_gb"] = out.pop("memory")
    return out


def cluster_keys(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The cluster keys of one models-file entry: ``replicas``, ``autoscaling``, ``resources``."""
    replicas = item.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
        raise ConfigError(f"{where}: replicas must be a positive integer.")
    autoscaling = parse_autoscaling(item.get("autoscaling"), where)
    if replicas is not None and autoscaling is not None:
        raise ConfigError(f"{where}: give replicas or autoscaling, not both.")
    return {"replicas": replicas, "autoscaling": autoscaling,
            "resources": parse_resources(item.get("resources"), where)}


# -- models named at start-up ------------------------------------------------------------------------------
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """Seconds, as Ollama takes it: a number of seconds or a duration ("10m", "1h30m", "500ms"); a negative value
    keeps the model loaded for good (None); 0 unloads it right after the request."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequest(f"{param} must be a number of seconds or a duration such as '10m'.", param=param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(a + u for a, u in parts) != text.replace(" ", ""):
                raise InvalidRequest(f"{param} must be a number of seconds or a duration such as '10m' or '1h30m', "
                                     f"got {value!r}.", param=param) from None
            unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
            seconds = sum(float(a) * unit[u] for a, u in parts)
    else:
        raise InvalidRequest(f"{param} must be a number of seconds or a duration such as '10m'.", param=param)
    if not math.isfinite(seconds):  # "nan", "inf", "1e400"
        raise InvalidRequest(f"{param} must be a finite number of seconds (-1 keeps the model loaded), got {value!r}.",
                             param=param)
    return None if seconds < 0 else seconds


@dataclass
class ModelSpec:
    """A model the server was told about (command line or models file)."""

    model: str
    engine: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    max_batch: int | None = None
    pinned: bool = False
    keep_alive: float | None = None  # seconds idle before unloading; None: never
    declared: bool = True  # named at start-up (False: loaded on demand by a request)
    lora: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> path; requests name them base:adapter
    replicas: int | None = None  # --cluster: replicas of this model (None: the --replicas/--autoscaling flags)
    autoscaling: dict | None = None  # --cluster: Ray Serve autoscaling_config (octo.cluster.deploy.parse_autoscaling)
    resources: dict = field(default_factory=dict)  # --cluster: num_cpus, num_gpus, memory_gb per replica


_SPEC_KEYS = {"model", "name", "path", "engine", "options", "max_batch", "pinned", "keep_alive", "lora", "replicas",
              "autoscaling", "resources"}


def catalog_max_tokens(spec: ModelSpec) -> int | None:
    """The catalog's ``max_tokens`` (a completion's length when a request sets none) of the catalog model ``spec``
    names, with or without a variant; None for a path, a Hugging Face id or a model the catalog does not set it for
    (those never load the catalog here)."""
    model = spec.model
    if not model or model.startswith(("/", ".", "~", "hf://")) or "/" in model:
        return None
    from octo.models.catalog import load_catalog

    try:
        entry = load_catalog().get(model.partition(":")[0])
    except Exception:  # noqa: BLE001 - a broken OCTO_CATALOG is reported where names are resolved, not here
        return None
    return entry.max_tokens if entry is not None else None


def check_lora(lora: Any, where: str) -> dict[str, str]:
    """A ``lora`` mapping (adapter name -> path) as the models file or ``--lora`` gives it."""
    if not isinstance(lora, dict):
        raise ConfigError(f"{where}: lora must be a mapping of adapter name -> path.")
    out = {}
    for name, path in lora.items():
        name = str(name)
        if not name or ":" in name or "/" in name or not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: lora entry {name!r}: the name must be non-empty without ':' or '/', and the "
                              "value a path.")
        out[name] = path
    return out


def load_models_file(path: str) -> list[ModelSpec]:
    """The models of a ``--models-file``: a YAML list (or ``models:`` list) of names/paths or mappings with
    ``model`` (or ``name``/``path``), ``engine``, ``options``, ``max_batch``, ``pinned``, ``keep_alive``, ``lora``
    (adapter name -> path, requested as ``model:adapter``)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--models-file {path}: {exc}") from None
    items = data.get("models") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"--models-file {path}: expected a list of models (or a 'models:' list).")
    specs = []
    for i, item in enumerate(items):
        where = f"--models-file {path}: models[{i}]"
        if isinstance(item, str):
            specs.append(ModelSpec(item))
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"{where} must be a name or a mapping.")
        unknown = set(item) - _SPEC_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: "
                              f"{', '.join(sorted(_SPEC_KEYS))}.")
        model = item.get("model") or item.get("path") or item.get("name")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where} needs 'model' (a name or a path).")
        options = item.get("options") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"{where}: options must be a mapping.")
        try:
            keep_alive = parse_keep_alive(item.get("keep_alive"), "keep_alive")
        except InvalidRequest as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
        max_batch = item.get("max_batch")
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ConfigError(f"{where}: max_batch must be a positive integer.")
        lora = check_lora(item.get("lora") or {}, where)
        specs.append(ModelSpec(model, item.get("engine"), {str(k): str(v) for k, v in options.items()}, max_batch,
                               bool(item.get("pinned", False)), keep_alive, lora=lora, **cluster_keys(item, where)))
    return specs
