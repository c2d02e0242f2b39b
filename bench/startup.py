"""From "serve this model" to its first streamed token: octo against the C++ llama-server, in alternating rounds.

    flock /tmp/octo-bench.lock .venv/bin/python bench/startup.py [--rounds 3] [--threads 2]

Each measurement starts a clock, then (a) spawns a server or (b) asks a running octo for a model it has not loaded,
and sends one streamed chat completion (``max_tokens`` 2) every 20 ms until the first content token arrives (a
refused connection or a 503 "loading" answer is retried). Cases, each a median of ``--rounds`` (alternating):

* ``llama_server``: the C++ llama-server spawned (bench/llama_server.py builds it once);
* ``octo_first``: ``octo serve MODEL`` with a fresh ``OCTO_HOME`` (a host's first start: the repack crash-safety
  probe runs, nothing is cached);
* ``octo_warm``: ``octo serve MODEL`` with the ``OCTO_HOME`` of earlier starts;
* ``octo_on_demand``: a running ``octo serve`` (no model named, warm ``OCTO_HOME``) asked for the model by path;
* ``octo_switch`` / ``llama_server_restart``: two models alternating on a running ``octo serve --max-loaded 1``
  (each request unloads the other) against restarting llama-server with the other model.

Same GGUF (the 0.5B shape, Q4_K_M, synthetic), same threads, both servers' default context and slots. Writes
``bench/results/startup.json`` with every sample, the medians and octo's ratios to llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from llama_server import llama_server  # noqa: E402
from llamacpp import free_port  # noqa: E402


async def first_token(base: str, model: str, t0: float, timeout: float = 600) -> float:
    """Seconds from ``t0`` to the first streamed content token of ``model`` at ``base`` (retrying until it serves)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() - t0 < timeout:
            try:
                async with session.post(f"{base}/v1/chat/completions", json=body) as r:
                    if r.status == 200:
                        async for line in r.content:
                            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                                return time.perf_counter() - t0
                            if line.startswith(b"data: [DONE]"):
                                return time.perf_counter() - t0  # (a first token that is empty text)
                    elif r.status not in (503, 404):
                        raise RuntimeError(f"{model}: HTTP {r.status}: {(await r.text())[:300]}")
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.02)
    raise RuntimeError(f"{model}: no token in {timeout} s")


def spawn(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("wb", prefix="bench-startup-", suffix=".log", delete=False)
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's: compiled modules cached after the first start
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def octo_cmd(port: int, threads: int, *models: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "octo.cli", "serve", *models, "--engine", "llamacpp", "--port", str(port),
            "-o", f"n_threads={threads}", *extra]


def cpp_cmd(model: str, port: int, threads: int) -> list[str]:
    return [str(llama_server()), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]


def spawn_to_token(cmd: list[str], model: str, port: int, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    proc = spawn(cmd, env)
    try:
        return asyncio.run(first_token(f"http://127.0.0.1:{port}", model, t0))
    finally:
        stop(proc)


def on_demand(models: list[str], threads: int, env: dict, switches: int) -> tuple[float, list[float]]:
    """(first load on demand of models[0] in a running gateway, seconds of each later switch between the models)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = spawn(octo_cmd(port, threads, extra=("--max-loaded", "1")), env)
    try:
        asyncio.run(_wait_health(base))
        first = asyncio.run(first_token(base, models[0], time.perf_counter()))
        times = [asyncio.run(first_token(base, models[(i + 1) % 2], time.perf_counter())) for i in range(switches)]
        return first, times
    finally:
        stop(proc)


async def _wait_health(base: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(3000):
            try:
                async with session.get(f"{base}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.02)
    raise RuntimeError("octo serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "startup.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    models = [str(build_gguf("qwen2.5-0.5b", seed=s, ftype="q4_k_m")) for s in (0, 1)]
    warm_home = tempfile.mkdtemp(prefix="octo-bench-home-")
    samples: dict[str, list[float]] = {k: [] for k in ("llama_server", "octo_first", "octo_warm", "octo_on_demand",
                                                       "octo_switch", "llama_server_restart")}
    port = free_port()
    spawn_to_token(octo_cmd(port, args.threads, models[0]), models[0], port, {"OCTO_HOME": warm_home})  # warms it
    try:
        for r in range(args.rounds):
            order = ["llama_server", "octo_first", "octo_warm", "octo_on_demand"]
            for case in order if r % 2 == 0 else order[::-1]:
                port = free_port()
                if case == "llama_server":
                    t = spawn_to_token(cpp_cmd(models[0], port, args.threads), models[0], port)
                elif case == "octo_first":
                    fresh = tempfile.mkdtemp(prefix="octo-bench-home-")
                    t = spawn_to_token(octo_cmd(port, args.threads, models[0]), models[0], port, {"OCTO_HOME": fresh})
                    shutil.rmtree(fresh, ignore_errors=True)
                elif case == "octo_warm":
                    t = spawn_to_token(octo_cmd(port, args.threads, models[0]), models[0], port,
                                       {"OCTO_HOME": warm_home})
                else:
                    t, switches = on_demand(models, args.threads, {"OCTO_HOME": warm_home}, 2)
                    samples["octo_switch"] += switches
                    for i in range(2):  # llama-server "switching": a restart with the other model
                        port = free_port()
                        samples["llama_server_restart"].append(
                            spawn_to_token(cpp_cmd(models[(i + 1) % 2], port, args.threads), models[(i + 1) % 2],
                                           port))
                samples[case].append(round(t, 3))
                print(f"[startup] round {r + 1} {case}: {t:.2f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(warm_home, ignore_errors=True)
    med = {k: round(statistics.median(v), 3) for k, v in samples.items() if v}
    ref = med["llama_server"]
    report = {"bench": "startup", "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
              "threads": args.threads, "rounds": args.rounds, "model": models[0],
              "samples": {k: [round(x, 3) for x in v] for k, v in samples.items()}, "median_s": med,
              "ratio_to_llama_server": {k: round(v / ref, 2) for k, v in med.items() if k.startswith("octo_")
                                        and k != "octo_switch"},
              "switch_ratio_to_restart": round(med["octo_switch"] / med["llama_server_restart"], 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"median_s": med, "ratio": report["ratio_to_llama_server"],
                      "switch_ratio": report["switch_ratio_to_restart"]}))


if __name__ == "__main__":
    main()
