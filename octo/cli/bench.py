"""``octo bench``: the long benchmark, every engine x batch size, table + JSON (+ a PNG chart with matplotlib).

Each engine runs in its own worker process, one after another (never two at once), so its memory
high-water mark is its own and engines cannot disturb each other. ``--shape`` builds synthetic models
of a real architecture, so a user learns which engine wins here before downloading anything.

In each worker the engine first takes the start-up benchmark ``octo serve`` takes (``micro_benchmark``: short
prompts, each thread count, the fastest set), reported beside the long rows, so both figures come from one engine
at one thread count: the long rows then measure serving-shaped work (``--prompt`` tokens per sequence, each shape
warmed up first, decode for ``--seconds`` as the context grows), which a small model answers at other rates than
the start-up benchmark's short prompts. Reports go to ``OCTO_HOME/bench-reports`` (``--out``).
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from octo.atomic import replacing, write_json
from octo.runtime.benchmark import BATCH

# Quantisation per engine for "--quant 4bit" / "fp" on synthetic shapes.
QUANTS = {"4bit": {"llamacpp": "q4_k_m", "onnx": "int4", "mlx": "4bit"},
          "8bit": {"llamacpp": "q8_0", "onnx": "int4", "mlx": "4bit"},
          "fp": {"llamacpp": "f16", "onnx": "fp32", "mlx": None}}
PROMPT = 256
STARTUP_SECONDS = 3.0  # the start-up benchmark's budget (octo serve's --bench-seconds default)


def run_worker(engine_name: str, artifact: str, batches: list[int], seconds: float, options: dict[str, str],
               prompt: int = PROMPT) -> dict:
    """Measure one engine in this process (called in a child process, an engine worker of its own as in serving)."""
    from octo.engine import EngineConfig
    from octo.plugins import engine_registry
    from octo.runtime.benchmark import bench_prompt, decode_steps, free_sequences, micro_benchmark, start_sequences

    cls = engine_registry()[engine_name]
    engine = cls(EngineConfig(max_batch=max(batches), options=options, own_process=True))
    t0 = time.perf_counter()
    engine.load(artifact, "bench")
    out: dict[str, Any] = {"engine": engine_name, "version": cls.version(), "artifact": artifact,
                           "load_s": round(time.perf_counter() - t0, 3), "batching": cls.batching,
                           "info": engine.info.extra, "rows": []}
    # the start-up benchmark first: its figures, and the thread count it sets, which the long rows then use
    startup = micro_benchmark(engine, STARTUP_SECONDS)
    out["startup"] = {k: startup.get(k) for k in ("prefill_tok_s", "decode_tok_s", "batch_decode_tok_s", "threads",
                                                  "score", "error")}
    out["startup"]["disturbed"] = bool((startup.get("conditions") or {}).get("disturbed"))
    for b in batches:  # every shape once, untimed: a shape's first steps are slow on some engines
        warm = start_sequences(engine, list(range(500, 500 + b)),
                               [bench_prompt(engine, prompt, 50 + i) for i in range(b)])
        decode_steps(engine, warm, time.perf_counter() + 0.2, 4)
        free_sequences(engine, warm)
    for b in batches:
        prompts = [bench_prompt(engine, prompt, 100 + i) for i in range(b)]
        t0 = time.perf_counter()
        first = start_sequences(engine, [1000], prompts[:1])
        ttft = time.perf_counter() - t0
        free_sequences(engine, first)
        t0 = time.perf_counter()
        seqs = start_sequences(engine, list(range(2000, 2000 + b)), prompts)
        prefill = sum(len(p) for p in prompts) / (time.perf_counter() - t0)
        toks, dt = decode_steps(engine, seqs, time.perf_counter() + seconds, 10_000)
        free_sequences(engine, seqs)
        out["rows"].append({"batch": b, "prompt_tokens": len(prompts[0]), "ttft_s": round(ttft, 4),
                            "prefill_tok_s": round(prefill, 2), "decode_tok_s": round(toks / dt, 2),
                            "decode_tokens": toks})
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def _artifacts(model: str | None, shape: str | None, engines: list[str], quant: str) -> dict[str, str]:
    if shape:
        from octo.synth import build_for

        out = {}
        for e in engines:
            click.echo(f"octo bench: building synthetic {shape} for {e} ({QUANTS[quant].get(e)}) ...", err=True)
            out[e] = str(build_for(shape, e, QUANTS[quant].get(e)))
        return out
    from octo.models.catalog import load_catalog
    from octo.models.download import fetch
    from octo.plugins import engine_registry

    reg = engine_registry()
    resolved = load_catalog().resolve(model, {c.name: c.formats for c in reg.values()})
    return {e: str(fetch(a)) for e, a in resolved.artifacts.items() if e in engines}


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [r["engine"] for r in report["engines"] if not r.get("error")]
    batches = report["batches"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(engines))
    for i, r in enumerate(e for e in report["engines"] if not e.get("error")):
        vals = [next((row["decode_tok_s"] for row in r["rows"] if row["batch"] == b), 0) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], vals, width, label=r["engine"])
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("decode tok/s (aggregate)")
    ax.set_title(f"octo bench: {report['model']} on {report['host']['cpu'][:40]}")
    ax.legend()
    fig.tight_layout()
    with replacing(path) as tmp:  # atomic: a run killed while saving leaves no half-written chart
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


@click.command("bench")
@click.argument("model", required=False)
@click.option("--shape", default=None, help="Benchmark a synthetic model of this shape (e.g. qwen2.5-0.5b).")
@click.option("--engines", "engines_opt", default=None, help="Comma-separated engines (default: all available).")
@click.option("--batch", "batch_opt", default="1,4,8", show_default=True, help="Batch sizes.")
@click.option("--quant", default="4bit", show_default=True, type=click.Choice(sorted(QUANTS)),
              help="Weights format for --shape builds.")
@click.option("--prompt", default=PROMPT, show_default=True, type=click.IntRange(1), help="Prompt tokens a sequence.")
@click.option("--seconds", default=5.0, show_default=True, help="Decode time per engine and batch size.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE", help="Engine option (repeatable).")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder for the JSON report and the chart (default: OCTO_HOME/bench-reports).")
def bench(model, shape, engines_opt, batch_opt, quant, prompt, seconds, options, out):
    """Long benchmark of every engine x batch size: prefill/decode tok/s, time to first token, peak memory; and each
    engine's start-up benchmark (what `octo serve` measures) beside it."""
    from octo.cli.serve import serve_options
    from octo.plugins import engine_registry
    from octo.runtime.selection import host_fingerprint

    if bool(model) == bool(shape):
        raise click.UsageError("give either MODEL or --shape NAME")
    reg = engine_registry()
    wanted = engines_opt.split(",") if engines_opt else [n for n in ("llamacpp", "onnx", "mlx") if n in reg]
    engines = [e for e in wanted if e in reg and reg[e].detect().available]
    for e in set(wanted) - set(engines):
        click.echo(f"octo bench: skipping {e}: not available here", err=True)
    batches = [int(b) for b in batch_opt.split(",")]
    artifacts = _artifacts(model, shape, engines, quant)
    report: dict[str, Any] = {"model": model or f"synthetic {shape} ({quant})", "host": host_fingerprint(),
                              "python": platform.python_version(), "batches": batches, "seconds": seconds,
                              "prompt_tokens": prompt, "engines": []}
    for e in engines:
        if e not in artifacts:
            report["engines"].append({"engine": e, "error": "no artifact for this model"})
            continue
        click.echo(f"octo bench: {e} ...", err=True)
        report["engines"].append(_measure(e, artifacts[e], batches, seconds, serve_options(options), prompt))
    _print(report)
    stem = (shape or model).replace("/", "_").replace(":", "_")
    _write(report, Path(out).expanduser() if out else reports_dir(), stem)


def reports_dir() -> Path:
    from octo.paths import octo_home

    return octo_home() / "bench-reports"


def _measure(engine: str, artifact: str, batches: list[int], seconds: float, options: dict[str, str],
             prompt: int) -> dict:
    """One engine measured in a child process: its report, or its error."""
    args = json.dumps({"engine": engine, "artifact": artifact, "batches": batches, "seconds": seconds,
                       "options": options, "prompt": prompt})
    proc = subprocess.run([sys.executable, "-m", "octo.cli.bench", args], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"engine": engine, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _print(report: dict) -> None:
    """The long rows, the start-up benchmark's figures beside them, each view's winner, and why they may differ."""
    from octo.cli.common import print_table

    rows, startup = [], []
    for r in report["engines"]:
        rows += [{"engine": r["engine"], **row, "peak_rss_mb": r["peak_rss_mb"]} for row in r.get("rows", [])]
        if r.get("error"):
            rows.append({"engine": r["engine"], "error": r["error"]})
        if r.get("startup"):
            startup.append({"engine": r["engine"], **r["startup"], "disturbed": "yes" if r["startup"]["disturbed"]
                            else None})
    print_table(rows, ["engine", "batch", "prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb",
                       "error"])
    ok = [r for r in report["engines"] if r.get("rows")]
    if ok:
        report["winner"] = max(ok, key=lambda r: max(row["decode_tok_s"] for row in r["rows"]))["engine"]
    if startup:
        click.echo("\nStart-up benchmark (what `octo serve` measures to choose: 16- and 64-token prompts, single and "
                   f"batch-{BATCH} decode at a short context, each thread count; the long rows above use its threads):")
        print_table(startup, ["engine", "prefill_tok_s", "decode_tok_s", "batch_decode_tok_s", "threads", "score",
                              "disturbed", "error"])
        scored = [s for s in startup if not s.get("error")]
        report["startup_winner"] = max(scored, key=lambda s: s["score"] or 0)["engine"] if scored else None
    if report.get("startup_winner") and report.get("winner") and report["startup_winner"] != report["winner"]:
        click.echo(f"octo bench: the long rows' best decode is {report['winner']}'s and the start-up benchmark's "
                   f"best score {report['startup_winner']}'s: they weigh other work (--prompt {report['prompt_tokens']}"
                   " tokens and long decodes here, short prompts there), and a measurement marked disturbed was "
                   "taken while other processes were busy", err=True)


def _write(report: dict, outdir: Path, stem: str) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    write_json(outdir / f"bench-{stem}.json", report, indent=2)
    wrote = f"{outdir}/bench-{stem}.json"
    if any(r.get("rows") for r in report["engines"]):
        try:
            chart(report, outdir / f"bench-{stem}.png")
            wrote += " and .png"
        except ImportError:
            click.echo("octo bench: no chart (matplotlib is not installed; pip install matplotlib draws one)",
                       err=True)
    click.echo(f"octo bench: winner {report.get('winner')} (long rows), {report.get('startup_winner')} (start-up "
               f"benchmark); wrote {wrote}", err=True)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = run_worker(spec["engine"], spec["artifact"], spec["batches"], spec["seconds"], spec["options"],
                        spec.get("prompt", PROMPT))
    print(json.dumps(result))
