"""Ollama's native API through the official ``ollama`` Python client (and the JavaScript one, and langchain-ollama)
against a real `octo serve` on loopback: the echo engine (in the gateway and in a worker process) for chat, streams,
generate, embeddings, the model list, ps, show, load/unload by empty request, options, errors in Ollama's shape, and
tool calls; the echo model repeats the last user message, so a message holding a call in the Hermes format is a
scripted, forced tool call (Ollama's API has no tool_choice). A synthetic GGUF model on llama.cpp checks ``format``
(a JSON schema and "json") through the constraint layer, and ``/api/pull`` downloads from a local stand-in hub."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

ollama = pytest.importorskip("ollama")

from hub_standin import HubStandin, gguf_bytes  # noqa: E402
from serverproc import REPO, run_octo  # noqa: E402

MODEL = "test-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


SCRIPT = "Let me check. " + call_text("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def client(echo_server):
    return ollama.Client(host=echo_server.base_url)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def error_of(fn, *args, **kw) -> tuple[int, str]:
    with pytest.raises(ollama.ResponseError) as e:
        fn(*args, **kw)
    return e.value.status_code, e.value.error


# -- chat and generate --------------------------------------------------------------------------------------
def test_chat_answer_and_measured_durations(client):
    r = client.chat(model=MODEL, messages=user("the sky is blue"))
    assert r.message.role == "assistant" and r.message.content == "the sky is blue"
    assert r.done and r.done_reason == "stop" and r.model == MODEL and r.created_at.endswith("Z")
    assert r.eval_count == 4 and r.prompt_eval_count > 4
    for d in (r.total_duration, r.load_duration, r.prompt_eval_duration, r.eval_duration):
        assert isinstance(d, int) and d > 0
    assert r.total_duration >= r.load_duration + r.prompt_eval_duration + r.eval_duration


def test_chat_stream_is_ndjson_pieces_then_a_final_object(client, echo_server):
    parts = list(client.chat(model=f"{MODEL}:latest", messages=user("one two three"), stream=True))
    assert "".join(p.message.content for p in parts) == "one two three"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].message.content == "" and parts[-1].done_reason == "stop" and parts[-1].eval_count == 3
    with urllib.request.urlopen(urllib.request.Request(
            echo_server.url("/api/chat"), json.dumps({"model": MODEL, "messages": user("x")}).encode(),
            {"Content-Type": "application/json"})) as r:  # "stream" left out: Ollama streams by default
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = r.read().decode().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["done"] is True


def test_generate_templated_and_raw(client):
    r = client.generate(model=MODEL, prompt="tell me", system="be brief")
    assert r.response == "tell me" and r.done_reason == "stop" and r.context is None
    raw = client.generate(model=MODEL, prompt="raw words here", raw=True)
    assert raw.response == "raw words here"
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="a b c d", stream=True))
    assert streamed == "a b c d"


def test_options_are_honoured_or_ignored_with_one_warning(client, echo_server):
    r = client.chat(model=MODEL, messages=user("a b c d e f"), options={"num_predict": 2, "temperature": 0,
                                                                          "top_k": 40, "top_p": 0.9, "seed": 7})
    assert r.message.content == "a b" and r.done_reason == "length" and r.eval_count == 2
    r = client.chat(model=MODEL, messages=user("a b STOP c"), options={"stop": ["STOP"]})
    assert r.message.content == "a b " and r.done_reason == "stop"
    # what Open WebUI saves on a model, and options Ollama no longer has: the chat is served, one line names them
    saved = {"num_thread": 4, "num_batch": 256, "use_mmap": True, "num_keep": 5, "repeat_last_n": 32,
             "mirostat": 2, "mirostat_tau": 5.0, "tfs_z": 0.9, "repeat_penalty": 1.2, "num_gpu": 1, "low_vram": None}
    r = client.chat(model=MODEL, messages=user("saved options apply"), options=saved)
    assert r.message.content == "saved options apply" and r.done_reason == "stop"
    line = next(ln for ln in reversed(echo_server.log().splitlines()) if "ignoring options" in ln)
    for name in ("num_thread", "num_batch", "use_mmap", "repeat_last_n", "mirostat", "tfs_z", "repeat_penalty",
                 "num_gpu"):
        assert f'"{name}"' in line, (name, line)
    assert "num_keep" not in line and "low_vram" not in line  # honoured (the cut keeps it); null is unset
    r = client.generate(model=MODEL, prompt="with options", options={"num_ctx": 4096, "mirostat": 0, "numa": False})
    assert r.response == "with options"
    status, msg = error_of(client.chat, model=MODEL, messages=user("x"), options={"temperature": "hot"})
    assert status == 400 and msg == 'option "temperature" must be of type float32'  # Ollama's words


def _echo_prompt_tokens(server, messages: list[dict]) -> int:
    """The tokens of ``messages`` as the echo engine's chat template renders them (counted by the model's tokenizer)."""
    text = "\n".join(f"<|{m['role']}|> {m['content']} <|end|>" for m in messages) + "\n<|assistant|>"
    status, body = server.post_json("/tokenize", {"model": MODEL, "content": text})
    assert status == 200
    return body["count"]


def long_conversation(turns: int, words: int) -> list[dict]:
    convo = [{"role": "system", "content": "you are terse"}]
    for i in range(turns):
        convo += [{"role": "user", "content": f"question {i} " + "filler " * words},
                  {"role": "assistant", "content": f"answer {i} " + "more " * words}]
    return [*convo, {"role": "user", "content": "the latest question"}]


def test_a_conversation_longer_than_the_context_is_truncated_as_ollama_does(client, echo_server):
    convo = long_conversation(12, 20)
    assert _echo_prompt_tokens(echo_server, convo) > 200
    r = client.chat(model=MODEL, messages=convo, options={"num_ctx": 200})
    assert r.message.content == "the latest question" and r.done_reason == "stop"
    # the system message and the latest turns that fit (Ollama's chatPrompt): one start after another
    kept = next(k for k in range(1, len(convo))
                if _echo_prompt_tokens(echo_server, [convo[0], *convo[k:]]) <= 200)
    assert r.prompt_eval_count == _echo_prompt_tokens(echo_server, [convo[0], *convo[kept:]])
    g = client.generate(model=MODEL, prompt="tail words " * 300, options={"num_ctx": 100, "num_keep": 3})
    assert g.prompt_eval_count <= 100 and g.done  # one message longer than the context: cut as Ollama's runner
    # (the Python client has no truncate or shift argument: the API's own JSON)
    status, body = echo_server.post_json("/api/chat", {"model": MODEL, "messages": convo, "stream": False,
                                                       "options": {"num_ctx": 200}, "truncate": False})
    assert status == 400 and "exceeds the context length" in body["error"]
    status, body = echo_server.post_json("/api/generate", {"model": MODEL, "prompt": "x " * 300, "stream": False,
                                                           "options": {"num_ctx": 100}, "shift": False})
    assert status == 400 and "longer than the context length" in body["error"]
    # past the loaded context (echo: 8192 tokens): /api/chat truncates, the OpenAI route keeps OpenAI's 400
    huge = long_conversation(30, 150)
    assert client.chat(model=MODEL, messages=huge).message.content == "the latest question"
    with pytest.raises(Exception) as e:
        echo_server.openai().chat.completions.create(model=MODEL, messages=huge)
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"


def test_errors_in_ollamas_shape(client, echo_server):
    status, msg = error_of(client.chat, model="no-such-model-here", messages=user("x"))
    assert status == 404 and "no-such-model-here" in msg
    status, body = echo_server.post_json("/api/chat", {"model": MODEL, "messages": user("x"), "bogus": 1,
                                                       "stream": False})
    assert status == 200 and body["message"]["content"] == "x"  # an unknown field is ignored, as Ollama does
    assert "ignoring fields Ollama's API does not have: \"bogus\"" in echo_server.log()
    status, body = echo_server.post_json("/api/chat", {"model": MODEL, "messages": user("x"), "stream": "no"})
    assert status == 400 and list(body) == ["error"] and "stream" in body["error"]
    status, msg = error_of(client.chat, model=MODEL, messages=[{"role": "user", "content": "x", "images": ["aGk="]}])
    assert status == 400 and "images" in msg
    status, msg = error_of(client.generate, model=MODEL, prompt="x", template="{{ .Prompt }}")
    assert status == 400 and "template" in msg
    status, msg = error_of(client.generate, model=MODEL, prompt="x", context=[1, 2])
    assert status == 400 and "context" in msg
    for path in ("/api/create", "/api/push", "/api/copy"):
        status, body = echo_server.post_json(path, {"model": "x"})
        assert status == 400 and "octo does not support" in body["error"]
    status, msg = error_of(client.create, model="mario", from_=MODEL, system="be Mario")
    assert status == 400 and "Modelfile" in msg


def test_load_and_unload_by_empty_request(client):
    r = client.generate(model=MODEL)
    assert r.done and r.done_reason == "load"
    assert [m.model for m in client.ps().models] == [f"{MODEL}:latest"]
    r = client.chat(model=MODEL, messages=[], keep_alive=0)
    assert r.done_reason == "unload" and client.ps().models == []
    assert client.chat(model=MODEL, messages=user("back again")).message.content == "back again"  # reloads
    assert [m.model for m in client.ps().models] == [f"{MODEL}:latest"]


def test_the_tagged_name_ollama_lists_names_the_model_on_every_route(client, echo_server):
    """``test-model:latest`` (what /api/tags lists) on the OpenAI and Anthropic routes, through their SDKs."""
    import anthropic

    tagged = f"{MODEL}:latest"
    assert tagged in [m.model for m in client.list().models]
    oa = echo_server.openai()
    chat = oa.chat.completions.create(model=tagged, messages=user("tagged chat"))
    assert chat.choices[0].message.content == "tagged chat" and chat.model == tagged
    assert oa.completions.create(model=tagged, prompt="tagged text", max_tokens=8).choices[0].text == "tagged text"
    assert len(oa.embeddings.create(model=tagged, input="x").data[0].embedding) == 64
    assert oa.responses.create(model=tagged, input="tagged response").output_text == "tagged response"
    assert oa.models.retrieve(tagged).id == MODEL
    an = anthropic.Anthropic(base_url=echo_server.base_url, api_key="none")
    said = an.messages.create(model=tagged, max_tokens=16, messages=user("tagged message"))
    assert said.content[0].text == "tagged message"
    assert an.messages.count_tokens(model=tagged, messages=user("count me")).input_tokens > 0
    status, body = echo_server.post_json("/v1/tokenize", {"model": tagged, "prompt": "a b"})
    assert status == 200 and body["tokens"]
    with pytest.raises(Exception) as e:  # another tag is still a variant that does not exist
        oa.chat.completions.create(model=f"{MODEL}:nope", messages=user("x"))
    assert getattr(e.value, "status_code", None) == 404


def _cors(server, method: str, path: str, origin: str, body: bytes | None = None) -> tuple[int, dict]:
    """A browser's request (a preflight for OPTIONS) from ``origin``: (status, response headers)."""
    headers = {"Origin": origin}
    if method == "OPTIONS":
        headers.update({"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    else:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(server.url(path), body, headers, method=method)
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_ollamas_local_origins_on_ollamas_routes_only(echo_server):
    """Ollama answers local web and desktop apps by default; octo does on Ollama's routes, not on the others."""
    chat = json.dumps({"model": MODEL, "messages": user("from a local page"), "stream": False}).encode()
    for origin in ("http://localhost:3000", "http://127.0.0.1:8081", "https://0.0.0.0", "app://obsidian.md",
                   "tauri://localhost", "vscode-webview://abc", "file://"):
        status, h = _cors(echo_server, "OPTIONS", "/api/chat", origin)
        assert status == 204 and h["Access-Control-Allow-Origin"] == origin, (origin, h)
        assert "POST" in h["Access-Control-Allow-Methods"] and "content-type" in h["Access-Control-Allow-Headers"]
    status, h = _cors(echo_server, "POST", "/api/chat", "http://localhost:3000", chat)
    assert status == 200 and h["Access-Control-Allow-Origin"] == "http://localhost:3000"
    for path in ("/api/tags", "/api/version", "/"):  # Ollama's root too ("Ollama is running")
        status, h = _cors(echo_server, "GET", path, "http://localhost:3000")
        assert status == 200 and h["Access-Control-Allow-Origin"] == "http://localhost:3000", path
    # not the OpenAI routes (only --cors-origins opens those), and no origin wider than Ollama's list
    status, h = _cors(echo_server, "OPTIONS", "/v1/chat/completions", "http://localhost:3000")
    assert status == 204 and "Access-Control-Allow-Origin" not in h
    status, _ = _cors(echo_server, "POST", "/v1/chat/completions", "http://localhost:3000", chat)
    assert status == 403
    for origin in ("http://evil.example", "http://localhost.evil.example:3000", "http://localhost:3000.evil.example",
                   "chrome-extension://abc", "null", "http://[::1]:3000", "http://192.168.1.2:3000"):
        status, h = _cors(echo_server, "OPTIONS", "/api/chat", origin)
        assert "Access-Control-Allow-Origin" not in h, origin
        assert _cors(echo_server, "POST", "/api/chat", origin, chat)[0] == 403, origin


def test_cors_origins_still_adds_and_opens_every_route():
    with run_octo(MODEL, "--engine", "echo", "--cors-origins", "https://app.example") as s:
        chat = json.dumps({"model": MODEL, "messages": user("x"), "stream": False}).encode()
        for path in ("/api/chat", "/v1/chat/completions"):
            status, h = _cors(s, "OPTIONS", path, "https://app.example")
            assert h.get("Access-Control-Allow-Origin") == "https://app.example", path
            assert _cors(s, "POST", path, "https://app.example", chat)[0] == 200
        assert _cors(s, "OPTIONS", "/api/chat", "http://localhost:5173")[1]["Access-Control-Allow-Origin"]


# -- tools --------------------------------------------------------------------------------------------------
def test_forced_tool_call_has_object_arguments(client):
    r = client.chat(model=MODEL, messages=user(SCRIPT), tools=[WEATHER])
    assert r.message.content == "Let me check." and r.done_reason == "stop"
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    parts = list(client.chat(model=MODEL, messages=user(SCRIPT), tools=[WEATHER], stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(p.message.content for p in parts) == "Let me check."


def test_tool_loop_with_a_tool_result(client):
    first = client.chat(model=MODEL, messages=user(call_text("get_weather", {"city": "Oslo"})), tools=[WEATHER])
    history = [*user(call_text("get_weather", {"city": "Oslo"})), first.message,
               {"role": "tool", "content": "minus four", "tool_name": "get_weather"}]
    second = client.chat(model=MODEL, messages=history, tools=[WEATHER])
    assert "minus four" in second.message.content and not second.message.tool_calls


def test_python_function_as_a_tool(client):
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
          city: the city
        """
        return "sunny"

    r = client.chat(model=MODEL, messages=user(SCRIPT), tools=[get_weather])
    assert r.message.tool_calls[0].function.arguments == {"city": "Paris"}


# -- embeddings, list, ps, show, version, root ---------------------------------------------------------------
def test_embed_and_embeddings(client):
    r = client.embed(model=MODEL, input=["first text", "second text"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 64 and r.prompt_eval_count == 4
    assert abs(sum(v * v for v in r.embeddings[0]) - 1.0) < 1e-6  # unit vectors, as Ollama's /api/embed
    old = client.embeddings(model=MODEL, prompt="first text").embedding
    assert len(old) == 64 and max(abs(a - b) for a, b in zip(old, r.embeddings[0], strict=True)) < 1e-6
    r = client.embed(model=MODEL, input="x", options={"temperature": 0.5, "num_ctx": 1 << 20})
    assert len(r.embeddings[0]) == 64  # embeddings sample nothing: ignored, as Ollama does


def test_list_ps_show_version_and_root(client, echo_server):
    client.chat(model=MODEL, messages=user("x"))
    names = [m.model for m in client.list().models]
    assert f"{MODEL}:latest" in names
    (running,) = client.ps().models
    assert running.model == f"{MODEL}:latest" and running.context_length == 8192 and running.expires_at.year > 2100
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"] and shown.modelfile.startswith("# Modelfile generated")
    assert client.show(f"{MODEL}:latest").details.format == "echo"
    assert echo_server.get_json("/api/version") == {"version": "0.32.15"}  # the Ollama API octo implements
    with urllib.request.urlopen(echo_server.url("/")) as r:
        assert r.read() == b"Ollama is running"
    with urllib.request.urlopen(urllib.request.Request(echo_server.url("/"), method="HEAD")) as r:
        assert r.status == 200
    browser = urllib.request.Request(echo_server.url("/"), headers={"Accept": "text/html,application/xhtml+xml"})
    with urllib.request.urlopen(browser) as r:
        assert b"<html" in r.read().lower()  # the dashboard


# -- thinking ------------------------------------------------------------------------------------------------
def test_think_and_thinking():
    with run_octo(MODEL, "--engine", "echo", "-o", "think=1") as s:
        c = ollama.Client(host=s.base_url)
        said = "<think> first I plan </think> then I answer"
        r = c.chat(model=MODEL, messages=user(said))  # a reasoning model thinks unless told not to
        assert r.message.thinking == "first I plan " and r.message.content == "then I answer"
        parts = list(c.chat(model=MODEL, messages=user(said), think=True, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "first I plan "
        assert "".join(p.message.content for p in parts) == "then I answer"
        off = c.chat(model=MODEL, messages=user(said), think=False)
        assert off.message.thinking is None and "<think>" in off.message.content
        g = c.generate(model=MODEL, prompt=said)
        assert g.thinking == "first I plan " and g.response == "then I answer"
        status, msg = error_of(c.chat, model=MODEL, messages=user("x"), think="extreme")
        assert status == 400 and "think" in msg
    with run_octo(MODEL, "--engine", "echo") as s:
        status, msg = error_of(ollama.Client(host=s.base_url).chat, model=MODEL, messages=user("x"), think=True)
        assert status == 400 and "does not support thinking" in msg


# -- format on a real engine ---------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_format_schema_and_json_on_llamacpp(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    jsonschema = pytest.importorskip("jsonschema")
    from octo.synth.gguf import build_gguf

    gguf = str(build_gguf("tiny", ftype="q8_0"))
    catalog = tmp_path / "models.yaml"  # name:tag -> catalog variants, latest the default one
    catalog.write_text(json.dumps({"models": [{"id": "tagged", "family": "qwen2", "task": "chat",
                                               "default_variant": "q8", "variants": {
                                                   "q8": {"llamacpp": gguf}, "other": {"llamacpp": gguf}}}]}))
    with run_octo(gguf, "--engine", "llamacpp", env={"OCTO_CATALOG": str(catalog)}) as s:
        c = ollama.Client(host=s.base_url)
        name = c.list().models[0].model
        assert name == "tiny-q8_0:latest" and "tagged:latest" in [m.model for m in c.list().models]  # a name
        greedy = {"num_predict": 2, "temperature": 0}  # a sampled end token would end it sooner
        assert c.chat(model="tagged:latest", messages=user("hi"), options=greedy).eval_count == 2
        assert [m.model for m in c.ps().models if m.model.startswith("tagged")] == ["tagged:q8"]
        status, msg = error_of(c.chat, model="tagged:nope", messages=user("hi"))
        assert status == 404 and "known variants: q8 (the default), other" in msg
        assert gguf not in msg and "tiny-q8_0" in msg  # what is servable, by name: no path on the server
        shown = c.show(name)  # read from the GGUF file (the model runs in a worker process)
        assert "<|im_start|>" in shown.template and shown.details.format == "gguf"
        assert shown.modelfile.endswith("FROM tiny-q8_0:latest\n") and gguf not in json.dumps(
            [m.model_dump(mode="json") for m in (*c.list().models, *c.ps().models, shown)])  # no server path
        assert shown.modelinfo["general.architecture"] and shown.capabilities[:2] == ["completion", "tools"]
        for temperature in (0.0, 1.0):
            r = c.chat(model=name, messages=user("Who?"), format=PERSON,
                       options={"temperature": temperature, "num_predict": 200})
            jsonschema.validate(json.loads(r.message.content), PERSON)
        # any JSON object: on random weights a free string rarely ends, so a cut answer is an object's prefix
        r = c.generate(model=name, prompt="JSON please", format="json", options={"num_predict": 40, "seed": 1})
        assert r.response.lstrip().startswith("{")
        assert isinstance(json.loads(r.response), dict) if r.done_reason == "stop" else r.done_reason == "length"
        status, body = s.post_json("/api/chat", {"model": name, "messages": user("x"), "format": "yaml"})
        assert status == 400 and "format" in body["error"]


# -- pull and delete -----------------------------------------------------------------------------------------
def test_pull_with_progress_list_and_delete(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (no engine for a GGUF)")
    payload = gguf_bytes() + b"\0" * (3 << 20)  # a header and 3 MB: several progress reports
    catalog = tmp_path / "models.yaml"
    catalog.write_text(json.dumps({"models": [{"id": "pullme", "family": "llama", "task": "chat",
                                               "default_variant": "4bit", "variants": {
                                                   "4bit": {"llamacpp": "hf://org/P-GGUF/P-Q4_K_M.gguf"}}}]}))
    with HubStandin() as hub:
        hub.add_repo("org/P-GGUF", {"P-Q4_K_M.gguf": payload})
        env = {"HF_ENDPOINT": hub.url, "OCTO_CATALOG": str(catalog), "HF_HUB_CACHE": str(tmp_path / "hub")}
        with run_octo(MODEL, "--engine", "echo", env=env) as s:
            c = ollama.Client(host=s.base_url)
            assert "pullme:latest" not in [m.model for m in c.list().models]
            status, msg = error_of(c.chat, model="pullme", messages=user("x"))
            assert status == 404 and "octo pull" in msg  # a request never downloads
            progress = list(c.pull("pullme", stream=True))
            assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
            sizes = [p for p in progress if p.digest]
            assert sizes and sizes[-1].total == len(payload) and sizes[-1].completed == len(payload)
            listed = {m.model: m for m in c.list().models}
            assert listed["pullme:latest"].size == len(payload) and listed["pullme:latest"].details.format == "gguf"
            assert c.pull("pullme:latest").status == "success"  # already there, non-streamed
            assert c.delete("pullme").status == "success"
            assert "pullme:latest" not in [m.model for m in c.list().models]
            status, _ = error_of(c.delete, "pullme")
            assert status == 404
            status, _ = error_of(c.pull, "no-such-catalog-model")
            assert status == 404


# -- other clients -------------------------------------------------------------------------------------------
NODE_MODULES = REPO / ".cache" / "npm-ollama" / "node_modules"  # scripts/system-deps.sh installs the client here


def test_javascript_client_chat_stream(echo_server, tmp_path):
    node = shutil.which("node")
    if node is None or not (NODE_MODULES / "ollama" / "package.json").is_file():
        pytest.skip("the ollama JS client is not installed (scripts/system-deps.sh installs it with npm)")
    script = tmp_path / "chat.mjs"
    script.write_text(f"""
import {{ Ollama }} from {json.dumps(str(NODE_MODULES / "ollama" / "dist" / "index.mjs"))};
const client = new Ollama({{ host: {json.dumps(echo_server.base_url)} }});
const parts = [];
for await (const part of await client.chat({{ model: "{MODEL}", stream: true,
    messages: [{{ role: "user", content: "hello from node" }}] }})) parts.push(part);
const tags = await client.list();
// options saved on a model in Open WebUI, and a conversation longer than num_ctx: served, truncated
const saved = await client.chat({{ model: "{MODEL}", messages: {json.dumps(long_conversation(12, 20))},
    options: {{ num_thread: 4, num_batch: 256, use_mmap: true, num_keep: 5, repeat_last_n: 32, mirostat: 2,
                num_ctx: 200 }} }});
console.log(JSON.stringify({{ text: parts.map(p => p.message.content).join(""), last: parts[parts.length - 1],
                              names: tags.models.map(m => m.name), saved: saved.message.content,
                              savedCount: saved.prompt_eval_count }}));
""")
    out = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["text"] == "hello from node" and got["last"]["done"] is True and got["last"]["eval_count"] == 3
    assert f"{MODEL}:latest" in got["names"]
    assert got["saved"] == "the latest question" and got["savedCount"] <= 200


def test_langchain_ollama(echo_server):
    lc = pytest.importorskip("langchain_ollama")
    llm = lc.ChatOllama(model=MODEL, base_url=echo_server.base_url)
    assert llm.invoke("hello langchain").content == "hello langchain"
    assert "".join(c.content for c in llm.stream("one two three")) == "one two three"
    msg = llm.bind_tools([WEATHER]).invoke(SCRIPT)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"] == {"city": "Paris"}
    vectors = lc.OllamaEmbeddings(model=MODEL, base_url=echo_server.base_url).embed_documents(["a", "b"])
    assert len(vectors) == 2 and len(vectors[0]) == 64
    # the options a user sets on ChatOllama (what Open WebUI saves on a model): served, the long history truncated
    tuned = lc.ChatOllama(model=MODEL, base_url=echo_server.base_url, num_thread=4, num_gpu=1, mirostat=2,
                          mirostat_tau=5.0, repeat_last_n=32, repeat_penalty=1.1, tfs_z=0.9, num_ctx=200)
    said = tuned.invoke([(m["role"].replace("user", "human").replace("assistant", "ai"), m["content"])
                         for m in long_conversation(12, 20)])
    assert said.content == "the latest question" and said.usage_metadata["input_tokens"] <= 200


def test_logprobs(client):
    r = client.chat(model=MODEL, messages=user("alpha beta"), logprobs=True, top_logprobs=1)
    assert [lp.token for lp in r.logprobs] == ["alpha", " beta"] and all(lp.logprob == 0.0 for lp in r.logprobs)
    parts = list(client.chat(model=MODEL, messages=user("alpha beta"), logprobs=True, stream=True))
    assert [lp.token for p in parts for lp in p.logprobs or []] == ["alpha", " beta"]


def test_api_key():
    with run_octo(MODEL, "--engine", "echo", api_key="sesame") as s:
        status, msg = error_of(ollama.Client(host=s.base_url).list)
        assert status == 401 and "API key" in msg
        c = ollama.Client(host=s.base_url, headers={"Authorization": "Bearer sesame"})
        assert c.chat(model=MODEL, messages=user("open")).message.content == "open"
        with urllib.request.urlopen(s.url("/")) as r:  # the probe stays open, as the dashboard page does
            assert r.read() == b"Ollama is running"
