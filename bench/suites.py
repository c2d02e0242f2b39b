"""The suites of ``bench/run.py``: which scripts each one runs, with which options in its full and its quick form, how
a script serves earlier revisions beside the checkout, and the rows of docs/benchmarks.md's table a result gives.

Every part is a script of this folder that also runs alone (``.venv/bin/python bench/X.py --help``); the runner
passes it ``--out FILE`` and reads the JSON back. ``minutes`` is how long a part takes on a 2-core x86-64 host
(quick, full); a busy host takes longer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

Rows = list[tuple[str, str]]


@dataclass(frozen=True)
class Part:
    name: str
    script: str
    what: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    compare: str | None = "--compare"  # the option that serves octo at earlier revisions beside, or None
    needs: tuple[str, ...] = ()  # Python modules, or "bin:PROGRAM", or "file:PATH" (relative to the repository)
    rows: Callable[[dict], Rows] | None = None
    minutes: tuple[float, float] = (1, 5)

    def compare_args(self, revs: list[str]) -> list[str]:
        if not revs or not self.compare:
            return []
        if self.compare.startswith("append:"):  # one option per revision (argparse's append)
            flag = self.compare.removeprefix("append:")
            return [x for rev in revs for x in (flag, rev)]
        return [self.compare, *revs]


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    parts: tuple[Part, ...] = field(default_factory=tuple)


# ---- reading results ------------------------------------------------------------------------------------------------

def get(d, *path, default=None):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def streams(n) -> str:
    """``1 stream``, ``8 streams``."""
    n = str(n).split("_")[0]
    return f"{n} stream" if n == "1" else f"{n} streams"


def x(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def num(v, digits: int = 1, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}{unit}"


def compared(d: dict | None, fmt: Callable[[object], str]) -> str:
    """``; octo@abc1234 V`` for each revision served beside (keys ``octo@REV``)."""
    if not isinstance(d, dict):
        return ""
    return "".join(f"; {k} {fmt(v)}" for k, v in d.items() if k.startswith("octo@"))


# ---- gateway --------------------------------------------------------------------------------------------------------

def overhead_rows(r: dict) -> Rows:
    out = []
    for c, row in get(r, "concurrency", default={}).items():
        o, bare = row.get("octo", {}), row.get("bare", {})
        others = compared(row, lambda v: f"{x(v.get('ratio_rps'))} ({num(v.get('cpu_us_per_request'), 0)} µs)")
        out.append((f"non-streamed chat at concurrency {c}: octo (echo) / a bare aiohttp server, requests/s",
                     f"{x(o.get('ratio_rps'))} (rounds {'-'.join(x(v) for v in o.get('ratio_range', []))}); "
                     f"{num(o.get('rps'), 0)} vs {num(bare.get('rps'), 0)} req/s; CPU a request "
                     f"{num(o.get('cpu_us_per_request'), 0)} vs {num(bare.get('cpu_us_per_request'), 0)} µs"
                     + others))
    return out


def callcount_rows(r: dict) -> Rows:
    s = get(r, "servers", default={})
    o = s.get("octo", {})
    return [("Python / C calls per non-streamed chat request (every thread; the same on a busy host)",
             f"{num(o.get('python_calls'))} / {num(o.get('c_calls'))}"
             + compared(s, lambda v: f"{num(v.get('python_calls'))} / {num(v.get('c_calls'))}"))]


def events_wire_rows(r: dict) -> Rows:
    o = get(r, "servers", "octo", default={})
    return [("a stream event from the worker's engine thread to SSE bytes, CPU ns per event (worker + gateway)",
             f"{num(o.get('worker'), 0)} + {num(o.get('gateway'), 0)} ns; "
             f"{num(o.get('wire_bytes_per_event'))} bytes on the wire"
             + compared(get(r, "ratio_to_compared"), lambda v: f"octo / it: {x(v.get('gateway'))} gateway"))]


def stream_cost_rows(r: dict) -> Rows:
    out = []
    for n, s in get(r, "summary", default={}).items():
        out.append((f"gateway CPU per streamed token, {streams(n)}: octo / a bare aiohttp server streaming the "
                    f"same SSE", f"{x(s.get('gateway_vs_bare'))} ({num(s.get('octo_gateway_us_per_token'), 0)} vs "
                    f"{num(s.get('bare_server_us_per_token'), 0)} µs; the worker "
                    f"{num(s.get('octo_worker_us_per_token'), 0)} µs)"))
    return out


def ollama_rows(r: dict) -> Rows:
    cells = get(r, "cells", default={})
    return [("Ollama's /api/chat / OpenAI's /v1/chat/completions, same server and model (requests/s, CPU a request)",
             "; ".join(f"{k.replace('_c', ' c=')} {x(v.get('ratio_median'))} (CPU {x(v.get('cpu_ratio_median'))})"
                       for k, v in cells.items()))] if cells else []


def dashboard_rows(r: dict) -> Rows:
    return [("p50 of sequential chat requests with 5 live dashboard feeds / with none (and page reloads)",
             f"{x(r.get('ratio_p50_live_feeds'))} ({x(r.get('ratio_p50_feeds_and_reloads'))}); "
             f"{num(get(r, 'no_dashboard', 'p50_ms'), 2)} ms without")]


# ---- streams --------------------------------------------------------------------------------------------------------

def llamacpp_rows(r: dict) -> Rows:
    q = r.get("ratios", {})
    raw = [f"{streams(k[12:])} {x(v, 3)}" for k, v in q.items() if k.startswith("octo_vs_raw_")]
    lcp = [f"{streams(k[25:])} {x(v)}" for k, v in q.items() if k.startswith("octo_vs_llama_cpp_server_")
           and "e2e" not in k]
    rows = [("llama.cpp decode tok/s: octo over HTTP / a bare llama_decode loop in process", "; ".join(raw) or "-")]
    if lcp:
        rows.append(("llama.cpp decode tok/s: octo / llama-cpp-python's server", "; ".join(lcp)))
    if "ttft_miss_vs_hit" in q:
        rows.append(("time to first token, 2,000-token system prompt: a miss / a prefix-cache hit",
                     x(q["ttft_miss_vs_hit"], 1)))
    return rows


def paired_rows(r: dict) -> Rows:
    out = []
    for n, lv in get(r, "levels", default={}).items():
        extra = "".join(f"; {k.removesuffix('_paired_decode_ratio')} {x(v, 3)}" for k, v in lv.items()
                        if k.endswith("_paired_decode_ratio") and k != "paired_decode_ratio")
        tok = lv.get("decode_tok_s", {})
        out.append((f"decode tok/s, {streams(n)}: octo / llama-server, same GGUF (median of paired rounds)",
                    f"{x(lv.get('paired_decode_ratio'), 3)} (end to end {x(lv.get('paired_e2e_ratio'), 3)}; "
                    f"{num(tok.get('octo'))} vs {num(tok.get('llama-server'))} tok/s; ahead in "
                    f"{lv.get('octo_ahead_rounds')} of {lv.get('rounds')} rounds){extra}"))
    return out


def workers_rows(r: dict) -> Rows:
    dec = get(r, "decode", default={})
    rows = [("decode tok/s: the model in an engine worker process / in the gateway process",
             "; ".join(f"{streams(n)} {x(v.get('ratio'), 3)}" for n, v in dec.items()))] if dec else []
    for n, t in get(r, "ttft", default={}).items():
        rows.append((f"time to first token, {streams(n)}: worker process - gateway process (mean)",
                     f"{t.get('mean_delta_ms', 0):+.1f} ms ({num(t.get('process_mean_ms'))} vs "
                     f"{num(t.get('thread_mean_ms'))} ms)"))
    return rows


# ---- agent ----------------------------------------------------------------------------------------------------------

def agent_rows(r: dict) -> Rows:
    s = get(r, "summary", default={})
    q = s.get("ratio_octo_over_llama_server", {})
    c = get(r, "config", default={})
    if not q:
        return []
    revs = "".join(f"; {k[6:-18]} {x(v.get('wall_s'), 3)} / {x(v.get('mean_ttft_s'), 3)}" for k, v in s.items()
                   if k.startswith("ratio_octo@"))
    return [(f"agent workload ({c.get('conversations')} conversations x {c.get('turns')} turns, "
             f"{c.get('concurrency')} in flight, a {r.get('prefix_tokens')}-token shared prefix): octo / llama-server",
             f"wall time {x(q.get('wall_s'), 3)} ({num(get(s, 'octo', 'wall_s'))} vs "
             f"{num(get(s, 'llama-server', 'wall_s'))} s); mean time to first token {x(q.get('mean_ttft_s'), 3)}"
             + revs)]


def agent_prefill_rows(r: dict) -> Rows:
    out = []
    for agent, a in get(r, "summary", default={}).items():
        if not isinstance(a, dict) or "rounds" not in a:
            continue
        ratios = [(k.split(" / ")[0], k.rsplit(" ", 1)[-1], v) for k, v in a.items()
                  if " / llama-server " in k and isinstance(v, dict)]
        toks = a.get("prompt_tokens", ["?", "?"])
        out.append((f"{agent}'s real prompt ({toks[0]} tokens, next turn {toks[1]}): time to first token, "
                    "octo / llama-server",
                    "; ".join(f"{w} {x(v.get('median'), 3)}" + (f" ({c})" if c != "octo" else "")
                              for c, w, v in ratios)
                    + f" (octo {num(a.get('octo cold ttft_s'), 2)} s cold, "
                      f"{num(a.get('octo next_turn ttft_s'), 2)} s next turn: {x(a.get('octo cold / next turn'), 1)} "
                      f"faster; llama-server {num(a.get('llama-server cold ttft_s'), 2)} s and "
                      f"{num(a.get('llama-server next_turn ttft_s'), 2)} s)"))
    return out


def disk_cache_rows(r: dict) -> Rows:
    s = r.get("summary", {})
    n = get(r, "runs", default=[{}])[0].get("system_tokens")
    return [(f"time to first token, {n}-token prefix: cold / in-memory prefix cache / disk cache after a restart",
             f"{num(s.get('cold_s'), 2)} / {num(s.get('memory_hit_s'), 2)} / {num(s.get('disk_hit_s'), 2)} s "
             f"(disk {x(s.get('disk_over_memory'))} of memory)")] if s else []


# ---- startup --------------------------------------------------------------------------------------------------------

STARTUP_CASES = {"octo_warm": "`octo serve MODEL`, warm `OCTO_HOME`", "octo_first": "`octo serve MODEL`, fresh "
                 "`OCTO_HOME`", "octo_on_demand": "a running gateway loads the model on demand",
                 "octo_switch": "`--max-loaded 1`, a switch between two models"}


def startup_rows(r: dict) -> Rows:
    med, low = r.get("median_s", {}), r.get("quietest_s", {})
    rows = [("llama-server spawned, spawn to first streamed token (median / quietest)",
             f"{num(med.get('llama_server'), 2)} / {num(low.get('llama_server'), 2)} s")]
    ratio = {**r.get("ratio_to_llama_server", {}), **r.get("switch_ratio_to_restart", {})}
    for case, label in STARTUP_CASES.items():
        if case in med:
            of = "a llama-server restart" if case == "octo_switch" else "llama-server's"
            revs = "".join(f"; {k.split('/')[0]} {num(v, 2)} s" for k, v in med.items() if k.endswith("/" + case))
            rows.append((f"{label}, to first token (median / quietest; ratio to {of})",
                         f"{num(med[case], 2)} / {num(low.get(case), 2)} s "
                         f"({x(get(ratio, case, 'median'))} / {x(get(ratio, case, 'quietest'))}){revs}"))
    return rows


def busy_start_rows(r: dict) -> Rows:
    host = "no load added" if not r.get("spinners") else f"{r['spinners']} process(es) computing beside it"
    first, later = get(r, "first_start_s", "octo"), get(r, "later_starts_median_s", "octo")
    revs = "".join(f"; {k} {num(v, 2)} s first, {num(get(r, 'later_starts_median_s', k), 2)} s later"
                   for k, v in get(r, "first_start_s", default={}).items() if k != "octo")
    return [(f"`octo serve demo` (3 engines, start-up selection), {host}: a host's first start / later starts",
             f"{num(first, 2)} s / {num(later, 2)} s" + revs)]


def selection_rows(r: dict) -> Rows:
    s = r.get("startup", {})
    return [("start-up selection: picks what `octo bench` finds fastest; seconds it adds to a first start "
             "(cached: later starts)",
             f"{'agrees' if r.get('agree') else 'differs'} ({s.get('winner')} / "
             f"{get(r, 'octo_bench', 'winner')}); {num(s.get('seconds_added_by_selection'))} s "
             f"({num(s.get('seconds_cached'), 2)} s cached)")]


# ---- speech ---------------------------------------------------------------------------------------------------------

def speech_rows(r: dict) -> Rows:
    e = r.get("engines", {})
    return [("time per transcription through octo / the bare runtime, same weights and audio",
             "; ".join(f"{k} {v.get('octo_overhead_paired', v.get('octo_overhead', 0)):+.1%}" for k, v in e.items())),
            ("resident memory, gateway + engine worker per loaded model",
             "; ".join(f"{k} {num(v.get('server_rss_mb'), 0)} MB" for k, v in e.items()))] if e else []


def speech_engines_rows(r: dict) -> Rows:
    c = r.get("configs", {})
    rows = [("transcription at equal work (200 tokens a request), speed / the whisper engine's",
             "; ".join(f"{k} {x(v.get('speedup_vs_whisper'))}" for k, v in c.items()))] if c else []
    if "selection" in r:
        rows.append(("start-up selection among the speech engines picks", str(get(r, "selection", "winner",
                                                                                    default=r["selection"]))))
    return rows


def speech_batch_rows(r: dict) -> Rows:
    n = get(r, "settings", "concurrent")
    return [(f"faster-whisper, {n} transcriptions at once: batched / one after another (and / workers=2)",
             f"{x(r.get('batched_speedup_over_in_turn'))} ({x(r.get('workers_speedup_over_in_turn'))})")]


# ---- vision ---------------------------------------------------------------------------------------------------------

def vision_parity_rows(r: dict) -> Rows:
    models = r.get("models", {})
    cells = []
    for name, m in models.items():
        cases = m.get("cases", {})
        same = sum(bool(c.get("same_prompt_tokens") and c.get("same_tokens")) for c in cases.values())
        cells.append(f"{name} {same} of {len(cases)} cases")
    return [("image prompts: the same prompt tokens and greedy tokens as llama-server (same GGUF and projector)",
             ("all the same: " if r.get("all_same") else "**differ**: ") + "; ".join(cells))]


def vision_rows(r: dict) -> Rows:
    rows = []
    t = r.get("ttft", {})
    if t:
        rows.append(("time to first token of an image prompt (a new picture): octo / llama-server",
                     f"{x(t.get('octo_vs_llama_server_first_turn'), 3)} ({num(get(t, 'octo', 'first_turn_s'), 2)} vs "
                     f"{num(get(t, 'llama-server', 'first_turn_s'), 2)} s); a second turn: octo "
                     f"{x(get(t, 'octo', 'second_turn_speedup'), 1)} faster, llama-server "
                     f"{x(get(t, 'llama-server', 'second_turn_speedup'), 1)}"))
    g = r.get("gaps", {})
    if g:
        rows.append(("other streams while an image encodes: their longest gap between tokens, octo / llama-server",
                     f"{num(get(g, 'octo', 'during_max_ms'), 0)} / "
                     f"{num(get(g, 'llama-server', 'during_max_ms'), 0)} ms "
                     f"(before the image: {num(get(g, 'octo', 'before_max_ms'), 0)} / "
                     f"{num(get(g, 'llama-server', 'before_max_ms'), 0)} ms)"))
    return rows


# ---- engines --------------------------------------------------------------------------------------------------------

def onnx_rows(r: dict) -> Rows:
    q = r.get("ratios", {})
    return [("ONNX Runtime GenAI decode tok/s: octo over HTTP / a bare og.Generator loop",
             "; ".join(f"{streams(k[12:])} {x(v, 3)}" for k, v in q.items() if k.startswith("octo_vs_raw_")))]


def mlx_rows(r: dict) -> Rows:
    runs = r.get("runs", [])
    return [("MLX decode tok/s: octo's scheduler / mlx-lm directly (1 stream; 8 streams)",
             "; ".join(f"{v.get('quant')}/{v.get('blas')} {x(v.get('ratio_single_decode'))}; "
                       f"{x(v.get('ratio_batch_decode'))}" for v in runs))] if runs else []


def constrained_rows(r: dict) -> Rows:
    return [("8 greedy streams with a JSON schema / unconstrained, decode tok/s",
             "; ".join(f"{e['engine']} {x(e['ratio'])}" if "ratio" in e else f"{e['engine']}: {e.get('error')}"
                       for e in r.get("engines", [])))]


def kv_quant_rows(r: dict) -> Rows:
    t = r.get("types", {})
    return [("KV cache q8_0 / q4_0 against f16: bytes a token, the context a fixed budget holds, decode tok/s",
             "; ".join(f"{k} {x(get(v, 'vs_f16', 'kv_bytes'))}, {x(get(v, 'vs_f16', 'max_context'), 1)}, "
                       f"{x(get(v, 'vs_f16', 'decode_tok_s'))}" for k, v in t.items() if "vs_f16" in v))] if t else []


def lora_rows(r: dict) -> Rows:
    return [(f"LoRA, 8 streams on {name}: decode tok/s with one adapter / two mixed / base+adapter, "
             "against no adapter",
             f"{x(get(e, 'vs_base', 'one'))} / {x(get(e, 'vs_base', 'two'))} / {x(get(e, 'vs_base', 'base+one'))}")
            for name, e in r.get("engines", {}).items()]


def speculative_rows(r: dict) -> Rows:
    out = []
    for pair, p in r.get("pairs", {}).items():
        cells = [f"{streams(k)} {x(v.get('speedup'))}" for k, v in p.items()
                 if isinstance(v, dict) and "speedup" in v]
        acc = next((v.get("acceptance") for v in p.values() if isinstance(v, dict) and "acceptance" in v), None)
        out.append((f"speculative decoding, {pair}: tok/s with the draft / without", "; ".join(cells)
                    + (f" (acceptance {acc:.0%})" if acc is not None else "")))
    return out


# ---- load -----------------------------------------------------------------------------------------------------------

def kv_pressure_rows(r: dict) -> Rows:
    s = r.get("servers", {})
    fails = sum(v.get("failures", 0) for v in s.values())
    return [("streams needing twice the KV pool: failures; tok/s against a pool large enough (swap, recompute)",
             f"{fails} failures; " + "; ".join(f"{k.removesuffix('_vs_large')} {x(v)}"
                                               for k, v in r.get("ratios", {}).items()))]


def adversarial_rows(r: dict) -> Rows:
    out = []
    for stretch, rows in r.get("results", {}).items():
        cells = [f"{k} {x(v.get('ratio'))}" for k, v in rows.items() if isinstance(v, dict) and "ratio" in v]
        out.append((f"a 4-token request beside an adversarial one / alone ({stretch})", "; ".join(cells)))
    return out


def multimodel_rows(r: dict) -> Rows:
    rows = [("load on demand: first token - (load + warm time to first token)",
             f"{get(r, 'on_demand', 'overhead_s_median', default=0):+.3f} s"),
            ("resident memory after unloading, last / first of the load-unload cycles",
             x(get(r, "memory", "last_over_first_unloaded"), 3))]
    for share, s in r.get("sharing", {}).items():
        rows.append((f"two busy models sharing the cores (`--share-cores {share}`): sum / one alone; each / alone",
                     f"{x(s.get('sum_over_mean_single'), 3)}; {s.get('each_over_own_single')}"))
    return rows


def cluster_rows(r: dict) -> Rows:
    o = r.get("overhead", {})
    return [("Ray Serve cluster path, echo at concurrency 8: p50 added (and Ray Serve's own floor)",
             f"{num(o.get('p50_added_ms'), 1)} ms ({num(get(o, 'ray_floor', 'p50_ms'), 1)} ms)")] if o else []


# ---- fallback: ratios and speed-ups wherever a result has them ------------------------------------------------------

def generic_rows(r: dict, limit: int = 6) -> Rows:
    found: list[tuple[str, float]] = []

    def walk(d, path):
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, [*path, str(k)])
        elif isinstance(d, (int, float)) and not isinstance(d, bool) and path and \
                any(w in path[-1] for w in ("ratio", "speedup", "over")):
            found.append((" ".join(path), float(d)))

    walk(r, [])
    return [(k, f"{v:.3g}") for k, v in found[:limit]]


def median(v):
    return statistics.median(v) if v else None


LLAMA_SERVER = ("llama_cpp", "bin:cmake")  # bench/llama_server.py builds it once (about 6 minutes on 2 cores)

SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("gateway", "the gateway's own cost per request and per streamed token (echo engine: no model compute)", (
        Part("overhead", "overhead.py", "requests/s and CPU a request: octo vs a bare aiohttp server",
             ("--concurrency", "1,8,64", "--rounds", "5", "--requests", "4000"),
             ("--concurrency", "8", "--rounds", "2", "--requests", "1000"), rows=overhead_rows, minutes=(1, 8)),
        Part("callcount", "callcount.py", "Python and C calls per request, every thread",
             ("--requests", "3000"), ("--requests", "500"), rows=callcount_rows, minutes=(0.5, 2)),
        Part("events_wire", "events_wire.py", "a stream event's CPU from the worker's engine thread to SSE bytes",
             ("--rounds", "5"), ("--rounds", "2"), rows=events_wire_rows, minutes=(0.5, 1)),
        Part("stream_cost", "stream_cost.py", "gateway CPU per streamed token vs a bare SSE server",
             (), ("--rounds", "2", "--tokens", "100"), compare=None, rows=stream_cost_rows, minutes=(1, 5)),
        Part("ollama", "ollama.py", "Ollama's routes vs OpenAI's on one server",
             ("--rounds", "7"), ("--rounds", "2", "--requests", "16"), compare=None, rows=ollama_rows,
             minutes=(1, 4)),
        Part("dashboard", "dashboard.py", "whether open dashboards slow the API",
             (), ("--blocks", "2"), compare=None, needs=("bin:curl",), rows=dashboard_rows, minutes=(1, 3)),
    )),
    Suite("streams", "decode throughput against llama-server and the bare runtime on the same GGUF and threads", (
        Part("paired", "paired.py", "octo vs llama-server, paired rounds at 1, 8 and 16 streams",
             ("--streams", "1", "8", "16", "--rounds", "8", "6", "6"), ("--streams", "8", "--rounds", "2"),
             needs=LLAMA_SERVER, rows=paired_rows, minutes=(3, 25)),
        Part("llamacpp", "llamacpp.py", "octo vs a bare llama_decode loop and llama-cpp-python's server",
             ("--streams", "8", "16", "--reps", "3", "--skip", "cpp"),
             ("--streams", "8", "--reps", "1", "--skip", "kv", "cpp", "lcp"),
             compare=None, needs=("llama_cpp",), rows=llamacpp_rows, minutes=(3, 20)),
        Part("workers", "workers.py", "the engine worker process vs the model in the gateway",
             ("--streams", "1", "8", "16", "--reps", "3", "--ttft-reps", "9"),
             ("--streams", "8", "--reps", "1", "--ttft-reps", "2"), compare=None, needs=("llama_cpp",),
             rows=workers_rows, minutes=(3, 20)),
    )),
    Suite("agent", "coding agents' traffic against llama-server: a multi-turn workload and the agents' real prompts", (
        Part("agent", "agent.py", "8 conversations x 3 turns, 4 in flight, a 1,900-token shared prefix",
             ("--rounds", "2"), ("--rounds", "1", "--conversations", "4", "--turns", "2"),
             needs=LLAMA_SERVER, rows=agent_rows, minutes=(6, 20)),
        Part("agent_prefill", "agent_prefill.py", "Codex's and Claude Code's real prompts, cold and next turn",
             ("--rounds", "2"), ("--rounds", "1", "--agents", "codex", "--no-probe"), compare="append:--octo-rev",
             needs=LLAMA_SERVER, rows=agent_prefill_rows, minutes=(8, 30)),
        Part("disk_cache", "disk_cache.py", "a long prefix from disk after a restart vs in memory vs cold",
             ("--rounds", "3"), ("--rounds", "1", "--prefix-tokens", "1000"), compare=None, needs=("llama_cpp",),
             rows=disk_cache_rows, minutes=(2, 10)),
    )),
    Suite("startup", "from `octo serve` to the first streamed token, quiet and busy, and the start-up selection", (
        Part("startup", "startup.py", "spawn, load on demand and model switch to first token, vs llama-server",
             ("--rounds", "4"), ("--rounds", "1"), needs=LLAMA_SERVER, rows=startup_rows, minutes=(2, 8)),
        Part("demo_quiet", "busy_start.py", "`octo serve demo` (three engines), no load added: first and later starts",
             ("--spinners", "0", "--rounds", "4"), ("--spinners", "0", "--rounds", "2"), rows=busy_start_rows,
             minutes=(2, 4)),
        Part("demo_busy", "busy_start.py", "`octo serve demo`, another process computing: first and later starts",
             ("--spinners", "1", "--rounds", "4"), ("--spinners", "1", "--rounds", "2"), rows=busy_start_rows,
             minutes=(2, 4)),
        Part("selection", "selection.py", "whether the start-up selection picks the engine `octo bench` finds fastest",
             ("--seconds", "3"), ("--seconds", "1.5", "--bench-seconds", "1.5"), compare=None,
             rows=selection_rows, minutes=(3, 5)),
    )),
    Suite("speech", "the speech engines through octo against their bare runtimes, at equal work, and batched", (
        Part("speech", "speech.py", "whisper, faster-whisper and whisper.cpp through octo vs bare, same weights",
             ("--rounds", "5", "--seconds", "10", "--max-new-tokens", "32"),
             ("--rounds", "1", "--seconds", "5", "--max-new-tokens", "16"), compare=None,
             needs=("whisper", "faster_whisper", "pywhispercpp", "bin:ffmpeg", "bin:espeak-ng"), rows=speech_rows,
             minutes=(3, 10)),
        Part("speech_engines", "speech_engines.py", "the engines at equal work (steady synthetic Whisper base)",
             ("--rounds", "3", "--selection"), ("--rounds", "1", "--configs", "whisper,faster-whisper"), compare=None,
             needs=("whisper", "faster_whisper", "bin:ffmpeg", "bin:espeak-ng"), rows=speech_engines_rows,
             minutes=(3, 15)),
        Part("speech_batch", "speech_batch.py", "faster-whisper: concurrent transcriptions batched vs in turn",
             ("--rounds", "5", "--concurrent", "4"), ("--rounds", "1"), compare=None,
             needs=("faster_whisper", "bin:ffmpeg", "bin:espeak-ng"), rows=speech_batch_rows, minutes=(2, 6)),
    )),
    Suite("vision", "images against llama-server on the same GGUF and projector: correctness and speed", (
        Part("vision_parity", "vision_parity.py", "same prompt tokens and greedy tokens as llama-server", (),
             ("--max-tokens", "8"), compare=None, needs=LLAMA_SERVER, rows=vision_parity_rows, minutes=(3, 4)),
        Part("vision", "vision.py", "time to first token with an image, and the other streams while one encodes",
             ("--reps", "3"), ("--reps", "1"), compare=None, needs=LLAMA_SERVER, rows=vision_rows,
             minutes=(5, 12)),
    )),
    Suite("engines", "each engine against its own runtime's loop, and the cost of the engine features", (
        Part("onnx", "onnx.py", "ONNX Runtime GenAI: octo vs a bare og.Generator loop", (),
             ("--reps", "1", "--streams", "4", "--skip", "staggered", "ttft"), compare=None,
             needs=("onnxruntime_genai",), rows=onnx_rows, minutes=(4, 15)),
        Part("mlx", "mlx.py", "MLX: octo's scheduler vs mlx-lm directly", (),
             ("--configs", "4bit:bundled", "--repeats", "1", "--tokens", "12"), compare=None, needs=("mlx_lm",),
             rows=mlx_rows, minutes=(3, 15)),
        Part("constrained", "constrained.py", "JSON-schema decoding vs unconstrained, per engine", (),
             ("--reps", "1", "--engines", "llamacpp"), compare=None, needs=("llguidance",), rows=constrained_rows,
             minutes=(2, 12)),
        Part("kv_quant", "kv_quant.py", "KV-cache types f16, q8_0, q4_0", ("--rounds", "4"),
             ("--rounds", "1", "--agree-prompts", "8", "--prompt-tokens", "128"), compare=None, needs=("llama_cpp",),
             rows=kv_quant_rows, minutes=(2, 8)),
        Part("lora", "lora.py", "several LoRA adapters in one batch", ("--rounds", "6"),
             ("--rounds", "1", "--steps", "16"), compare=None, rows=lora_rows, minutes=(1, 4)),
        Part("speculative", "speculative.py", "speculative decoding with a draft model", (),
             ("--rounds", "1", "--streams", "1", "--decode", "32"), compare=None, needs=("llama_cpp",),
             rows=speculative_rows, minutes=(4, 15)),
    )),
    Suite("load", "under load: KV pressure, adversarial requests, several models, a Ray Serve cluster", (
        Part("kv_pressure", "kv_pressure.py", "8 streams needing twice the KV pool", (),
             ("--tokens", "400", "--small-cells", "1792"), compare=None, needs=("llama_cpp",),
             rows=kv_pressure_rows, minutes=(3, 15)),
        Part("adversarial", "adversarial.py", "a short request beside adversarial ones", (),
             ("--rounds", "1", "--step-stretch", "2", "--only", "long-prompt", "wide-n"), compare=None,
             needs=("llama_cpp",), rows=adversarial_rows, minutes=(3, 15)),
        Part("multimodel", "multimodel.py", "load on demand, two models sharing the cores, memory over cycles", (),
             ("--reps", "1", "--cycles", "2", "--tokens", "32"), compare=None,
             needs=("llama_cpp", "onnxruntime_genai", "whisper"), rows=multimodel_rows, minutes=(5, 15)),
        Part("cluster", "cluster.py", "what the Ray Serve path costs, and a second replica", (),
             ("--rounds", "2", "--requests", "100", "--tp-rounds", "1", "--turns", "3"), compare=None,
             needs=("ray",), rows=cluster_rows, minutes=(4, 12)),
    )),
]}
