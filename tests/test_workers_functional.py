"""Engine workers: a native crash costs one model's requests, never the server (real `octo serve` processes).

The fault-injection engines live in tests/plugins/faulty.py: they die of SIGSEGV, SIGABRT, SIGKILL or exit(3) in
load, warm-up or a step, on purpose.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from serverproc import REPO, run_octo
from serverproc import alive as _alive
from serverproc import children as _children

PLUGINS = str(REPO / "tests" / "plugins")


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    return server.post_json(path, body)


def _chat(text: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return str(tmp_path_factory.mktemp("octo-home"))


@pytest.mark.parametrize("how,signame", [("segv", "SIGSEGV"), ("abort", "SIGABRT"), ("kill", "SIGKILL"),
                                         ("exit", "exit code 3")])
def test_a_crash_ends_only_that_models_requests_and_the_next_request_restarts_it(how, signame, home):
    # safe=false set by the user: no fallback configuration, so every restart runs the same crashing engine
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=step", "-o", f"how={how}",
                  "-o", "safe=false", "-o", "token_delay_ms=20", env={"OCTO_HOME": home}) as server:
        client = server.openai(max_retries=0)
        health = server.get_json("/health")
        assert health["isolation"] == "process" and health["state"] == "ready"
        first_pid = health["worker"]["pid"]
        assert first_pid != server.proc.pid and first_pid in _children(server.proc.pid)
        ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello there friend"}])
        assert ok.choices[0].message.content == "hello there friend"

        # a stream of another request on the same worker, running when the crash comes: error event, proper end
        stream = client.chat.completions.create(model="m", stream=True, messages=[
            {"role": "user", "content": " ".join(f"w{i}" for i in range(200))}])
        next(iter(stream))
        status, body = _post(server, "/v1/chat/completions", _chat("please CRASH now and then some more"))
        assert status == 502, body
        err = body["error"]
        assert err["code"] == "engine_crashed" and err["type"] == "server_error"
        assert "faulty" in err["message"] and "'m'" in err["message"] and signame in err["message"]
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "engine_crashed" in str(e.value.body) or "crashed" in str(e.value)

        health = server.get_json("/health")  # the HTTP server lives; the model shows crashed with the reason
        assert health["state"] == "crashed" and signame in health["reason"]
        models = server.get_json("/v1/models")["data"][0]
        assert models["state"] == "crashed" and signame in models["reason"]
        assert _wait_gone(first_pid)
        metrics = urllib.request.urlopen(server.url("/metrics")).read().decode()
        assert 'octo_worker_crashes_total{engine="faulty",model="m"} 1.0' in metrics

        # the next request restarts the worker and is served
        again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "back again"}])
        assert again.choices[0].message.content == "back again"
        health = server.get_json("/health")
        assert health["state"] == "ready" and health["worker"]["pid"] != first_pid
        assert health["worker"]["restarts"] == 1

        # crashing again right after a restart: the model is marked failed and answers 503 at once, no loop
        status, body = _post(server, "/v1/chat/completions", _chat("CRASH again please now"))
        assert status == 502 and body["error"]["code"] == "engine_crashed"
        t0 = time.monotonic()
        status, body = _post(server, "/v1/chat/completions", _chat("hello"))
        assert status == 503 and body["error"]["code"] == "model_failed" and signame in body["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        assert server.get_json("/health")["state"] == "failed"
        assert "Traceback" not in server.log()


def test_queued_requests_fail_at_once_and_non_stream_calls_too(home):
    """Requests waiting in the worker's queue end with the crash, not after a timeout."""
    import concurrent.futures

    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=step", "-o", "after=5",
                  "-o", "token_delay_ms=30", "--max-batch", "1", env={"OCTO_HOME": home}) as server:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            crash = pool.submit(_post, server, "/v1/chat/completions", _chat("one two three CRASH five six seven"))
            time.sleep(0.1)
            queued = [pool.submit(_post, server, "/v1/chat/completions", _chat("a b c d e f g h")) for _ in range(3)]
            t0 = time.monotonic()
            results = [f.result(timeout=30) for f in [crash, *queued]]
        assert time.monotonic() - t0 < 5
        assert [s for s, _ in results] == [502] * 4
        assert all(b["error"]["code"] == "engine_crashed" for _, b in results)
        stats = server.get_json("/v1/queue/stats")
        assert stats["pending"] == 0 and stats["active"] == 0 and stats["state"] == "crashed"
        assert 'octo_queue_depth{model="m"} 0.0' in urllib.request.urlopen(server.url("/metrics")).read().decode()


@pytest.mark.parametrize("where", ["load", "warmup"])
def test_a_configuration_that_crashes_at_start_falls_back_and_is_remembered(where, tmp_path):
    env = {"OCTO_HOME": str(tmp_path)}
    args = ("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", f"crash_in={where}")
    with run_octo(*args, env=env) as server:
        log = server.log()
        assert "faulty: the faulty engine's unsafe mode crashed (SIGSEGV); serving with safe=true" in log
        health = server.get_json("/health")
        assert health["worker"]["fallback"] == {"safe": "true"}
        assert server.openai().completions.create(model="m", prompt="still here").choices[0].text == "still here"
    with run_octo(*args, env=env) as server:  # the next start does not crash first
        assert "crashed" not in server.log()
        assert server.get_json("/health")["worker"]["fallback"] == {"safe": "true"}


def test_a_crash_in_the_first_steps_restarts_with_the_fallback(tmp_path):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=step",
                  env={"OCTO_HOME": str(tmp_path)}) as server:
        status, body = _post(server, "/v1/chat/completions", _chat("CRASH right at the start"))
        assert status == 502 and body["error"]["code"] == "engine_crashed"
        status, body = _post(server, "/v1/chat/completions", _chat("CRASH right at the start"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "CRASH right at the start"
        assert server.get_json("/health")["worker"]["fallback"] == {"safe": "true"}
        assert "serving with safe=true" in server.log()


def test_an_explicit_option_disables_its_fallback(tmp_path):
    """-o safe=false is the user's choice: no fallback overrides it, so the start fails with the reason (and
    promises no retry: the process ends)."""
    with pytest.raises(RuntimeError, match="crashed .SIGSEGV.*no safer configuration") as err:
        with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "crash_in=load", "-o", "safe=false",
                      env={"OCTO_HOME": str(tmp_path)}, timeout=60):
            pass
    final = [line for line in str(err.value).splitlines() if line.startswith("Error: ")]
    assert len(final) == 1 and "could not be loaded" in final[0] and "tried again" not in final[0], err.value


def test_selection_survives_a_candidate_that_crashes(tmp_path):
    from octo.synth.gguf import build_gguf

    gguf = str(build_gguf("tiny", ftype="q8_0"))
    # (no spare worker: the only child left must be the winner's)
    env = {"OCTO_HOME": str(tmp_path), "OCTO_BENCH_DIR": str(tmp_path / "bench"), "OCTO_SPARE_WORKER": "0"}
    with run_octo(gguf, "--plugins-dir", PLUGINS, "--bench-seconds", "0.5", env=env) as server:
        engines = server.get_json("/v1/engines")
        rows = {r["name"]: r for r in engines["data"]}
        crashy = rows["crashy"]["benchmark"]
        assert crashy["score"] == 0 and "crashed" in crashy["error"] and "SIGSEGV" in crashy["error"]
        hangy = rows["hangy"]["benchmark"]  # killed after its grace (3 x budget + 20 s), not waited for forever
        assert hangy["score"] == 0 and hangy["error"].startswith("hung: hangy hung while measuring")
        assert engines["active"] in ("llamacpp", "steady") and engines["isolation"] == "process"
        assert rows["steady"]["benchmark"]["score"] > 0 and rows["llamacpp"]["benchmark"]["score"] > 0
        out = server.openai().completions.create(model=gguf, prompt="hi there", max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
        pids = _children(server.proc.pid)
        assert len(pids) == 1  # only the winner's worker is left: the losers' workers ended
    # the crash is cached with the other results: the next start does not run the crashing candidate again
    with run_octo(gguf, "--plugins-dir", PLUGINS, "--bench-seconds", "0.5", env=env) as server:
        assert re.search(r"crashy +cached +FAILED: crashed: crashy crashed \(SIGSEGV\) while measuring", server.log())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_never_outlive_the_gateway(sig, home):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, env={"OCTO_HOME": home}) as server:
        worker = server.get_json("/health")["worker"]["pid"]
        assert _alive(worker)
        os.kill(server.proc.pid, sig)
        server.proc.wait(30)
        assert _wait_gone(worker), f"worker {worker} outlived the gateway ({sig.name})"


def test_sigterm_drains_running_streams_before_stopping_the_worker(home):
    with run_octo("m", "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "token_delay_ms=40",
                  env={"OCTO_HOME": home}) as server:
        client = server.openai(max_retries=0)
        words = " ".join(f"w{i}" for i in range(25))
        stream = client.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": words}])
        chunks = [next(iter(stream))]
        os.kill(server.proc.pid, signal.SIGTERM)
        chunks += list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == words and chunks[-1].choices[0].finish_reason == "stop"
