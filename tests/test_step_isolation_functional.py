"""One raising step costs one request where the engine allows it (octo.step_isolation), through a real `octo serve`.

The fault engine (tests/plugins/faulty.py, echo-like, temperature 0) raises from ``step`` after feeding and sampling
every sequence of the step when one of them holds POISON: four concurrent streams, one poisoned. The engine declares
``kv_rollback`` (echo's: its KV count and its reply position), so the scheduler undoes the step and runs the
sequences again in smaller groups: the poisoned request fails with the engine's error, the three others get exactly
the text they get alone. With ``-o rollback=false`` (an engine that cannot undo a step) the step's sequences fail
together, as before.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from serverproc import REPO, run_octo
from test_faults_functional import WORDS, _chat, _idle, _stream

PLUGINS = str(REPO / "tests" / "plugins")


def _four(server, poison: str) -> tuple[dict, list[dict]]:
    async def go():
        async with aiohttp.ClientSession() as s:
            bodies = [_chat(poison, temperature=0)] + [_chat(f"{WORDS} {i}", temperature=0) for i in range(3)]
            return await asyncio.wait_for(asyncio.gather(*(_stream(s, server.base_url, b) for b in bodies)), 60)

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
        assert "was run again in smaller groups" in log and "3 went on" in log
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
