"""Does llama.cpp's weight repack crash on this host? Probed once per host and llama.cpp build, in a subprocess.

On some CPUs (Intel Xeons with AVX-512 + AMX) llama.cpp repacks Q4_K / Q6_K / Q8_0 weights into its extra CPU
buffer types at load, and the first matrix multiply then segfaults (upstream llama.cpp issue 20824; llama-server's
``--no-repack`` avoids it). The probe loads a tiny synthetic Q8_0 and Q4_K_M GGUF with repacking on and decodes a
few tokens in a child process; a child that dies of a signal means repacking is unsafe here. The verdict is
cached under ``OCTO_HOME/probe`` per host (CPU flags) and llama.cpp build, so it costs a few seconds once.
``-o repack=true|false`` overrides it.

Run as ``python -m octo.engines.llamacpp.probe`` it is the child: exit 0 when decoding worked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from octo.benchload import cpu_flags

log = logging.getLogger("octo.engines.llamacpp")
TIMEOUT = 300.0


def _cache_file(version: str) -> Path:
    from octo.paths import octo_home

    key = hashlib.sha256(f"{cpu_flags()}|{version}".encode()).hexdigest()[:20]
    return octo_home() / "probe" / f"llamacpp-repack-{key}.json"


def repack_safe(version: str) -> bool:
    """True when llama.cpp's weight repack works on this host (probing once, then from the cache)."""
    path = _cache_file(version)
    try:
        return bool(json.loads(path.read_text())["repack_safe"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    verdict, detail = _probe()
    if verdict is None:  # the probe itself could not run (no synthetic builder, time-out): do not cache a guess
        log.warning("llamacpp: the weight-repack probe could not run (%s); keeping repack on", detail)
        return True
    if not verdict:
        log.warning("llamacpp: the weight repack crashed on this host in the probe (%s); loading with repack=false",
                    detail)
    from octo.atomic import write_json  # atomic: a probe killed midway leaves no half-written verdict

    write_json(path, {"repack_safe": verdict, "detail": detail, "llama_cpp": version,
                      "seconds": round(time.perf_counter() - t0, 2)})
    return verdict


def _probe() -> tuple[bool | None, str]:
    try:
        proc = subprocess.run([sys.executable, "-m", "octo.engines.llamacpp.probe"], capture_output=True,
                              timeout=TIMEOUT, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if proc.returncode == 0:
        return True, "decoded with repack on"
    if proc.returncode < 0:
        return False, signal.Signals(-proc.returncode).name
    if proc.returncode == 3:  # the child could not build or load its model: no verdict
        return None, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no details"
    return False, f"exit code {proc.returncode}"


def _child() -> int:
    try:
        from octo.synth.gguf import build_gguf

        paths = [build_gguf("tiny", ftype=f) for f in ("q8_0", "q4_k_m")]
        import llama_cpp as L
    except Exception as exc:  # noqa: BLE001
        print(f"probe setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    quiet = L.llama_log_callback(lambda *a: None)  # referenced until exit: llama.cpp calls it during loads
    L.llama_log_set(quiet, None)
    L.llama_backend_init()
    for path in paths:
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = True
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            print(f"probe could not load {path}", file=sys.stderr)
            return 3
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 256, 64, 2, 2
        ctx = L.llama_init_from_model(model, cp)
        prompt, one = (L.llama_token * 8)(*range(1, 9)), (L.llama_token * 1)(9)
        # a prompt, then single-token decode steps: both matmul shapes
        for batch in (L.llama_batch_get_one(prompt, 8), L.llama_batch_get_one(one, 1), L.llama_batch_get_one(one, 1)):
            if L.llama_decode(ctx, batch) != 0:
                return 3
        L.llama_free(ctx)
        L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
