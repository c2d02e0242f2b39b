"""octo's benchmarks: a few named suites, one runner, JSON out, earlier revisions served beside the checkout.

    .venv/bin/python bench/run.py --list                     # the suites, their parts, how long each takes
    .venv/bin/python bench/run.py gateway                    # a suite in full: the numbers docs/benchmarks.md cites
    .venv/bin/python bench/run.py gateway streams --quick    # a short run of each part: does it work here?
    .venv/bin/python bench/run.py gateway --compare fb1c285 HEAD~1   # those revisions served beside the checkout
    .venv/bin/python bench/run.py streams --only paired      # one part of a suite (the others' results are kept)
    .venv/bin/python bench/run.py --table                    # docs/benchmarks.md's rows, from bench/results/

Suites (bench/suites.py): gateway, streams, agent, startup, speech, vision, engines, load. Each runs its parts, scripts
of this folder that also run alone, one after another, and writes one JSON file per suite, bench/results/SUITE.json
(``--out FILE`` writes elsewhere): the machine (CPU model, cores, AVX-512, AMX, memory), the date, octo's revision,
and per part its command, its seconds, the load on the host while it ran and its own JSON result. The load is the
1-minute load average and, better, the cores that processes other than the benchmark's kept busy (``others_cores``,
from /proc): a result measured while others used more than a quarter of a core is marked busy.

``--compare REV...`` serves octo at those git revisions too, each from a worktree under ``.cache/revisions/``
(bench/revtree.py), in the same alternating rounds as the checkout, in every part that serves octo over HTTP
(``--list`` says which): ``--compare HEAD~1`` for the last commit, ``--compare fb1c285`` for a fixed earlier one,
both at once to see both. The runner takes ``/tmp/octo-bench.lock`` so that no two benchmarks share the host.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from importlib.util import find_spec
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
LOCK = "/tmp/octo-bench.lock"
BUSY_CORES = 0.25  # others' average use of the cores above which a result is marked as measured on a busy host
sys.path.insert(0, str(BENCH))
from suites import SUITES, Part, Suite, generic_rows  # noqa: E402

# ---- the machine, the revision, the load --------------------------------------------------------------------------

def machine() -> dict:
    """What the numbers were measured on."""
    info: dict = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "machine": platform.machine(), "system": platform.platform(terse=True),
                  "python": platform.python_version()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = [dict(kv.split(":", 1) for kv in block.splitlines() if ":" in kv) for block in cpuinfo.split("\n\n")]
    fields = [{k.strip(): v.strip() for k, v in f.items()} for f in fields if f]
    flags = set(fields[0].get("flags", "").split()) if fields else set()
    cores = {(f.get("physical id"), f.get("core id")) for f in fields if "core id" in f}
    info.update(cpu=fields[0].get("model name", info["cpu"]) if fields else info["cpu"],
                physical_cores=len(cores) or None, avx512="avx512f" in flags,
                amx=any(f.startswith("amx") for f in flags), vm="hypervisor" in flags)
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kb = int(next(ln for ln in meminfo if ln.startswith("MemTotal")).split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info


def describe(m: dict) -> str:
    """``2-core AMD EPYC VM, AVX-512, no AMX, 23.4 GiB``."""
    parts = [f"{m.get('cpus')}-core {m.get('cpu')}" + (" VM" if m.get("vm") else "")]
    if "avx512" in m:
        parts += ["AVX-512" if m["avx512"] else "no AVX-512", "AMX" if m["amx"] else "no AMX"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']:g} GiB")
    return ", ".join(parts)


def short_host(m: dict) -> str:
    """``2-core AMD EPYC VM (AVX-512, no AMX)``: the table's host column."""
    flags = ""
    if "avx512" in m:
        flags = f" ({'AVX-512' if m['avx512'] else 'no AVX-512'}, {'AMX' if m['amx'] else 'no AMX'})"
    return f"{m.get('cpus')}-core {m.get('cpu')}" + (" VM" if m.get("vm") else "") + flags


def revision() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", "octo", "engines", "plugins")
    return {"commit": git("rev-parse", "--short", "HEAD"), "local_changes": bool(changed)}


def _cpu_ticks(root: int) -> tuple[int, int]:
    """(ticks every CPU spent busy, ticks of ``root`` and its descendants: running and reaped)."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
    procs: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            rest = s[s.rfind(")") + 2:].split()
            procs[int(d)] = (int(rest[1]), sum(int(t) for t in rest[11:15]))  # ppid; utime stime cutime cstime
    children = defaultdict(list)
    for pid, (ppid, _) in procs.items():
        children[ppid].append(pid)
    mine, stack = 0, [root]
    while stack:
        pid = stack.pop()
        mine += procs.get(pid, (0, 0))[1]
        stack += children[pid]
    return busy, mine


class LoadWatch:
    """The load average, and the cores that processes outside this run kept busy: over the whole run, and sampled every
    ``every`` seconds (for the peak) in a thread."""

    def __init__(self, every: float = 2.0) -> None:
        self.every, self.samples, self.others = every, [], []
        self.linux = Path("/proc/stat").exists()
        self.hz = os.sysconf("SC_CLK_TCK") if self.linux else 100
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _snapshot(self) -> tuple[float, int, int] | None:
        return (time.monotonic(), *_cpu_ticks(os.getpid())) if self.linux else None

    def _others(self, a, b) -> float:
        return max(0.0, ((b[1] - a[1]) - max(0, b[2] - a[2])) / self.hz / max(1e-3, b[0] - a[0]))

    def _run(self) -> None:
        prev = self.start
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])
            if prev:
                now = self._snapshot()
                self.others.append(self._others(prev, now))
                prev = now

    def __enter__(self) -> LoadWatch:
        self.before = os.getloadavg()[0]
        self.start = self._snapshot()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = self._snapshot()

    def report(self) -> dict:
        loads = self.samples or [os.getloadavg()[0]]
        out = {"load_before": round(self.before, 2), "load_median": round(statistics.median(loads), 2),
               "load_max": round(max(loads), 2), "busy": None}
        if self.start and self.end:
            out["others_cores"] = round(self._others(self.start, self.end), 2)
            out["others_cores_max"] = round(max([out["others_cores"], *self.others]), 2)
            out["busy"] = out["others_cores"] > BUSY_CORES
        return out


# ---- running a part -------------------------------------------------------------------------------------------------

def missing(part: Part) -> str | None:
    if not (BENCH / part.script).is_file():
        return f"bench/{part.script} is not in this checkout"
    for need in part.needs:
        if need.startswith("bin:"):
            if not shutil.which(need[4:]):
                return f"the program {need[4:]} is not installed"
        elif need.startswith("file:"):
            if not (REPO / need[5:]).exists():
                return f"{need[5:]} does not exist"
        elif find_spec(need) is None:
            return f"the Python module {need} is not installed"
    return None


def run_part(suite: Suite, part: Part, quick: bool, compare: list[str]) -> dict:
    args = [*(part.quick if quick else part.full), *part.compare_args(compare)]
    command = " ".join(["bench/" + part.script, *map(shlex.quote, args)])
    record: dict = {"script": "bench/" + part.script, "what": part.what, "command": command,
                    "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if compare and not part.compare:
        record["compare"] = "not supported by this part: the checkout alone"
    why = missing(part)
    if why:
        print(f"[{suite.name}/{part.name}] skipped: {why}", flush=True)
        return {**record, "skipped": why}
    print(f"[{suite.name}/{part.name}] {command}", flush=True)
    tail: deque[str] = deque(maxlen=40)
    with tempfile.TemporaryDirectory(prefix="octo-bench-") as tmp, LoadWatch() as watch:
        out = Path(tmp) / "result.json"
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(BENCH / part.script), *args, "--out", str(out)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"[{suite.name}/{part.name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
        record["seconds"] = round(time.monotonic() - t0, 1)
        result = json.loads(out.read_text()) if out.exists() else None
    record["load"] = watch.report()
    if rc != 0 or result is None:
        return {**record, "error": f"exit status {rc}" if rc else "no result written", "log_tail": list(tail)}
    record["rows"] = [list(r) for r in rows_of(part, result)]
    record["result"] = result
    return record


def rows_of(part: Part, result: dict) -> list[tuple[str, str]]:
    try:
        return (part.rows or generic_rows)(result)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        return [(part.what, f"(no summary: {type(e).__name__}: {e})")]


def run_suite(suite: Suite, args: argparse.Namespace, compare: list[str]) -> dict:
    parts = [p for p in suite.parts if not args.only or p.name in args.only]
    doc = {"suite": suite.name, "what": suite.what, "mode": "quick" if args.quick else "full",
           "machine": machine(), "octo": revision(), "compare": compare, "parts": {}}
    doc["host"] = describe(doc["machine"])
    run = " ".join(["bench/run.py", suite.name, *(["--quick"] if args.quick else []),
                    *(["--only", *[p.name for p in parts]] if args.only else []), *(["--compare", *compare] if compare
                                                                                     else [])])
    for part in parts:
        doc["parts"][part.name] = {**run_part(suite, part, args.quick, compare), "octo": doc["octo"], "run": run}
    return doc


def merged(path: Path, doc: dict) -> dict:
    """``doc`` with the parts of an earlier result for the same machine that this run did not measure."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return doc
    if old.get("machine", {}).get("cpu") != doc["machine"].get("cpu") or old.get("mode") != doc["mode"]:
        return doc
    kept = {k: {"octo": old.get("octo"), **v} for k, v in old.get("parts", {}).items() if k not in doc["parts"]}
    return {**doc, "parts": {**kept, **doc["parts"]}}  # each kept part with the revision it measured


# ---- the table ------------------------------------------------------------------------------------------------------

def table(paths: list[Path]) -> str:
    """docs/benchmarks.md's rows: what, result, the command, and when, where and under what load it was measured."""
    lines = ["| what | result | command | measured |", "|---|---|---|---|"]
    files = [json.loads(path.read_text()) for path in paths]
    for doc in [d for f in files for d in f.get("suites", [f])]:
        suite = SUITES.get(doc.get("suite"))
        for name, rec in doc.get("parts", {}).items():
            part = next((p for p in suite.parts if p.name == name), None) if suite else None
            rows = rows_of(part, rec["result"]) if part and "result" in rec else [tuple(r) for r in rec.get("rows", [])]
            if "result" not in rec:
                rows = [(rec.get("what", name), "not measured: " + rec.get("skipped", rec.get("error", "?")))]
            load = rec.get("load", {})
            busy = {True: "**busy host**", False: "quiet host"}.get(load.get("busy"), "host load")
            octo = rec.get("octo") or doc["octo"]  # the revision this part measured (a kept part: an earlier one)
            where = (f"{rec.get('date', '')[:10]}, {short_host(doc.get('machine', {}))}, octo {octo['commit']}"
                     + ("+changes" if octo.get("local_changes") else "")
                     + f"; {busy} (others {load.get('others_cores', '?')} cores, load {load.get('load_median', '?')})"
                     + ("; quick run" if doc.get("mode") == "quick" else ""))
            cmd = "`" + rec.get("run", f"bench/run.py {doc['suite']}" + (" --quick" if doc.get("mode") == "quick"
                                                                           else "")) + "`"
            for what, value in rows:
                lines.append(f"| {what} | {value} | {cmd} | {where} |".replace("\n", " "))
    return "\n".join(lines)


def listing() -> str:
    out = []
    for s in SUITES.values():
        quick = sum(p.minutes[0] for p in s.parts)
        full = sum(p.minutes[1] for p in s.parts)
        out.append(f"{s.name}: {s.what}  (~{quick:g} min quick, ~{full:g} min full)")
        for p in s.parts:
            cmp = "" if p.compare else "  [no --compare]"
            out.append(f"  {p.name:15} bench/{p.script}: {p.what} (~{p.minutes[0]:g} / {p.minutes[1]:g} min){cmp}")
    return "\n".join(out)


# ---- the command line -----------------------------------------------------------------------------------------------

def take_lock() -> object:
    f = open(LOCK, "a")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for {LOCK}: another benchmark is running (a run wrapped in `flock {LOCK}` waits for itself: "
              "drop the flock or pass --no-lock)", flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


def resolve(revs: list[str]) -> list[str]:
    out = []
    for rev in revs:
        p = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"bench/run.py: --compare {rev}: not a revision of this repository")
        out.append(p.stdout.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="suites: " + ", ".join(SUITES) + " (--list describes them)")
    ap.add_argument("suites", nargs="*", metavar="SUITE", help="the suites to run (all: every one)")
    ap.add_argument("--quick", action="store_true", help="a short run of each part: checks it works, noisy numbers")
    ap.add_argument("--compare", nargs="+", default=[], metavar="REV",
                    help="git revisions whose octo is served beside the checkout in the same rounds")
    ap.add_argument("--only", nargs="+", default=[], metavar="PART", help="only these parts of the suites")
    ap.add_argument("--out", type=Path, help="write the results here instead of bench/results/SUITE.json")
    ap.add_argument("--list", action="store_true", help="describe the suites and their parts, and exit")
    ap.add_argument("--table", nargs="*", type=Path, metavar="FILE",
                    help="print docs/benchmarks.md's table rows from these results (default: bench/results/*.json)")
    ap.add_argument("--no-lock", action="store_true", help=f"do not take {LOCK} (the caller holds it)")
    args = ap.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.table is not None:
        print(table(args.table or sorted(RESULTS.glob("*.json"))))
        return 0
    names = list(SUITES) if args.suites == ["all"] else args.suites
    unknown = [n for n in names if n not in SUITES]
    if not names or unknown:
        ap.error(f"unknown suite {unknown[0]!r}" if unknown else "name a suite (or --list)")
    parts = {p.name for n in names for p in SUITES[n].parts}
    if set(args.only) - parts:
        ap.error(f"no part {sorted(set(args.only) - parts)[0]!r} in {', '.join(names)}")
    compare = resolve(args.compare)
    lock = None if args.no_lock else take_lock()
    docs, failed = [], 0
    try:
        for name in names:
            doc = run_suite(SUITES[name], args, compare)
            failed += sum("error" in p for p in doc["parts"].values())
            path = RESULTS / f"{name}.json"
            if args.out is None:
                if args.only:
                    doc = merged(path, doc)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(doc, indent=1) + "\n")
                print(f"wrote {path}", flush=True)
            docs.append(doc)
    finally:
        if lock:
            lock.close()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(docs[0] if len(docs) == 1 else {"suites": docs}, indent=1) + "\n")
        print(f"wrote {args.out}", flush=True)
    for doc in docs:
        for name, rec in doc["parts"].items():
            for what, value in rec.get("rows", []):
                print(f"{doc['suite']}/{name}: {what}: {value}")
            if "error" in rec or "skipped" in rec:
                print(f"{doc['suite']}/{name}: {rec.get('error') or 'skipped: ' + rec['skipped']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
