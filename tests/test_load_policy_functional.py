"""The load policy on every route that names a model (docs/security.md, "Servable models"), through a real `octo serve`
whose working folder holds model files a request must never reach: a two-part relative name (``org/name``, shaped
like a Hugging Face id) is a catalog name or a Hugging Face id the operator pulled into the hub cache, never a path
under the working folder; ``rel/..`` never reaches the file system; and an existing path, a refused path and a
missing name get the same answer on every route (same status, same message once the name is taken out), so a request
learns nothing about the machine's files. The hub is never asked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from hub_standin import HubStandin
from serverproc import REPO, run_octo

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
M = [{"role": "user", "content": "hi"}]


def call(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url(path), data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw.splitlines()[0]) if raw.strip() else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def transcribe(server, model: str) -> tuple[int, dict]:
    import io
    import wave

    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\0\0" * 1600)
    boundary = "policyboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + wav.getvalue() + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(server.url("/v1/audio/transcriptions"), body,
                                 {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


ROUTES = {
    "chat": lambda s, m: call(s, "POST", "/v1/chat/completions", {"model": m, "messages": M, "max_tokens": 2}),
    "completions": lambda s, m: call(s, "POST", "/v1/completions", {"model": m, "prompt": "hi", "max_tokens": 2}),
    "embeddings": lambda s, m: call(s, "POST", "/v1/embeddings", {"model": m, "input": "hi"}),
    "messages": lambda s, m: call(s, "POST", "/v1/messages", {"model": m, "max_tokens": 4, "messages": M}),
    "count_tokens": lambda s, m: call(s, "POST", "/v1/messages/count_tokens", {"model": m, "messages": M}),
    "responses": lambda s, m: call(s, "POST", "/v1/responses", {"model": m, "input": "hi", "store": False}),
    "tokenize": lambda s, m: call(s, "POST", "/v1/tokenize", {"model": m, "content": "hi"}),
    "model_get": lambda s, m: call(s, "GET", f"/v1/models/{quote(m, safe='')}"),
    "model_load": lambda s, m: call(s, "POST", f"/v1/models/{quote(m, safe='')}/load"),
    "transcriptions": transcribe,
    "ollama_chat": lambda s, m: call(s, "POST", "/api/chat", {"model": m, "messages": M, "stream": False}),
    "ollama_generate": lambda s, m: call(s, "POST", "/api/generate", {"model": m, "prompt": "hi", "stream": False}),
    "ollama_embed": lambda s, m: call(s, "POST", "/api/embed", {"model": m, "input": "hi"}),
    "ollama_show": lambda s, m: call(s, "POST", "/api/show", {"model": m}),
    "ollama_pull": lambda s, m: call(s, "POST", "/api/pull", {"model": m, "stream": False}),
    "ollama_delete": lambda s, m: call(s, "DELETE", "/api/delete", {"model": m}),
}


def shape(answer: tuple[int, dict], model: str) -> tuple[int, str]:
    """The answer with the model's name taken out (and Ollama's ':latest' spelling of it)."""
    status, body = answer
    text = json.dumps(body, sort_keys=True)
    base = model.rpartition(":")[0] or model  # (a message may name the repository without the variant)
    for spelling in (model, json.dumps(model)[1:-1], base, json.dumps(base)[1:-1]):
        text = text.replace(spelling, "<M>")
    return status, text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A working folder with models a request must not reach; a hub stand-in with a tiny GGUF the operator pulls
    (``octo pull``) before the server starts."""
    from octo.synth.gguf import build_gguf

    tiny = Path(build_gguf("tiny", ftype="q8_0"))
    work = tmp_path_factory.mktemp("work")
    (work / "org").mkdir()
    shutil.copy(tiny, work / "org" / "name")  # a GGUF without an extension, named like a Hugging Face id
    (work / "rel").mkdir()
    (work / "pulled").mkdir()
    shutil.copy(tiny, work / "pulled" / "Tiny")  # the working folder's copy of a name the operator did pull
    models = tmp_path_factory.mktemp("models")
    shutil.copy(tiny, models / "served.gguf")
    with HubStandin() as hub:
        hub.add_repo("pulled/Tiny", {"tiny-Q8_0.gguf": tiny.read_bytes()})
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path_factory.mktemp("hf")), "HF_HUB_OFFLINE": "",
               "OCTO_HOME": str(tmp_path_factory.mktemp("octo")), "HF_TOKEN": "hf_operator_token"}
        subprocess.run([sys.executable, "-m", "octo.cli", "pull", "pulled/Tiny", "-q"], cwd=REPO, check=True,
                       env={**os.environ, **env}, capture_output=True, timeout=120)
        hub.requests.clear()
        with run_octo("test-model", "--engine", "echo", "--models-dir", str(models), env=env, cwd=work) as server:
            yield server, hub, work


# names a request may not load, each beside a name of the same shape that names nothing at all
PAIRS = [("org/name", "nope/nope"), ("rel/..", "zzz/.."), ("org/..", "zzz/.."), ("./org/name", "./zzz/zzz"),
         ("pulled/..", "zzz/.."), ("org/name:Q8_0", "nope/nope:Q8_0"), ("./rel/../org/name", "./zzz/../zzz/zzz")]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_name_under_the_working_folder_reads_like_a_name_that_names_nothing(setup, route):
    server, hub, work = setup
    ask = ROUTES[route]
    unknown = shape(ask(server, "no-such-model"), "no-such-model")
    assert unknown[0] in (403, 404), unknown
    for there, nothing in [*PAIRS, (f"{work}/org/name", f"{work}/zzz/zzz"), (f"{work}/rel/..", f"{work}/zzz/..")]:
        got, expect = shape(ask(server, there), there), shape(ask(server, nothing), nothing)
        assert got == expect, (route, there, got, expect)
        assert got[0] in (403, 404), (route, there, got)
        if not there.replace(":Q8_0", "").count("/") == 1 or there.startswith(("./", "/")) or ".." in there:
            assert got == unknown, (route, there, got, unknown)  # not a Hugging Face id: an unknown name
    assert hub.requests == []


def test_a_pulled_hugging_face_id_serves_from_the_hub_cache_not_the_working_folder(setup):
    server, hub, work = setup
    out = server.openai(max_retries=0).completions.create(model="pulled/Tiny", prompt="hi", max_tokens=2)
    assert out.choices
    entry = server.get_json("/v1/models/pulled%2FTiny")
    assert entry["state"] == "ready"
    assert str(work) not in json.dumps(entry)  # the hub cache's file, never the working folder's copy
    assert hub.requests == []  # served from the cache: the hub is not asked
    log = server.log()
    assert "No such file" not in log and "not a supported model" not in log  # (no file was ever looked at)
