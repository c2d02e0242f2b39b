"""Benchmark: octo's /v1/audio/transcriptions vs bare ``whisper.transcribe``; concurrent vs sequential.

Same checkpoint (the synthetic whisper at the real "tiny" shape), same espeak-ng speech files, same
decoding settings on both sides (greedy, no temperature fallback, at most ``--max-new-tokens`` per
30-second window: random weights babble until the limit, so the work is fixed and equal). The bare side
calls ``whisper.transcribe(model, path)`` in this process (ffmpeg decoding from the file included); the
octo side is a real ``octo serve`` process driven by the official openai SDK (upload, multipart, ffmpeg,
admission queue, engine thread, JSON). Rounds alternate between the two so drift hits both alike.

Then 4 transcriptions sent at once vs the same 4 one after another, through the endpoint, and the same
comparison inside the engine (``transcribe_batch`` of 4 vs 4 x ``transcribe``), which shows what batched
decoding gives whether or not the scheduler groups queued requests.

Run it alone on the machine:  flock /tmp/octo-bench.lock .venv/bin/python bench/whisper.py
Writes bench/results/whisper.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# This file is named like the openai-whisper package: keep its folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO / "tests"))
TEXTS = [
    "Speech recognition turns spoken words into text. This sentence was synthesized by espeak for a benchmark "
    "of the octo gateway, which serves whisper models behind an OpenAI compatible interface.",
    "The quick brown fox jumps over the lazy dog, while the busy engineers measure how fast each request is "
    "transcribed on this small machine with only two processor cores.",
    "Weather report: sunny in the morning, clouds in the afternoon, light rain at night, and a gentle breeze "
    "from the west. Temperatures stay mild for the rest of the week.",
    "Please remember to bring your notebook, a pencil, and the signed permission slip to the museum trip "
    "next Tuesday. The bus leaves at eight o'clock sharp from the main entrance.",
]


def start_server(ckpt: Path, port: int, max_new: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "octo.cli.main",
        "serve",
        str(ckpt),
        "--engine",
        "whisper",
        "--port",
        str(port),
        "-o",
        f"max_new_tokens={max_new}",
        "-o",
        "temperature_increment=0",
    ]
    # cwd: a neutral folder, so `octo` comes from PYTHONPATH or the installed package
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"octo serve exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("octo serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6, help="rounds (each: every clip once per side)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "whisper.json"))
    args = ap.parse_args()

    import openai
    import torch
    import whisper
    from octo.engines.whisper import WhisperEngine
    from serverproc import free_port

    from octo.engine import EngineConfig, TranscriptionRequest
    from octo.scheduler.admission import Scheduler
    from octo.synth.whisper import build_whisper, speech

    scheduler_batches = hasattr(Scheduler, "call_batch")  # else queued requests run one at a time
    work = Path(tempfile.mkdtemp(prefix="octo-bench-whisper-"))
    ckpt = build_whisper(args.shape)
    clips = [speech(t, work / f"clip{i}.wav") for i, t in enumerate(TEXTS)]
    durations = [len(whisper.load_audio(str(c))) / 16000 for c in clips]
    kw = dict(fp16=False, temperature=0.0, sample_len=args.max_new_tokens)

    port = free_port()
    server = start_server(ckpt, port, args.max_new_tokens, work / "server.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        model_id = client.models.list().data[0].id
        model = whisper.load_model(str(ckpt), device="cpu")

        def bare(path: Path) -> str:
            return whisper.transcribe(model, str(path), **kw)["text"]

        def octo(path: Path) -> str:
            with path.open("rb") as f:
                return client.audio.transcriptions.create(model=model_id, file=f).text

        for c in clips:  # warm-up, and both sides must produce the same text from the same checkpoint
            a, b = bare(c), octo(c)
            assert a.strip() == b, (a, b)
        pairs = []  # (bare seconds, octo seconds) for one clip, measured back to back in alternating order
        for r in range(args.rounds):
            for i, c in enumerate(clips):
                first, second = (bare, octo) if (r + i) % 2 == 0 else (octo, bare)
                t0 = time.perf_counter()
                first(c)
                t1 = time.perf_counter()
                second(c)
                t2 = time.perf_counter()
                pairs.append((t1 - t0, t2 - t1) if first is bare else (t2 - t1, t1 - t0))
        model = None  # free it: the engine-level runs below load their own

        async def concurrent() -> float:
            aclient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
            t = time.perf_counter()
            await asyncio.gather(
                *(aclient.audio.transcriptions.create(model=model_id, file=c.open("rb")) for c in clips)
            )
            return time.perf_counter() - t

        def sequential() -> float:
            t = time.perf_counter()
            for c in clips:
                octo(c)
            return time.perf_counter() - t

        seq_t, conc_t = [], []
        for r in range(args.rounds):
            if r % 2:
                conc_t.append(asyncio.run(concurrent()))
                seq_t.append(sequential())
            else:
                seq_t.append(sequential())
                conc_t.append(asyncio.run(concurrent()))
    finally:
        server.terminate()
        server.wait(30)

    eng = WhisperEngine(
        EngineConfig(options={"max_new_tokens": str(args.max_new_tokens), "temperature_increment": "0"})
    )
    eng.load(str(ckpt), "bench")
    reqs = [TranscriptionRequest(audio=whisper.load_audio(str(c))) for c in clips]
    eng.transcribe_batch(reqs)  # warm-up
    one_t, batch_t = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for r in reqs:
            eng.transcribe(r)
        one_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.transcribe_batch(reqs)
        batch_t.append(time.perf_counter() - t)

    n = len(clips)
    med = statistics.median
    bare_s, octo_s = [p[0] for p in pairs], [p[1] for p in pairs]
    result = {
        "benchmark": "whisper",
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "checkpoint": {
            "shape": args.shape,
            "path": str(ckpt.relative_to(ckpt.parents[3])),
            "parameters": sum(p.numel() for p in eng.model.parameters()),
        },
        "settings": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": 0.0,
            "fallback": False,
            "rounds": args.rounds,
            "clips": n,
            "clip_seconds": [round(d, 2) for d in durations],
        },
        "bare_whisper_transcribe": {
            "requests_per_s": round(len(bare_s) / sum(bare_s), 3),
            "median_request_s": round(med(bare_s), 3),
            "request_s": bare_s,
        },
        "octo_endpoint": {
            "requests_per_s": round(len(octo_s) / sum(octo_s), 3),
            "median_request_s": round(med(octo_s), 3),
            "request_s": octo_s,
        },
        # throughput of octo relative to bare whisper: over all requests, and the median of back-to-back pairs
        "octo_vs_bare_throughput": round(sum(bare_s) / sum(octo_s), 3),
        "octo_vs_bare_throughput_median_pair": round(med(b / o for b, o in pairs), 3),
        "endpoint_sequential_4": {"wall_s": round(med(seq_t), 3), "round_s": seq_t},
        "endpoint_concurrent_4": {"wall_s": round(med(conc_t), 3), "round_s": conc_t},
        "endpoint_concurrent_speedup": round(med(seq_t) / med(conc_t), 3),
        "engine_one_at_a_time_4": {"wall_s": round(med(one_t), 3), "round_s": one_t},
        "engine_transcribe_batch_4": {"wall_s": round(med(batch_t), 3), "round_s": batch_t},
        "engine_batch_speedup": round(med(one_t) / med(batch_t), 3),
        "scheduler_groups_queued_transcriptions": scheduler_batches,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if not isinstance(v, dict) or not {"round_s", "request_s"} & set(v)},
            indent=2,
        )
    )
    for k, v in result.items():
        if isinstance(v, dict) and ("round_s" in v or "request_s" in v):
            print(k, {kk: vv for kk, vv in v.items() if kk not in ("round_s", "request_s")})


if __name__ == "__main__":
    main()
