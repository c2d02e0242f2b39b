"""``octo bench``: the long benchmark, every engine x batch size, table + JSON + PNG chart.

Each engine runs in its own worker process, one after another (never two at once), so its memory
high-water mark is its own and engines cannot disturb each other. ``--shape`` builds synthetic models
of a real architecture, so a user learns which engine wins here before downloading anything.
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

# Quantisation per engine for "--quant 4bit" / "fp" on synthetic shapes.
QUANTS = {"4bit": {"llamacpp": "q4_k_m", "onnx": "int4", "mlx": "4bit"},
          "8bit": {"llamacpp": "q8_0", "onnx": "int4", "mlx": "4bit"},
          "fp": {"llamacpp": "f16", "onnx": "fp32", "mlx": None}}
PROMPT = 256


def run_worker(engine_name: str, artifact: str, batches: list[int], seconds: float, options: dict[str, str],
               prompt: int = PROMPT) -> dict:
    """Measure one engine in this process (called in a child process)."""
    from octo.engine import EngineConfig
    from octo.plugins import engine_registry
    from octo.runtime.benchmark import bench_prompt, decode_steps, free_sequences, start_sequences

    cls = engine_registry()[engine_name]
    engine = cls(EngineConfig(max_batch=max(batches), options=options))
    t0 = time.perf_counter()
    engine.load(artifact, "bench")
    out: dict[str, Any] = {"engine": engine_name, "version": cls.version(), "artifact": artifact,
                           "load_s": round(time.perf_counter() - t0, 3), "batching": cls.batching,
                           "info": engine.info.extra, "rows": []}
    warm = start_sequences(engine, [1], [bench_prompt(engine, 16, 1)])
    decode_steps(engine, warm, time.perf_counter() + 0.5, 4)
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
@click.option("--seconds", default=5.0, show_default=True, help="Decode time per engine and batch size.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE", help="Engine option (repeatable).")
@click.option("--out", default="bench/results", show_default=True, type=click.Path(file_okay=False))
def bench(model, shape, engines_opt, batch_opt, quant, seconds, options, out):
    """Long benchmark of every engine x batch size: prefill/decode tok/s, time to first token, peak memory."""
    from octo.cli.common import print_table
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
                              "engines": []}
    for e in engines:
        if e not in artifacts:
            report["engines"].append({"engine": e, "error": "no artifact for this model"})
            continue
        click.echo(f"octo bench: {e} ...", err=True)
        args = json.dumps({"engine": e, "artifact": artifacts[e], "batches": batches, "seconds": seconds,
                           "options": serve_options(options)})
        proc = subprocess.run([sys.executable, "-m", "octo.cli.bench", args], capture_output=True, text=True)
        if proc.returncode != 0:
            report["engines"].append({"engine": e, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]})
            continue
        report["engines"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for r in report["engines"]:
        for row in r.get("rows", []):
            rows.append({"engine": r["engine"], **row, "peak_rss_mb": r["peak_rss_mb"]})
        if r.get("error"):
            rows.append({"engine": r["engine"], "error": r["error"]})
    ok = [r for r in report["engines"] if r.get("rows")]
    if ok:
        def best(r):
            return max(row["decode_tok_s"] for row in r["rows"])
        report["winner"] = max(ok, key=best)["engine"]
    print_table(rows, ["engine", "batch", "prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb",
                        "error"])
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = (shape or model).replace("/", "_").replace(":", "_")
    write_json(outdir / f"bench-{stem}.json", report, indent=2)
    if ok:
        chart(report, outdir / f"bench-{stem}.png")
    click.echo(f"octo bench: winner {report.get('winner')}; wrote {outdir}/bench-{stem}.json and .png", err=True)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = run_worker(spec["engine"], spec["artifact"], spec["batches"], spec["seconds"], spec["options"],
                        spec.get("prompt", PROMPT))
    print(json.dumps(result))
