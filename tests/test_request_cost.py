"""octo's own Python work per request has a budget, so a slide in the gateway's per-request cost fails the day it
lands, not months later (issue 36: 43% was lost over 190 commits, each too small for a timing bench to notice).

The count is of calls into octo's own code (octo/ and engines/), on every thread, for plain non-streamed chat
requests to the echo engine one at a time (deterministic: one admission and one step per token, no batching
that depends on timing). Calls are what the time went into: bench/callcount.py counted 190 Python calls a request
at the earlier core (369e4c5), 332 at the low point; a count does not move with the host's load as timings do.
aiohttp's and pydantic's own calls are not counted (their versions are pinned; their cost is not octo's code).
A budget here is what today's code needs plus about 15%: raise it only with a reason in the commit.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
OWN = (f"{ROOT}/octo/", f"{ROOT}/engines/")
REQUESTS = 200
# octo calls a plain chat request to the echo engine may make, one at a time (today 203 non-streamed, 257
# streamed: 5 generated tokens each)
BUDGET = {"plain": 235, "stream": 295}


class CallCounter:
    """A profile hook on every thread that counts calls into octo's code while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: Counter = Counter()

    def hook(self, frame, event, arg) -> None:
        if self.on and event == "call" and frame.f_code.co_filename.startswith(OWN):
            self.calls[f"{frame.f_code.co_filename[len(ROOT) + 1:]}:{frame.f_code.co_name}"] += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)  # the engine thread starts after this: it is counted too
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


@pytest.fixture
async def counted(aiohttp_client, tmp_path, monkeypatch):
    from octo.engines.echo import EchoEngine

    from octo.config import ServerConfig
    from octo.engine import EngineConfig
    from octo.runtime.model import ModelHandle
    from octo.server.app import create_app

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    engine = EchoEngine(EngineConfig())
    engine.load("bench", "bench")
    with CallCounter() as counter:
        client = await aiohttp_client(create_app(ServerConfig(model="bench"),
                                                 ModelHandle("bench", (), "echo", engine, "x")))
        yield client, counter


BODY = {"model": "bench", "messages": [{"role": "user", "content": "hello there general kenobi"}]}


async def _per_request(client, counter: CallCounter, body: dict) -> tuple[float, Counter]:
    for _ in range(50):  # warm-up: first calls that import, compile or fill caches do not count
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200
        await r.read()
    counter.calls.clear()
    counter.on = True
    for _ in range(REQUESTS):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200
        await r.read()
    counter.on = False
    return sum(counter.calls.values()) / REQUESTS, counter.calls


def _report(calls: Counter) -> str:
    return "\n".join(f"{n / REQUESTS:7.2f} {name}" for name, n in calls.most_common(40))


@pytest.mark.parametrize("kind", ["plain", "stream"])
async def test_octo_calls_per_chat_request_stay_within_budget(counted, kind):
    client, counter = counted
    body = {**BODY, "stream": True} if kind == "stream" else BODY
    per_request, calls = await _per_request(client, counter, body)
    assert per_request > 20, "the hook counted nothing: the test measures nothing"  # (it must see octo's calls)
    assert per_request <= BUDGET[kind], (
        f"{per_request:.1f} octo calls per {kind} chat request, budget {BUDGET[kind]}; the most called:\n"
        + _report(calls))
