"""Per-event cost of a stream's events from a worker's engine thread to SSE bytes in the gateway, in two stages:

- worker: the engine thread's events into the worker's wire queue, one flushed message (pickled frame) per 8 events;
- gateway: frame by frame, the gateway reads it (``ipc.FrameReader``), its handle routes the events to the request's
  queue, and the chat route's task turns them into ``data:`` chunks (``octo.server.routes.openai._write_events``).

10,000 events: 70% text, 15% logprobs, 15% tool-call deltas (the kinds both vocabularies carry over the wire).

    python bench/events_wire.py                            # this checkout
    python bench/events_wire.py --compare REV --rounds 5   # alternating runs of this checkout and octo at REV

(REV's octo is checked out beside this one by bench/revtree.py.) Prints and writes (``--out``) the best of each stage
in ns of CPU time per event (the thread's CPU time: a busy host stretches wall time, less so this) and, with
--compare, this checkout's time over the revision's. Part of ``bench/run.py gateway``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

N = 10_000
STEP = 8


def _kinds() -> list[str]:
    out = []
    for i in range(N):
        r = i % 20
        out.append("lp" if r < 3 else "tool" if r < 6 else "text")
    return out


class _Sender:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames: list[bytes] = []

    def send_locked(self, msg: tuple) -> None:
        from octo.runtime import ipc

        self.frames.append(ipc.frame(msg))

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.send_locked(msg)


class _Resp:
    """The response the events are written to; also the stream's keep-alive once stopped (``live`` false, ``resp``
    itself: octo.server.keepalive.KeepAlive), so that a tree from before keep-alives is measured the same way."""

    live = False

    def __init__(self) -> None:
        self.n = 0
        self.resp = self

    async def write(self, data: bytes) -> None:
        self.n += len(data)


def run_once() -> dict[str, float]:
    from octo.runtime import ipc, remote, worker
    from octo.scheduler.jobs import Result
    from octo.server.routes import openai as api
    from octo.serving import openai as serving

    ev = None
    if hasattr(worker, "encode"):  # this tree: octo.scheduler.events (an older one: string-tagged tuples)
        from octo.scheduler import events as ev

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    sender = _Sender()
    outbox = worker.Outbox(sender, loop)
    wq = worker.WireQueue(outbox, 1)
    entry = (b"tok", -0.25, [(b"tok", -0.25), (b"tik", -1.5)])
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}
    kinds = _kinds()
    if ev is not None:
        make = {"text": lambda: ev.Text(0, "tok"), "lp": lambda: ev.Logprob(0, entry),
                "tool": lambda: ev.ToolDelta(0, delta)}
    else:
        make = {"text": lambda: (0, "text", "tok"), "lp": lambda: (0, "lp", entry), "tool": lambda: (0, "tool", delta)}
    makers = [make[k] for k in kinds]

    t0 = time.thread_time_ns()
    for i, mk in enumerate(makers):
        wq.put_nowait(mk())
        if i % STEP == STEP - 1:
            outbox.flush()
    outbox.flush()
    t_encode = time.thread_time_ns() - t0

    if ev is not None:
        from octo.runtime.handle import WireTicket

        h = remote.RemoteHandle.__new__(remote.RemoteHandle)
        h._requests = {}
        tickets = [WireTicket(loop, 1, 0)]
        queue = h.open_request(1, tickets, True)
        on_events = h.on_wire
    else:
        h = remote.RemoteHandle.__new__(remote.RemoteHandle)
        tickets = [remote.RemoteTicket(loop, 1, 0)]
        queue = asyncio.Queue()
        h._requests = {1: remote._Request(tickets, queue, True)}
        on_events = h._on_events
    reader = ipc.FrameReader(lambda msg: on_events(msg[1]), lambda: None)
    result = Result("tok" * N, "stop", 10, N, 0, [1] * N)
    end = ev.Done(0, result) if ev is not None else (0, "done", result)
    resp = _Resp()

    def chunk(index, d, finish=None, lps=None) -> bytes:
        return api._data(serving.chat_chunk("chatcmpl-1", "m", "fp", 1, index, d, finish, lps))

    async def gateway() -> None:
        """As in a server: each frame is read and routed, then the route's task drains the queue into SSE."""
        writer = asyncio.ensure_future(api._write_events(
            resp, queue, 1, lambda i, text, lps: chunk(i, {"content": text}, None, lps),
            lambda i, finish, lps: chunk(i, {}, finish, lps), lambda i, d, lps: chunk(i, d, None, lps)))
        await asyncio.sleep(0)
        for frame in sender.frames:
            reader.data_received(frame)
            await asyncio.sleep(0)
        queue.put_nowait(end)
        await writer

    t0 = time.thread_time_ns()
    loop.run_until_complete(gateway())
    t_gateway = time.thread_time_ns() - t0
    assert resp.n > N * 100, resp.n
    size = sum(map(len, sender.frames))
    loop.close()
    return {"worker": t_encode / N, "gateway": t_gateway / N, "wire_bytes_per_event": size / N}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs="*", default=[], metavar="REV", help="octo at these git revisions, alternating")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / ".cache" / "bench" / "events_wire.json"))
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:  # the best of 3 in one process (the first warms it up)
        runs = [run_once() for _ in range(3)]
        print(json.dumps({k: min(r[k] for r in runs) for k in runs[0]}))
        return
    here = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from revtree import short_sha, worktree

    trees = {"octo": here, **{f"octo@{short_sha(rev)}": str(worktree(rev)) for rev in args.compare}}
    best: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}  # a revision whose octo lacks what this measures (the wire, the route's writer)
    for _ in range(args.rounds):
        for name, tree in [(n, t) for n, t in trees.items() if n not in failed]:
            env = {**os.environ, "PYTHONPATH": tree}
            run = subprocess.run([sys.executable, __file__, "--once"], env=env, cwd=tree, capture_output=True,
                                 text=True)
            if run.returncode != 0:
                if name == "octo":
                    sys.exit(run.stderr)
                failed[name] = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"
                print(f"{name}: cannot be measured: {failed[name]}", flush=True)
                continue
            got = json.loads(run.stdout)
            prev = best.setdefault(name, got)
            for k, v in got.items():
                prev[k] = min(prev[k], v)
    for name, stages in best.items():
        print(f"{name:14} worker {stages['worker']:6.0f} ns/event  gateway {stages['gateway']:6.0f} ns/event  "
              f"wire {stages['wire_bytes_per_event']:.1f} B/event")
    ratios = {name: {k: round(best["octo"][k] / stages[k], 3) for k in ("worker", "gateway")}
              for name, stages in best.items() if name != "octo"}
    for name, r in ratios.items():
        print(f"octo / {name}: worker {r['worker']:.3f}  gateway {r['gateway']:.3f}")
    report = {"events": N, "rounds": args.rounds, "unit": "ns of CPU time per event (best of the rounds)",
              "servers": {name: {k: round(v, 1) for k, v in stages.items()} for name, stages in best.items()},
              "ratio_to_compared": ratios, "not_measured": failed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
