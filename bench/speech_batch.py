"""Benchmark: N concurrent transcriptions on the faster-whisper engine, batched vs in turn vs parallel workers.

One synthetic Whisper (random weights from a fixed seed, ``--shape``, default the real "tiny" dimensions) as a
CTranslate2 float32 folder, N different espeak-ng recordings (short clips, one 30-second window each, like voice
commands), greedy decoding without fallback and at most ``--max-new-tokens`` tokens per window: random weights
babble until a limit, and the fallback would sample (random work), so every side decodes the same tokens (the
answers are compared each round). Three real ``octo serve`` processes, each driven by N threads of the official
openai SDK uploading their clip at once:

- ``batched``: ``--max-batch N``: the queued requests' windows go through CTranslate2 together
  (``engines/faster_whisper/batch.py``: one encoder call, decodes with equal prompt layouts together);
- ``in_turn``: ``--max-batch 1``: one request at a time (what batching saves);
- ``workers``: ``--max-batch N -o workers=2``: faster-whisper's own answer, two CTranslate2 workers running
  requests in parallel, each with half the threads.

Rounds alternate the order of the sides. Reported: median wall seconds for the N requests, requests/s, audio
seconds per second, the speed-up of ``batched`` over ``in_turn``, peak RSS of each engine worker.

Run it alone on the machine:  flock /tmp/octo-bench.lock .venv/bin/python bench/speech_batch.py
Writes JSON to ``--out``; part of ``bench/run.py speech``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]  # bench/whisper.py != whisper
sys.path.insert(0, str(REPO / "tests"))
SENTENCES = [
    "Turn on the lights in the kitchen.", "What is the weather like tomorrow morning?",
    "Set a timer for twelve minutes.", "Play some quiet music in the living room.",
    "Remind me to call the dentist at four.", "How far is it to the nearest train station?",
    "Add milk and eggs to the shopping list.", "Read me the latest news headlines please.",
]


def clips(n: int, tmp: Path) -> list[Path]:
    from octo.synth.whisper import speech

    out = []
    for i in range(n):
        raw = speech(SENTENCES[i % len(SENTENCES)], tmp / f"c{i}.raw.wav", speed=150 + 7 * i)  # distinct audio
        out.append(tmp / f"c{i}.wav")
        subprocess.run(["ffmpeg", "-y", "-loglevel", "error", "-i", str(raw), "-ar", "16000", "-ac", "1", str(out[-1])],
                       check=True)
    return out


def in_process(model: Path, wavs: list[Path], args) -> dict:
    """The engine alone, in a process of its own that imports what an engine worker imports (this one has torch
    loaded by the synthetic builder, whose OpenMP slows CTranslate2): the N requests one after the other
    (``transcribe``) vs in one ``transcribe_batch`` (what the scheduler hands it when N wait together)."""
    cmd = [sys.executable, __file__, "--in-process", str(model), "--rounds", str(args.rounds), "--threads",
           str(args.threads), "--max-new-tokens", str(args.max_new_tokens), *map(str, wavs)]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()[-1])
    print(f"engine in process: in turn {out['wall_s']['in_turn']:.3f} s, batched {out['wall_s']['batched']:.3f} s "
          f"({out['batched_speedup']:.2f}x)", flush=True)
    return out


def engine_alone(args) -> None:
    """``--in-process MODEL WAV...``: the measurement of :func:`in_process`, printed as one JSON line."""
    from octo.engines.faster_whisper import FasterWhisperEngine

    from octo.engine import EngineConfig, TranscriptionRequest

    eng = FasterWhisperEngine(EngineConfig(max_batch=len(args.wavs), options={
        "max_new_tokens": str(args.max_new_tokens), "temperature_increment": "0", "threads": str(args.threads)}))
    eng.load(args.in_process, "bench")
    reqs = [TranscriptionRequest(audio=speech_bench().load_audio(Path(w)), language="en") for w in args.wavs]
    sides = {"in_turn": lambda: [eng.transcribe(r) for r in reqs], "batched": lambda: eng.transcribe_batch(reqs)}
    times: dict[str, list[float]] = {s: [] for s in sides}
    texts = {s: [r.text for r in fn()] for s, fn in sides.items()}  # warm-up, and the answers to compare
    for r in range(args.rounds):
        for s in sides if r % 2 == 0 else reversed(list(sides)):
            t0 = time.perf_counter()
            sides[s]()
            times[s].append(time.perf_counter() - t0)
    med = {s: statistics.median(v) for s, v in times.items()}
    print(json.dumps({"wall_s": {s: round(v, 3) for s, v in med.items()},
                      "runs_s": {s: [round(x, 3) for x in v] for s, v in times.items()},
                      "batched_speedup": round(med["in_turn"] / med["batched"], 3),
                      "batched_speedup_paired": round(statistics.median(
                          a / b for a, b in zip(times["in_turn"], times["batched"], strict=True)), 3),
                      "same_answers": texts["in_turn"] == texts["batched"]}))


def speech_bench():
    """bench/speech.py as a module (the bench folder is not on the path: its whisper.py would shadow whisper)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("speech_bench", REPO / "bench" / "speech.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "speech_batch.json"))
    ap.add_argument("--in-process", help=argparse.SUPPRESS)
    ap.add_argument("wavs", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process:
        return engine_alone(args)

    from serverproc import run_octo

    from octo.synth.speech import build_whisper_ct2

    load_start = os.getloadavg()
    model = build_whisper_ct2(args.shape)
    n = args.concurrent
    wavs = clips(n, Path(tempfile.mkdtemp(prefix="octo-speech-batch-")))
    seconds = sum(os.path.getsize(w) - 44 for w in wavs) / 32000  # 16-bit mono 16 kHz PCM after a 44-byte header
    common = ["--engine", "faster-whisper", "-o", f"max_new_tokens={args.max_new_tokens}",
              "-o", "temperature_increment=0", "--max-audio-mb", "64", "--max-queue", str(4 * n)]
    sides = {
        "batched": [f"--max-batch={n}", "-o", f"threads={args.threads}"],
        "in_turn": ["--max-batch=1", "-o", f"threads={args.threads}"],
        "workers": [f"--max-batch={n}", "-o", "workers=2", "-o", f"threads={max(1, args.threads // 2)}"],
    }
    engine_side = in_process(model, wavs, args)
    times: dict[str, list[float]] = {s: [] for s in sides}
    answers: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        servers = {s: stack.enter_context(run_octo(str(model), *common, *extra, timeout=600))
                   for s, extra in sides.items()}
        clients = {s: srv.openai(timeout=900) for s, srv in servers.items()}
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=n))

        def one(side: str, wav: Path) -> str:
            return clients[side].audio.transcriptions.create(model="whisper-1", file=wav.open("rb"), language="en",
                                                             response_format="text")

        def burst(side: str) -> float:
            t0 = time.perf_counter()
            texts = list(pool.map(lambda w: one(side, w), wavs))
            dt = time.perf_counter() - t0
            if answers.setdefault(side, texts) != texts:
                raise RuntimeError(f"{side}: answers changed between rounds")
            return dt

        for s in sides:  # warm-up, untimed
            burst(s)
        names = list(sides)
        for r in range(args.rounds):
            for s in names if r % 2 == 0 else reversed(names):
                times[s].append(burst(s))
            print(f"round {r + 1}: " + ", ".join(f"{s} {times[s][-1]:.2f} s" for s in names), flush=True)
        rss = {s: speech_bench().worker_peak_rss_mb(srv.proc.pid) for s, srv in servers.items()}
        stats = {s: srv.get_json("/v1/engines") for s, srv in servers.items()}
    same = all(answers[s] == answers["in_turn"] for s in sides)
    med = {s: statistics.median(v) for s, v in times.items()}
    result = {
        "bench": "concurrent transcriptions on faster-whisper: batched vs in turn vs workers",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_start": load_start},
        "settings": vars(args) | {"audio_seconds_total": round(seconds, 2), "decoding": "greedy, no fallback",
                                  "weights": "random (fixed seed): decode lengths capped by max_new_tokens"},
        "same_answers": same,
        "sides": {s: {"wall_s": round(med[s], 3), "runs_s": [round(x, 3) for x in times[s]],
                      "requests_per_s": round(n / med[s], 3), "audio_x_realtime": round(seconds / med[s], 2),
                      "worker_peak_rss_mb": rss[s],
                      "batching": next((e.get("model") or {}).get("batching") for e in stats[s]["data"]
                                       if e["name"] == stats[s]["active"])}
                  for s in sides},
        "batched_speedup_over_in_turn": round(med["in_turn"] / med["batched"], 3),
        # each round's in_turn/batched (run back to back): drift between rounds cancels out
        "batched_speedup_paired": round(statistics.median(
            a / b for a, b in zip(times["in_turn"], times["batched"], strict=True)), 3),
        "engine_in_process": engine_side,
        "workers_speedup_over_in_turn": round(med["in_turn"] / med["workers"], 3),
        "loadavg_end": os.getloadavg(),
        "noise": "shared 2-core host: other engineers' jobs run meanwhile; rounds alternate the sides' order",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for s in sides:
        r = result["sides"][s]
        print(f"{s:8s} {r['wall_s']:7.3f} s for {n} requests  {r['requests_per_s']:.2f} req/s  "
              f"{r['audio_x_realtime']:.1f}x real time  worker peak RSS {r['worker_peak_rss_mb']} MB")
    print(f"batched {result['batched_speedup_over_in_turn']:.2f}x, "
          f"workers {result['workers_speedup_over_in_turn']:.2f}x over in turn; same answers: {same}; wrote {args.out}")


if __name__ == "__main__":
    main()
