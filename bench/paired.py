"""octo against the C++ llama-server on short streams, as paired rounds: per round each server streams N greedy
completions of ``--short`` and of ``--long`` tokens (their order alternating between rounds), and the round's ratio is
octo's rate over llama-server's. The median of those paired ratios is less moved by a host that drifts between
rounds than a ratio of medians. Decode rate is differential (``N x (long - short) / (wall_long - wall_short)``),
end to end is ``N x long / wall_long`` (``bench/llamacpp.py``'s ``decode_rate``, servers and loads).

    flock /tmp/octo-bench.lock .venv/bin/python bench/paired.py [--streams 1 8 16] [--compare REV ...] [--out FILE]

``--variant NAME="-o kv_unified=false"`` adds an octo server with those extra arguments to every round (its ratios to
llama-server are paired the same way), e.g. the per-sequence KV streams beside the default unified pool.
``--compare REV...`` adds octo served at those git revisions (bench/revtree.py) to every round, e.g. the commit before a
refactoring beside the checkout: a change that costs speed shows as a ratio below the revision's in the same rounds.
Part of ``bench/run.py streams``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from llamacpp import cpp_cmd, decode_rate, free_port, load, octo_cmd, run_levels, server, settle  # noqa: E402
from revtree import short_sha, worktree  # noqa: E402


def level(path: str, n: int, rounds: int, args) -> dict:
    octos = {"octo": [], **{name: extra.split() for name, extra in args.variant.items()}}
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in [*octos, "llama-server"]}
    with contextlib.ExitStack() as st:
        bases = {}
        for name, extra in octos.items():
            p = free_port()
            cmd, cwd = octo_cmd(path, p, args, max(8, n)) + extra, REPO
            if name in args.compare:  # that revision's octo, `python -m octo.cli` in its worktree (older: no .main)
                cmd, cwd = [*cmd[:2], "octo.cli", *cmd[3:]], args.compare[name]
            bases[name] = st.enter_context(server(cmd, p, "/health", name, cwd=cwd))
        p = free_port()
        bases["llama-server"] = st.enter_context(server(cpp_cmd(path, p, args, n), p, "/health", "llama-server"))
        for base in bases.values():
            asyncio.run(load(base, n, 8, "warm"))
        settle()
        for r in range(rounds):
            for name in (list(bases) if r % 2 == 0 else list(bases)[::-1]):
                res[name].append(decode_rate(bases[name], n, args, f"{name[0]}{n}r{r}"))
            print(n, r, {k: [round(x, 1) for x in v[-1]] for k, v in res.items()}, file=sys.stderr, flush=True)
    c = res["llama-server"]
    out: dict = {"rounds": rounds}
    for name in octos:
        o = res[name]
        key = "" if name == "octo" else f"{name}_"
        out[f"{key}paired_decode_ratio"] = round(statistics.median(a[0] / b[0] for a, b in zip(o, c, strict=True)), 3)
        out[f"{key}paired_e2e_ratio"] = round(statistics.median(a[1] / b[1] for a, b in zip(o, c, strict=True)), 3)
        out[f"{key}octo_ahead_rounds"] = sum(a[0] > b[0] for a, b in zip(o, c, strict=True))
    return {
        **out,
        "decode_tok_s": {k: round(statistics.median(x[0] for x in v), 2) for k, v in res.items()},
        "e2e_tok_s": {k: round(statistics.median(x[1] for x in v), 2) for k, v in res.items()},
        "runs": {k: [[round(x, 2) for x in pair] for pair in v] for k, v in res.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, nargs="+", default=[12, 8, 6], help="rounds per level (the last repeats)")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", nargs="*", default=[], metavar='NAME="ARGS"',
                    help="another octo server with extra arguments, e.g. streams=\"-o kv_unified=false\"")
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV", help="octo at these git revisions, beside")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench" / "paired.json"))
    args = ap.parse_args()
    args.variant = dict(v.split("=", 1) for v in args.variant)
    args.compare = {f"octo@{short_sha(r)}": str(worktree(r)) for r in args.compare}
    args.variant.update(dict.fromkeys(args.compare, ""))
    if {"octo", "llama-server"} & set(args.variant):
        ap.error("a variant needs a name of its own")
    run_levels(args, level, args.rounds, "runs")


if __name__ == "__main__":
    main()
