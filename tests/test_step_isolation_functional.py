"""One raising step costs one request where the engine allows it (octo.scheduler.step_isolation), through a real `octo
serve`.

The fault engine (tests/plugins/faulty.py, echo-like, temperature 0) raises from ``step`` after feeding and sampling
every sequence of the step when one of them holds POISON: four concurrent streams, one poisoned. The engine declares
``kv_rollback`` (echo's: its KV count and its reply position), so the scheduler undoes the step and runs the
sequences again in smaller groups: the poisoned request fails with the engine's error, the three others get exactly
the text they get alone. With ``-o rollback=false`` (an engine that cannot undo a step) the step's sequences fail
together, as before.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from serverproc import REPO, run_octo
from test_faults_functional import WORDS, _chat, _idle, _stream

PLUGINS = str(REPO / "tests" / "plugins")


def _four(server, poison: str) -> tuple[dict, list[dict]]:
    """Three healthy streams, and the poisoned one 0.1 s later (while they decode: its prompt step is theirs too)."""
    async def late(s, body):
        await asyncio.sleep(0.1)
        return await _stream(s, server.base_url, body)

    async def go():
        async with aiohttp.ClientSession() as s:
            good = [_stream(s, server.base_url, _chat(f"{WORDS} {i}", temperature=0)) for i in range(3)]
            return await asyncio.wait_for(asyncio.gather(late(s, _chat(poison, temperature=0)), *good), 60)

    bad, *good = asyncio.run(go())
    return bad, good


@pytest.mark.parametrize("after", ["0", "4"])  # poisoned in the step of its prompt, or while decoding
def test_a_poisoned_sequence_fails_alone_and_the_others_keep_their_text(after):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=30",
                  "-o", f"after={after}") as server:
        alone = [server.openai().chat.completions.create(**_chat(f"{WORDS} {i}", temperature=0))
                 .choices[0].message.content for i in range(3)]
        assert alone == [f"{WORDS} {i}" for i in range(3)]
        steps_before = server.get_json("/v1/queue/stats")
        bad, good = _four(server, "one two POISON three four five six seven")
        assert bad["error"] is not None and "poisoned" in bad["error"]["message"], bad
        assert bad["error"]["code"] == "engine_error" and bad.get("finish") is None
        for i, r in enumerate(good):
            assert r["error"] is None and r["finish"] == "stop" and r["text"] == alone[i], r
        assert _idle(server)["active"] == 0
        stats = server.get_json("/v1/queue/stats")
        assert stats["total_processed"] >= steps_before["total_processed"] + 3
        assert stats["isolated_steps"] == steps_before["isolated_steps"] + 1
        log = server.log()
        # (how many shared the poisoned step depends on when each stream was admitted)
        assert re.search(r"the step of \d sequences that raised was run again in smaller groups: sequence\(s\) "
                         r"\[\d+\] failed, [1-3] went on", log), log
        assert server.post_json("/v1/chat/completions", _chat("still here"))[0] == 200


def test_an_engine_that_cannot_roll_back_fails_the_whole_step_as_before():
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=30",
                  "-o", "after=4", "-o", "rollback=false") as server:
        bad, good = _four(server, "one two POISON three four five six seven")
        assert "poisoned" in bad["error"]["message"]
        failed = [r for r in good if r["error"] is not None]
        assert failed and all("poisoned" in r["error"]["message"] for r in failed), good  # its step's sequences
        assert "smaller groups" not in server.log()
        assert server.post_json("/v1/chat/completions", _chat("still here"))[0] == 200
