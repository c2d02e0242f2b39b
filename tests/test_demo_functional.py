"""`octo serve demo`: synthetic models for every installed engine, auto-benchmark, served offline."""

import json
import urllib.request

import pytest
from serverproc import run_octo


def engines_json(server):
    return json.loads(urllib.request.urlopen(server.url("/v1/engines")).read())


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    # builds are cached under the test OCTO_HOME; the benchmark cache starts empty here
    import os
    home = os.environ["OCTO_HOME"]
    return {"OCTO_HOME": home, "HF_HUB_OFFLINE": "1", "OCTO_BENCH_DIR": str(tmp_path / "bench")}


def test_with_bench_when_idle_a_first_serve_of_the_demo_serves_at_once(fresh_home):
    with run_octo("demo", "--bench-seconds", "1", "--bench-when-idle", env=fresh_home, timeout=600) as server:
        first = engines_json(server)
        r = server.openai().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
        log = server.log()
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    candidates = first["selection"]["candidates"]
    if len(candidates) > 1:  # with real engines installed: none was measured before the first token
        rows = {e["name"]: e["benchmark"] for e in first["data"] if e["name"] in candidates}
        assert all(b["unmeasured"] and b["score"] is None for b in rows.values() if not b.get("error")), rows
        assert first["selection"]["reason"].startswith(f"{first['active']} at once, the first candidate"), first
        assert "loading and measuring" not in log and "measured when the model is idle" in log, log


def test_serve_demo_offline_benchmarks_then_uses_the_cache(fresh_home):
    with run_octo("demo", "--bench-seconds", "1", env=fresh_home, timeout=600) as server:
        first = engines_json(server)
        r = server.openai().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    active = first["active"]
    rows = {e["name"]: e for e in first["data"]}
    candidates = first["selection"]["candidates"]
    assert active in candidates and rows[active]["active"] is True
    if len(candidates) > 1:  # with real engines installed, the winner has the best score and none failed won
        bench = {n: rows[n]["benchmark"] for n in candidates}
        assert all(b is not None and not b["cached"] for b in bench.values())
        assert bench[active]["error"] is None
        assert bench[active]["score"] == max(b["score"] for b in bench.values())
        for b in bench.values():
            assert set(b) >= {"prefill_tok_s", "decode_tok_s", "batch_decode_tok_s", "threads", "score", "cached",
                              "seconds", "error"}
        with run_octo("demo", "--bench-seconds", "1", env=fresh_home, timeout=600) as server:
            second = engines_json(server)
        # every measurement is cached, one disturbed by other load as provisional (measured again while a gateway
        # is idle, never at start): the second start measures nothing, and the same engine wins
        assert all(e["benchmark"]["cached"] for e in second["data"] if e["name"] in candidates
                   and not ((e["benchmark"] or {}).get("error") or "").startswith("artifact"))
        assert second["active"] == active


def test_a_request_without_a_limit_ends_at_the_demos_max_tokens(fresh_home):
    """A front-end that sets no limit (Open WebUI's chats, its title and follow-up requests) gets an answer of at most
    the catalog's max_tokens for the demo (512), not a whole 32k context of random text; its own limit wins."""
    import httpx

    with run_octo("demo", "--bench-seconds", "1", "--bench-when-idle", env=fresh_home, timeout=600) as server:
        client = server.openai()
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
        assert 1 <= r.usage.completion_tokens <= 512
        assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 512
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=600)
        assert r.usage.completion_tokens <= 600
        done = httpx.post(server.url("/api/chat"), timeout=300, json={
            "model": "demo:latest", "stream": False, "messages": [{"role": "user", "content": "hi"}]}).json()
        assert 1 <= done["eval_count"] <= 512 and (done["done_reason"] == "stop" or done["eval_count"] == 512)
