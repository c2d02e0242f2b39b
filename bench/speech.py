"""Benchmark: the three speech engines on the same weights and the same audio, through octo and bare.

One synthetic Whisper (random weights from a fixed seed, ``--shape``, default the real "tiny" dimensions)
converted to each engine's format by ``octo.synth`` (openai .pt, CTranslate2 float32 folder, ggml f16), one
espeak-ng recording (``--seconds`` long), the same decoding settings everywhere: greedy, no temperature
fallback, at most ``--max-new-tokens`` per 30-second window (random weights babble until a limit; the
fallback would repeat a window a random number of times), ``--threads`` threads.

Per engine: a real ``octo serve FILE --engine E`` driven by the official openai SDK (upload, multipart,
ffmpeg, admission queue, engine, JSON), and the bare runtime in a process of its own (``whisper.transcribe``,
faster-whisper's ``WhisperModel.transcribe``, pywhispercpp's ``Model.transcribe``, each from the file decoded
by ffmpeg, timed inside that process). Rounds alternate engine and side so drift from other users of the
machine hits all alike.
Reported: median seconds per request (octo and bare), octo's overhead over bare, speed-up over the whisper
engine through octo, decoded tokens (the work), peak RSS of each server's process tree after its requests.

Run it alone on the machine:  flock /tmp/octo-bench.lock .venv/bin/python bench/speech.py
Writes bench/results/speech.json.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]  # bench/whisper.py != whisper
sys.path.insert(0, str(REPO / "tests"))
TEXT = (
    "Speech recognition turns spoken words into text. This sentence was synthesized by espeak for a benchmark "
    "of the octo gateway, which serves whisper models behind an OpenAI compatible interface. The quick brown "
    "fox jumps over the lazy dog, while the busy engineers measure how fast each request is transcribed. "
)
ENGINES = ("whisper", "faster-whisper", "whispercpp")


def artifacts(shape: str) -> dict[str, Path]:
    from octo.synth.speech import build_whisper_ct2, build_whisper_ggml
    from octo.synth.whisper import build_whisper

    return {"whisper": build_whisper(shape), "faster-whisper": build_whisper_ct2(shape),
            "whispercpp": build_whisper_ggml(shape)}


def recording(seconds: float, out: Path) -> Path:
    """``TEXT`` spoken by espeak-ng, repeated and cut to ``seconds``, as a 16 kHz mono WAV."""
    from octo.synth.whisper import speech

    raw = speech(TEXT * max(1, int(seconds // 12) + 1), out.with_suffix(".raw.wav"))
    subprocess.run(["ffmpeg", "-y", "-loglevel", "error", "-i", str(raw), "-t", str(seconds), "-ar", "16000",
                    "-ac", "1", str(out)], check=True)
    return out


def bare_runner(engine: str, path: Path, threads: int, max_new: int):
    """A function transcribing a file with ``engine``'s runtime alone, returning its token count. It runs in a
    process of its own that imports only that runtime (as octo's worker does): runtimes loaded together share
    OpenMP libraries, and on a busy host that alone changes PyTorch's speed several times over."""
    import whisper

    if engine == "whisper":
        import torch

        torch.set_num_threads(threads)
        ow = whisper.load_model(str(path), device="cpu")
    elif engine == "faster-whisper":
        from faster_whisper import WhisperModel

        fw = WhisperModel(str(path), device="cpu", compute_type="default", cpu_threads=threads)
    else:
        import _pywhispercpp as pw
        from pywhispercpp.model import Model

        wc = Model(str(path), redirect_whispercpp_logs_to=None, n_threads=threads, print_progress=False)

    def run_whisper(path: Path) -> int:
        r = whisper.transcribe(ow, str(path), language="en", temperature=0.0, fp16=False, sample_len=max_new)
        return sum(len(s["tokens"]) for s in r["segments"])

    def run_faster(path: Path) -> int:
        audio = whisper.load_audio(str(path))
        segments, _ = fw.transcribe(audio, language="en", beam_size=1, best_of=1, temperature=[0.0],
                                    max_new_tokens=max_new, vad_filter=False)
        return sum(len(s.tokens) for s in segments)

    def run_cpp(path: Path) -> int:
        audio = whisper.load_audio(str(path))
        segs = wc.transcribe(audio, language="en", temperature=0.0, temperature_inc=0.0, max_tokens=max_new,
                             no_context=True, greedy={"best_of": 1})
        return sum(pw.whisper_full_n_tokens(wc._ctx, i) for i in range(len(segs)))  # noqa: SLF001

    return {"whisper": run_whisper, "faster-whisper": run_faster, "whispercpp": run_cpp}[engine]


def bare_process(args) -> None:
    """``--bare ENGINE``: load the runtime, then for each file path read on stdin print {"s", "tokens"}."""
    run = bare_runner(args.bare, artifacts(args.shape)[args.bare], args.threads, args.max_new_tokens)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        n = run(Path(line.strip()))
        print(json.dumps({"s": time.perf_counter() - t0, "tokens": n}), flush=True)


class Bare:
    """A ``--bare ENGINE`` process of this script."""

    def __init__(self, engine: str, args) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare", engine, "--shape", args.shape, "--threads", str(args.threads),
             "--max-new-tokens", str(args.max_new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        while (line := self.proc.stdout.readline()) and line.strip() != "ready":
            pass

    def __call__(self, path: Path) -> tuple[float, int]:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        while not (line := self.proc.stdout.readline()).startswith("{"):
            if not line:
                raise RuntimeError("the bare runtime process died")
        r = json.loads(line)
        return r["s"], r["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "speech.json"))
    ap.add_argument("--bare", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare:
        return bare_process(args)

    from serverproc import rss_tree, run_octo

    load_start = os.getloadavg()
    paths = artifacts(args.shape)
    tmp = Path(tempfile.mkdtemp(prefix="octo-speech-bench-"))
    wav = recording(args.seconds, tmp / "speech.wav")
    opts = ["-o", f"max_new_tokens={args.max_new_tokens}", "-o", "temperature_increment=0",
            "-o", f"threads={args.threads}"]
    bare = {e: Bare(e, args) for e in ENGINES}
    times: dict[str, dict[str, list[float]]] = {e: {"octo": [], "bare": []} for e in ENGINES}
    tokens: dict[str, dict[str, int]] = {e: {} for e in ENGINES}
    rss: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        servers = {e: stack.enter_context(run_octo(str(paths[e]), "--engine", e, *opts, "--max-audio-mb", "64",
                                                   timeout=600)) for e in ENGINES}
        clients = {e: s.openai(timeout=900) for e, s in servers.items()}

        def octo(engine: str) -> int:
            r = clients[engine].audio.transcriptions.create(model="whisper-1", file=wav.open("rb"), language="en",
                                                            response_format="verbose_json")
            return sum(len(s.tokens or []) for s in r.segments or [])

        for e in ENGINES:  # warm-up, untimed
            stack.callback(bare[e].close)
            octo(e)
            bare[e](wav)
        for r in range(args.rounds):
            order = ENGINES if r % 2 == 0 else tuple(reversed(ENGINES))
            for e in order:
                for side in (("octo", "bare") if r % 2 == 0 else ("bare", "octo")):
                    if side == "octo":
                        t0 = time.perf_counter()
                        n = octo(e)
                        dt = time.perf_counter() - t0
                    else:
                        dt, n = bare[e](wav)
                    times[e][side].append(dt)
                    tokens[e][side] = n
            print(f"round {r + 1}: " + ", ".join(f"{e} octo {times[e]['octo'][-1]:.2f} s bare "
                                                 f"{times[e]['bare'][-1]:.2f} s" for e in ENGINES), flush=True)
        for e, s in servers.items():
            rss[e] = rss_tree(s.proc.pid)
    med = {e: {side: statistics.median(v) for side, v in t.items()} for e, t in times.items()}
    ref = med["whisper"]["octo"]
    result = {
        "bench": "speech engines, same weights and audio",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_start": load_start},
        "settings": vars(args) | {"audio_seconds": args.seconds, "decoding": "greedy, no fallback"},
        "engines": {
            e: {
                "octo_s": round(med[e]["octo"], 3),
                "bare_s": round(med[e]["bare"], 3),
                "octo_overhead": round(med[e]["octo"] / med[e]["bare"] - 1, 4),
                "speedup_vs_whisper_octo": round(ref / med[e]["octo"], 3),
                "x_realtime_octo": round(args.seconds / med[e]["octo"], 2),
                "octo_runs_s": [round(x, 3) for x in times[e]["octo"]],
                "bare_runs_s": [round(x, 3) for x in times[e]["bare"]],
                "spread_octo": round((max(times[e]["octo"]) - min(times[e]["octo"])) / med[e]["octo"], 3),
                "tokens_octo": tokens[e].get("octo"),
                "tokens_bare": tokens[e].get("bare"),
                "server_rss_mb": round(rss[e] / 2**20, 1),
            }
            for e in ENGINES
        },
        "loadavg_end": os.getloadavg(),
        "noise": "shared 2-core host: other engineers' jobs run meanwhile; rounds alternate engines and sides",
    }
    winner = max(ENGINES, key=lambda e: result["engines"][e]["speedup_vs_whisper_octo"])
    result["winner"] = winner
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for e in ENGINES:
        r = result["engines"][e]
        print(f"{e:15s} octo {r['octo_s']:7.3f} s  bare {r['bare_s']:7.3f} s  overhead {r['octo_overhead']:+.1%}  "
              f"speed-up {r['speedup_vs_whisper_octo']:.2f}x  rss {r['server_rss_mb']} MB  tokens {r['tokens_octo']}")
    print(f"winner: {winner}; wrote {args.out}")


if __name__ == "__main__":
    main()
