"""Benchmark: the three speech engines on the same weights and the same audio, through octo and bare.

One synthetic Whisper (random weights from a fixed seed, ``--shape``, default the real "tiny" dimensions)
converted to each engine's format by ``octo.synth`` (openai .pt, CTranslate2 float32 folder, ggml f16), one
espeak-ng recording (``--seconds`` long), the same decoding settings everywhere: greedy, no temperature
fallback, at most ``--max-new-tokens`` per 30-second window (random weights babble until a limit; the
fallback would repeat a window a random number of times), ``--threads`` threads.

Per engine: a real ``octo serve FILE --engine E`` driven by the official openai SDK (upload, multipart,
ffmpeg, admission queue, engine, JSON), and the bare runtime in a process of its own (``whisper.transcribe``,
faster-whisper's ``WhisperModel.transcribe``, pywhispercpp's ``Model.transcribe``, each called with the options
octo's engine passes, from the file decoded by ffmpeg, timed inside that process; only that runtime imported).
Rounds alternate engine and side so drift from other users of the machine hits all alike.
Reported: median seconds per request (octo and bare), octo's overhead over bare (ratio of medians, and the
median of the rounds' own ratios), speed-up over the whisper engine through octo, decoded tokens (the work),
peak RSS of each engine worker (one loaded model) and of each bare process, the server tree's RSS.

Run it alone on the machine:  flock /tmp/octo-bench.lock .venv/bin/python bench/speech.py
Writes JSON to ``--out``; part of ``bench/run.py speech``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
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


def load_audio(path: Path):
    """The file as 16 kHz mono float32 samples, decoded by ffmpeg as ``whisper.load_audio`` does (without importing
    whisper, hence torch, into the processes of the runtimes that do not need it: their peak RSS is reported)."""
    import numpy as np

    pcm = subprocess.run(["ffmpeg", "-nostdin", "-threads", "0", "-i", str(path), "-f", "s16le", "-ac", "1",
                          "-acodec", "pcm_s16le", "-ar", "16000", "-"], capture_output=True, check=True).stdout
    return np.frombuffer(pcm, np.int16).flatten().astype(np.float32) / 32768.0


def bare_runner(engine: str, path: Path, threads: int, max_new: int):
    """A function transcribing a file with ``engine``'s runtime alone, returning its token count. It runs in a
    process of its own that imports only that runtime (as octo's worker does): runtimes loaded together share
    OpenMP libraries, and on a busy host that alone changes PyTorch's speed several times over."""
    if engine == "whisper":
        import torch
        import whisper

        torch.set_num_threads(threads)
        ow = whisper.load_model(str(path), device="cpu")
    elif engine == "faster-whisper":  # WhisperModel with OpenAI's window budget, as the engine loads it (no torch)
        from octo.engines.faster_whisper import model_class

        fw = model_class()(str(path), device="cpu", compute_type="auto", cpu_threads=threads)
    else:
        import _pywhispercpp as pw
        from pywhispercpp.model import Model

        wc = Model(str(path), params_sampling_strategy=0, redirect_whispercpp_logs_to=None, n_threads=threads,
                   print_progress=False, print_realtime=False, print_timestamps=False)

    def run_whisper(path: Path) -> int:
        r = whisper.transcribe(ow, str(path), language="en", temperature=0.0, fp16=False, sample_len=max_new)
        return sum(len(s["tokens"]) for s in r["segments"])

    def run_faster(path: Path) -> int:  # the keywords the faster-whisper engine passes (OpenAI's defaults)
        audio = load_audio(path)
        segments, _ = fw.transcribe(audio, language="en", task="transcribe", beam_size=1, best_of=1,
                                    temperature=[0.0], compression_ratio_threshold=2.4, log_prob_threshold=-1.0,
                                    no_speech_threshold=0.6, condition_on_previous_text=True, initial_prompt=None,
                                    word_timestamps=False, vad_filter=False, without_timestamps=False,
                                    max_new_tokens=max_new)
        return sum(len(s.tokens) for s in segments)

    def run_cpp(path: Path) -> int:  # the parameters the whispercpp engine passes (OpenAI's thresholds)
        from octo.engines.whispercpp import window_budget

        audio = load_audio(path)
        _, max_tokens = window_budget(max_new, pw.whisper_model_n_text_ctx(wc._ctx))  # noqa: SLF001
        segs = wc.transcribe(audio, language="en", translate=False, temperature=0.0, temperature_inc=0.0,
                             entropy_thold=2.4, logprob_thold=-1.0, no_speech_thold=0.6, no_context=True,
                             initial_prompt="", max_tokens=max_tokens,
                             token_timestamps=False, greedy={"best_of": 1},
                             beam_search={"beam_size": 1, "patience": -1.0}, detect_language=False)
        ctx, eot = wc._ctx, pw.whisper_token_eot(wc._ctx)  # noqa: SLF001
        return sum(pw.whisper_full_get_token_id(ctx, i, j) != eot  # as the engine's segments: without the end token
                   for i in range(len(segs)) for j in range(pw.whisper_full_n_tokens(ctx, i)))

    return {"whisper": run_whisper, "faster-whisper": run_faster, "whispercpp": run_cpp}[engine]


def bare_process(args) -> None:
    """``--bare ENGINE``: load the runtime, then for each file path read on stdin print {"s", "tokens"}."""
    run = bare_runner(args.bare, Path(args.artifact), args.threads, args.max_new_tokens)  # (no octo.synth: torch)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        n = run(Path(line.strip()))
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the model loaded and used
        print(json.dumps({"s": dt, "tokens": n, "peak_rss": peak}), flush=True)


class Bare:
    """A ``--bare ENGINE`` process of this script."""

    def __init__(self, engine: str, artifact: Path, args) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare", engine, "--artifact", str(artifact), "--threads", str(args.threads),
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
        self.peak_rss = r["peak_rss"]
        return r["s"], r["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def worker_peak_rss_mb(gateway_pid: int) -> float:
    """The largest peak resident size (VmHWM) among a gateway's child processes: its engine worker, holding the
    loaded model (the gateway itself holds none)."""
    from serverproc import children

    best = 0
    for pid in children(gateway_pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]))
    return round(best / 1024, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "speech.json"))
    ap.add_argument("--bare", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
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
    bare = {e: Bare(e, paths[e], args) for e in ENGINES}
    times: dict[str, dict[str, list[float]]] = {e: {"octo": [], "bare": []} for e in ENGINES}
    tokens: dict[str, dict[str, int]] = {e: {} for e in ENGINES}
    rss: dict[str, int] = {}
    peak: dict[str, float] = {}
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
            peak[e] = worker_peak_rss_mb(s.proc.pid)
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
                # each round's octo/bare ratio (the two ran back to back): drift between rounds cancels out
                "octo_overhead_paired": round(statistics.median(
                    o / b for o, b in zip(times[e]["octo"], times[e]["bare"], strict=True)) - 1, 4),
                "speedup_vs_whisper_octo": round(ref / med[e]["octo"], 3),
                "x_realtime_octo": round(args.seconds / med[e]["octo"], 2),
                "octo_runs_s": [round(x, 3) for x in times[e]["octo"]],
                "bare_runs_s": [round(x, 3) for x in times[e]["bare"]],
                "spread_octo": round((max(times[e]["octo"]) - min(times[e]["octo"])) / med[e]["octo"], 3),
                "tokens_octo": tokens[e].get("octo"),
                "tokens_bare": tokens[e].get("bare"),
                "server_rss_mb": round(rss[e] / 2**20, 1),  # gateway + engine worker, now
                "worker_peak_rss_mb": peak[e],  # the engine worker's peak: one loaded model, serving
                "bare_peak_rss_mb": round(bare[e].peak_rss / 2**20, 1),  # the bare runtime's process, same work
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
        print(f"{e:15s} octo {r['octo_s']:7.3f} s  bare {r['bare_s']:7.3f} s  overhead {r['octo_overhead']:+.1%} "
              f"(paired {r['octo_overhead_paired']:+.1%})  speed-up {r['speedup_vs_whisper_octo']:.2f}x  "
              f"worker peak {r['worker_peak_rss_mb']} MB (bare {r['bare_peak_rss_mb']} MB)  tokens {r['tokens_octo']}")
    print(f"winner: {winner}; wrote {args.out}")


if __name__ == "__main__":
    main()
