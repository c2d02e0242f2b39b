"""Finding and importing MLX: availability, device, and the BLAS library MLX's CPU backend calls.

The ``mlx[cpu]`` wheels for Linux bundle the netlib *reference* BLAS, whose ``cblas_sgemm`` is 10-30x slower
than an optimised one: a batch of 8 rows through a 896x4864 matrix takes 26 ms instead of 1.6 ms, and prompt
processing is slower still. ``libmlx.so`` resolves ``cblas_*`` through the process's global symbol scope
first, so loading an OpenBLAS with ``RTLD_GLOBAL`` *before* MLX is first imported makes MLX use it (the
same thing ``LD_PRELOAD`` does). :func:`import_mlx` does that once per process, as the ``blas`` option says:
``auto`` (default: an installed system OpenBLAS if there is one), ``bundled`` (leave MLX's own), or a path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys
import threading
from typing import Any

from octo.errors import ConfigError

MIN_GLIBC = (2, 35)  # the mlx[cpu] manylinux wheels are built for glibc 2.35
_SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_lock = threading.Lock()
_preloaded: str | None = None


def glibc_version() -> tuple[int, int] | None:
    try:
        name, ver = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = ver.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError, OSError):
        return None


def unavailable_reason() -> str | None:
    """Why MLX cannot run on this host (None when it can), without importing it."""
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        hint = "mlx mlx-lm" if sys.platform == "darwin" else "'mlx[cpu]' mlx-lm"
        return f"mlx and mlx-lm are not installed (pip install 'octo[mlx]', or pip install {hint})"
    if sys.platform == "darwin":
        if platform.machine() != "arm64":
            return "MLX needs Apple Silicon (arm64); this Mac is " + platform.machine()
        return None
    if sys.platform.startswith("linux"):
        glibc = glibc_version()
        if glibc is not None and glibc < MIN_GLIBC:
            return f"the mlx[cpu] wheels need glibc >= 2.35; this host has {glibc[0]}.{glibc[1]}"
        return None
    return f"MLX does not run on {sys.platform}"


def device_description() -> str:
    """The device MLX will use, in words (imports MLX on macOS only, where no BLAS choice is made)."""
    if sys.platform == "darwin":
        import mlx.core as mx

        if mx.metal.is_available():
            return "Apple Silicon GPU (Metal)"
        return "CPU (Metal unavailable)"
    return f"CPU ({platform.machine()}, mlx[cpu] on {platform.system()})"


def blas_hint() -> str:
    """For ``detect()`` on Linux: which BLAS ``blas=auto`` will give MLX (without loading MLX)."""
    if "mlx.core" in sys.modules:
        return blas_in_use()
    path = find_openblas()
    return f"OpenBLAS ({path})" if path else "bundled reference BLAS (slow; install OpenBLAS: libopenblas0)"


def find_openblas() -> str | None:
    for path in _SYSTEM_OPENBLAS:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def import_mlx(blas: str = "auto"):
    """Import ``mlx.core``, first loading the BLAS that ``blas`` names when MLX is not loaded yet.

    Raises ``OSError`` when an explicitly named library cannot be loaded, or cannot take effect because MLX
    is already loaded in this process with another BLAS.
    """
    global _preloaded
    with _lock:
        linux = sys.platform.startswith("linux")
        if "mlx.core" not in sys.modules:
            path = None
            if linux and blas != "bundled":
                path = find_openblas() if blas == "auto" else blas
            if path:
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    _preloaded = path
                except OSError as exc:
                    if blas != "auto":
                        raise OSError(f"cannot load the BLAS library {path!r}: {exc}") from exc
        elif linux and blas not in ("auto", _preloaded) and not (blas == "bundled" and _preloaded is None):
            raise OSError(
                f"blas={blas!r} cannot take effect: MLX is already loaded in this process with {blas_in_use()}"
            )
        import mlx.core as mx

    return mx


def hide_torch() -> bool:
    """Hide torch from this process's imports (``import torch`` then fails as if it were not installed), unless
    something imported it or transformers already. mlx-lm's tokenizer module imports transformers, which imports
    torch wherever it is installed (``transformers.configuration_utils``, for its RoPE helpers); MLX never calls it,
    and on a CPU host that import is about two thirds of this engine's load (importing mlx-lm: 3.2 s with torch,
    1.1 s without, on a 2-core x86-64). Only for an engine worker of its own (``EngineConfig.own_process``): in a
    process that other engines share, one of them may need torch. True when torch is hidden now."""
    if torch_hidden():
        return True
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # the import system's own "not importable" mark
    return True


def torch_hidden() -> bool:
    """Whether ``hide_torch`` hid torch in this process."""
    return sys.modules.get("torch", False) is None


def needs_torch(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a failed ``import torch``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def load_folder(path: Any) -> tuple[Any, Any, dict]:
    """mlx-lm's load of a model folder: (model, tokenizer, config). Where torch is hidden (``hide_torch``) and the
    folder's tokenizer needs it after all, a ConfigError says so and names the way out (the gateway's own process)."""
    try:
        from mlx_lm.utils import load as mlx_load

        return mlx_load(str(path), return_config=True)
    except Exception as exc:
        if torch_hidden() and needs_torch(exc):
            raise ConfigError(
                f"The MLX model in {path} needs torch (its tokenizer imports it): an MLX engine worker of its own "
                "loads mlx-lm without torch, which MLX never calls. Serve this model with --isolation thread, where "
                "torch is imported as usual.") from exc
        raise


def blas_in_use() -> str:
    """Which BLAS MLX's CPU backend calls (Linux: read from the process's mapped libraries)."""
    if sys.platform == "darwin":
        return "Accelerate"
    if _preloaded:
        return f"OpenBLAS ({_preloaded})"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return _preloaded or "unknown"
    for line in maps.splitlines():
        lib = line.rsplit(" ", 1)[-1]
        if "openblas" in os.path.basename(lib).lower() and "scipy_openblas" not in lib:
            return f"OpenBLAS ({lib})"
    return "bundled reference BLAS (slow; install OpenBLAS or pass -o blas=PATH)"
