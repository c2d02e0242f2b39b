"""The responses store through a real `octo serve` (echo engine) and the openai SDK: a damaged responses.sqlite3 is
set aside at start and the API works; a store that cannot be opened makes store: true a 503 store_unavailable
naming the file before anything is generated, while store: false, chat and every other route work and /health says
it; stored responses expire (--responses-ttl) and are kept within --responses-max-mb, oldest first; metadata is
limited as OpenAI limits it."""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from serverproc import run_octo  # noqa: E402

SERVE = ("test-model", "--engine", "echo")


def test_a_damaged_store_is_set_aside_at_start_and_the_api_works(tmp_path):
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"\xa5" * 40960)  # pages of garbage
    (tmp_path / "responses.sqlite3-wal").write_bytes(b"\x00" * 100)
    with run_octo(*SERVE, env={"OCTO_HOME": str(tmp_path)}) as server:
        client = server.openai()
        first = client.responses.create(model="test-model", input="remember the lighthouse")
        assert client.responses.retrieve(first.id).output_text == "remember the lighthouse"
        second = client.responses.create(model="test-model", input="and the harbor", previous_response_id=first.id)
        assert second.output_text == "and the harbor"
        health = server.get_json("/health")
        log = server.log()
    assert health["status"] == "ok" and health["responses_store"] == {"status": "ok", "path": str(path)}
    assert f"responses store {path}: not a sound SQLite database" in log and "quarantine" in log
    assert any(p.name.startswith("responses.sqlite3.") for p in (tmp_path / "quarantine").iterdir())
    assert "Traceback" not in log


def test_a_store_that_cannot_be_written_is_a_503_before_generating(tmp_path):
    path = tmp_path / "responses.sqlite3"
    path.mkdir()  # cannot be opened as a database (a read-only file would be writable by root, who runs CI)
    with run_octo(*SERVE, "-o", "token_delay_ms=300", env={"OCTO_HOME": str(tmp_path)}) as server:
        url = server.url("/v1/responses")
        before = server.get_json("/v1/queue/stats")["total_processed"]
        started = time.monotonic()
        r = httpx.post(url, json={"model": "test-model", "input": "one two three four five six"}, timeout=30)
        took = time.monotonic() - started
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "store_unavailable" and err["param"] == "store", r.text
        assert str(path) in err["message"] and "store: false" in err["message"]
        assert took < 1.5 and server.get_json("/v1/queue/stats")["total_processed"] == before  # nothing generated
        client = server.openai(max_retries=0)
        kept = client.responses.create(model="test-model", input="not stored", store=False)
        assert kept.output_text == "not stored"
        chat = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi there"}])
        assert chat.choices[0].message.content == "hi there"
        for call in (lambda: client.responses.retrieve("resp_x"), lambda: client.responses.delete("resp_x"),
                     lambda: client.responses.create(model="test-model", input="x", store=False,
                                                     previous_response_id="resp_x")):
            with pytest.raises(openai.InternalServerError) as info:
                call()
            assert info.value.status_code == 503 and info.value.body["code"] == "store_unavailable"
        stream = httpx.post(url, json={"model": "test-model", "input": "x", "stream": True}, timeout=30)
        assert stream.status_code == 503 and stream.json()["error"]["code"] == "store_unavailable"
        status, health = server.get_status("/health")
        assert status == 200 and health["status"] == "degraded"
        assert health["responses_store"]["status"] == "unavailable" and health["responses_store"]["path"] == str(path)
        path.rmdir()  # the operator fixes it: the store is tried again within seconds
        deadline = time.monotonic() + 15
        while True:
            r = httpx.post(url, json={"model": "test-model", "input": "stored again"}, timeout=30)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and client.responses.retrieve(r.json()["id"]).output_text == "stored again"
        assert server.get_json("/health")["status"] == "ok"


def test_stored_responses_expire_and_keep_within_the_cap(tmp_path):
    with run_octo(*SERVE, "--responses-ttl", "3s", env={"OCTO_HOME": str(tmp_path / "a")}) as server:
        client = server.openai()
        r = client.responses.create(model="test-model", input="short lived")
        assert client.responses.retrieve(r.id).output_text == "short lived"
        time.sleep(4)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
    with run_octo(*SERVE, "--responses-max-mb", "0.02", env={"OCTO_HOME": str(tmp_path / "b")}) as server:
        client = server.openai()
        ids = [client.responses.create(model="test-model", input=f"turn {i} " + "word " * 100).id for i in range(40)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert client.responses.retrieve(ids[-1]).output_text.startswith("turn 39")
    size = (tmp_path / "b" / "responses.sqlite3").stat().st_size
    assert size < 200_000, size


def test_metadata_is_limited_as_openai_limits_it(tmp_path):
    with run_octo(*SERVE, env={"OCTO_HOME": str(tmp_path)}) as server:
        client = server.openai()
        ok = client.responses.create(model="test-model", input="x", metadata={f"k{i}": "v" * 512 for i in range(16)})
        assert len(ok.metadata) == 16
        for metadata, says in (({f"k{i}": "v" for i in range(17)}, "at most 16 keys"),
                               ({"k" * 65: "v"}, "at most 64 characters"),
                               ({"k": "v" * 513}, "at most 512 characters")):
            with pytest.raises(openai.BadRequestError) as info:
                client.responses.create(model="test-model", input="x", metadata=metadata)
            assert info.value.body["param"] == "metadata" and says in info.value.body["message"]
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}],
                                               metadata=metadata, store=True)
            assert info.value.body["param"] == "metadata"
