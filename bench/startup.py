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

With ``--compare REV...`` the octo cases also run at those git revisions (``octo@REV/*`` keys, bench/revtree.py) in
the same rounds, so a change is compared with what it replaced on the same busy minute. Reported: every sample, the
median and the quietest (smallest) sample of each case, and octo's ratios to llama-server for both.

Same GGUF (the 0.5B shape, Q4_K_M, synthetic), same threads, both servers' default context and slots. Writes
every sample, the medians and octo's ratios to llama-server as JSON to ``--out``. Part of ``bench/run.py startup``.
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
                    elif r.status != 503:
                        raise RuntimeError(f"{model}: HTTP {r.status}: {(await r.text())[:300]}")
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.02)
    raise RuntimeError(f"{model}: no token in {timeout} s")


def spawn(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """``cmd`` started in ``cwd`` (an earlier revision's tree serves that revision: bench/revtree.py)."""
    log = tempfile.NamedTemporaryFile("wb", prefix="bench-startup-", suffix=".log", delete=False)
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's: compiled modules cached after the first start
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)


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


def spawn_to_token(cmd: list[str], model: str, port: int, env: dict | None = None, cwd: Path = REPO) -> float:
    t0 = time.perf_counter()
    proc = spawn(cmd, env, cwd)
    try:
        return asyncio.run(first_token(f"http://127.0.0.1:{port}", model, t0))
    finally:
        stop(proc)


def on_demand(models: list[str], threads: int, env: dict, switches: int, cwd: Path = REPO) -> tuple[float, list[float]]:
    """(first load on demand of models[0] in a running gateway, seconds of each later switch between the models)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    folders = sorted({str(Path(m).parent) for m in models})  # requests load models by path only from these
    proc = spawn(octo_cmd(port, threads, extra=("--max-loaded", "1", *(f"--models-dir={d}" for d in folders))),
                 env, cwd)
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


OCTO_CASES = ("octo_first", "octo_warm", "octo_on_demand", "octo_switch")


def octo_case(case: str, models: list[str], threads: int, home: str, cwd: Path,
              samples: dict[str, list[float]], prefix: str) -> float:
    """One sample of an octo case served from ``cwd`` (``prefix``: "" for this checkout, "octo@REV/" for --compare)."""
    port = free_port()
    if case == "octo_first":
        fresh = tempfile.mkdtemp(prefix="octo-bench-home-")
        t = spawn_to_token(octo_cmd(port, threads, models[0]), models[0], port, {"OCTO_HOME": fresh}, cwd)
        shutil.rmtree(fresh, ignore_errors=True)
        return t
    if case == "octo_warm":
        return spawn_to_token(octo_cmd(port, threads, models[0]), models[0], port, {"OCTO_HOME": home}, cwd)
    t, switches = on_demand(models, threads, {"OCTO_HOME": home}, 2, cwd)
    samples[prefix + "octo_switch"] += [round(x, 3) for x in switches]
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV",
                    help="also serve octo at these git revisions in the same alternating rounds (octo@REV/* keys)")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "startup.json"))
    args = ap.parse_args()
    from octo.synth.gguf import build_gguf

    models = [str(build_gguf("qwen2.5-0.5b", seed=s, ftype="q4_k_m")) for s in (0, 1)]
    trees = [("", REPO, tempfile.mkdtemp(prefix="octo-bench-home-"))]
    if args.compare:
        from revtree import short_sha, worktree

        trees += [(f"octo@{short_sha(rev)}/", worktree(rev), tempfile.mkdtemp(prefix="octo-bench-home-"))
                  for rev in args.compare]
    args.prefixes = [p for p, _, _ in trees]
    keys = ["llama_server", "llama_server_restart"] + [p + c for p, _, _ in trees for c in OCTO_CASES]
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for _, cwd, home in trees:  # warms each OCTO_HOME (and compiles each tree's modules)
        port = free_port()
        spawn_to_token(octo_cmd(port, args.threads, models[0]), models[0], port, {"OCTO_HOME": home}, cwd)
    try:
        for r in range(args.rounds):
            order = ["llama_server"] + [(p, cwd, home, c) for p, cwd, home in trees for c in OCTO_CASES[:3]]
            for item in order if r % 2 == 0 else order[::-1]:
                if item == "llama_server":
                    port = free_port()
                    t, key = spawn_to_token(cpp_cmd(models[0], port, args.threads), models[0], port), item
                else:
                    prefix, cwd, home, case = item
                    t, key = octo_case(case, models, args.threads, home, cwd, samples, prefix), prefix + case
                    if case == "octo_on_demand" and not prefix:
                        for i in range(2):  # llama-server "switching": a restart with the other model
                            port = free_port()
                            samples["llama_server_restart"].append(round(spawn_to_token(
                                cpp_cmd(models[(i + 1) % 2], port, args.threads), models[(i + 1) % 2], port), 3))
                samples[key].append(round(t, 3))
                print(f"[startup] round {r + 1} {key}: {t:.2f} s", file=sys.stderr, flush=True)
    finally:
        for _, _, home in trees:
            shutil.rmtree(home, ignore_errors=True)
    report = summary(samples, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("median_s", "quietest_s", "ratio_to_llama_server",
                                             "switch_ratio_to_restart")}))


def summary(samples: dict[str, list[float]], args: argparse.Namespace) -> dict:
    """Medians and the quietest (smallest) sample of every case, and octo's ratios to llama-server."""
    med = {k: round(statistics.median(v), 3) for k, v in samples.items() if v}
    low = {k: round(min(v), 3) for k, v in samples.items() if v}
    ratio = {}
    for p in args.prefixes:
        for k in ("octo_first", "octo_warm", "octo_on_demand"):
            if p + k in med:
                ratio[p + k] = {"median": round(med[p + k] / med["llama_server"], 2),
                                "quietest": round(low[p + k] / low["llama_server"], 2)}
        if p + "octo_switch" in med:
            ratio[p + "octo_switch"] = {"median": round(med[p + "octo_switch"] / med["llama_server_restart"], 2),
                                        "quietest": round(low[p + "octo_switch"] / low["llama_server_restart"], 2)}
    return {"bench": "startup", "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                         "loadavg_at_end": os.getloadavg()},
            "threads": args.threads, "rounds": args.rounds,
            "compare": [p[:-1] for p in args.prefixes if p], "model": "qwen2.5-0.5b shape, Q4_K_M (synthetic)",
            "samples": samples, "median_s": med, "quietest_s": low,
            "ratio_to_llama_server": {k: v for k, v in ratio.items() if not k.endswith("switch")},
            "switch_ratio_to_restart": {k: v for k, v in ratio.items() if k.endswith("switch")}}


if __name__ == "__main__":
    main()
