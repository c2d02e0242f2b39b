"""The compute arbiter: engine threads of different models never compute at once, and they take fair turns."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from octo.runtime import arbiter
from octo.runtime.arbiter import Arbiter, ComputeGate


async def _gates(n: int) -> tuple[Arbiter, list[ComputeGate], list]:
    arb = Arbiter()
    gates, members = [], []
    for i in range(n):
        g, w = socket.socketpair()
        members.append(await arb.attach(g, f"m{i}"))
        gate = ComputeGate(w)
        gate.enabled = True
        gates.append(gate)
    return arb, gates, members


def _worker(gate: ComputeGate, steps: int, step_s: float, log: list, busy: list, lock: threading.Lock) -> None:
    for _ in range(steps):
        gate.enter()
        with lock:
            busy.append(1)
            assert len(busy) == 1, "two models computed at the same time"
        log.append((threading.current_thread().name, time.monotonic()))
        time.sleep(step_s)
        with lock:
            busy.pop()
        gate.exit()
    gate.idle()


async def test_two_busy_models_alternate_and_never_overlap(monkeypatch):
    monkeypatch.setattr(arbiter, "QUANTUM", 0.02)
    arb, gates, members = await _gates(2)
    log: list = []
    busy: list = []
    lock = threading.Lock()
    threads = [threading.Thread(target=_worker, args=(g, 30, 0.01, log, busy, lock), name=f"m{i}")
               for i, g in enumerate(gates)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        await asyncio.sleep(0.01)
    names = [name for name, _ in log]
    switches = sum(1 for a, b in zip(names, names[1:], strict=False) if a != b)
    assert switches >= 20  # turns of a few steps each, not one model running to the end first
    assert abs(members[0].turns - members[1].turns) <= 2
    assert arb.holder is None and not arb.waiting


async def test_a_model_alone_is_granted_at_once_and_a_lost_worker_frees_the_cores():
    arb, gates, members = await _gates(2)
    t0 = time.monotonic()
    await asyncio.to_thread(gates[0].enter)  # nobody else: granted on the spot
    assert time.monotonic() - t0 < 0.5 and arb.holder is members[0]
    waiter = asyncio.ensure_future(asyncio.to_thread(gates[1].enter))
    await asyncio.sleep(0.05)
    assert not waiter.done() and list(arb.waiting) == [members[1]]
    gates[0]._sock.close()  # the holder's worker dies
    await asyncio.wait_for(waiter, 5)
    assert arb.holder is members[1]


async def test_a_disabled_gate_computes_freely_and_gives_back_what_it_held():
    arb, gates, members = await _gates(1)
    await asyncio.to_thread(gates[0].enter)
    assert arb.holder is members[0]
    gates[0].enabled = False
    await asyncio.to_thread(gates[0].enter)  # releases, asks nothing
    await asyncio.sleep(0.05)
    assert arb.holder is None and members[0].turns == 1


async def test_a_workers_encode_thread_computes_in_its_turn_beside_its_engine_thread(monkeypatch):
    """Two threads of one worker (the engine thread's steps, the encode thread's long encode) share its turn: the
    other model never computes while either of them does, and gets the cores once both are out."""
    monkeypatch.setattr(arbiter, "QUANTUM", 0.02)
    arb, gates, members = await _gates(2)
    spans: dict[str, list[tuple[float, float]]] = {"steps": [], "encode": [], "other": []}

    def compute(gate: ComputeGate, what: str, times: int, seconds: float) -> None:
        for _ in range(times):
            gate.enter()
            t0 = time.monotonic()
            time.sleep(seconds)
            spans[what].append((t0, time.monotonic()))
            gate.exit()
        gate.idle()

    threads = [threading.Thread(target=compute, args=(gates[0], "steps", 20, 0.01)),
               threading.Thread(target=compute, args=(gates[0], "encode", 1, 0.3)),
               threading.Thread(target=compute, args=(gates[1], "other", 20, 0.01))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        await asyncio.sleep(0.01)
    ours = spans["steps"] + spans["encode"]
    assert not [(a, b) for a in ours for b in spans["other"] if a[0] < b[1] and b[0] < a[1]]  # never at once
    (e0, e1), = spans["encode"]
    assert any(e0 < s1 and s0 < e1 for s0, s1 in spans["steps"])  # the steps went on beside the encode
    assert arb.holder is None and not arb.waiting
