"""Open WebUI's own requests, replayed against a real `octo serve demo`, and checked for what Open WebUI reads.

The request shapes in ``tests/data/openwebui/`` come from Open WebUI 0.12.4 (PyPI ``open-webui``, default settings,
driven in headless Chromium) talking to `octo serve demo` through a logging reverse proxy: once through its Ollama
connection (``OLLAMA_BASE_URL``), once through its OpenAI connection (``OPENAI_API_BASE_URL``, key ``none``). One file
per request: method, path, the headers that matter (Open WebUI's aiohttp sends ``Content-Type: application/json``
even on a GET) and the JSON body, with three edits: the model name is ``$MODEL``, the 36 built-in tool definitions
Open WebUI attaches to every chat (24.9 kB; Time, Memory, Notes, Knowledge, Chats, Automations, Calendar...) are kept
once in ``builtin_tools.json`` (``$TOOLS``), and the random model's replies that later requests quote are filler text.
``scripts/openwebui_check.py`` runs the real Open WebUI against octo (docs/testing.md).

What each answer must carry is what Open WebUI 0.12.4 reads: ``routers/ollama.py`` (``/api/tags`` entries by
``model`` and ``name``, ``/api/ps`` ``expires_at`` through ``datetime.fromisoformat``, ``/api/version`` split into
integers, errors from ``{"error": ...}``), ``utils/response.py`` (NDJSON pieces: ``message.content``,
``message.tool_calls``, ``done``, ``done_reason`` and the counts and durations of the last one), ``utils/middleware.py``
(SSE ``data:`` lines, other lines skipped) and the frontend's pull progress (``status``, ``digest``, ``completed`` /
``total``). A random-weight model rarely ends by itself: where Open WebUI sets no length, a replay reads the first
pieces of the stream and disconnects, and the same request with a small ``num_predict`` / ``max_tokens`` checks the
end of the answer; that added field is the only change to a captured request.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the demo runs on ONNX here)")

from hub_standin import HubStandin, gguf_bytes  # noqa: E402
from serverproc import run_octo  # noqa: E402

DATA = Path(__file__).parent / "data" / "openwebui"
TOOLS = json.loads((DATA / "builtin_tools.json").read_text())
FILLER = "The harbor lies below the old lighthouse, and the keeper climbs the narrow stairs every evening. "
OLLAMA_MODEL = "demo:latest"  # the name /api/tags lists and Open WebUI sends
OPENAI_MODEL = "demo"  # the id /v1/models lists
PIECES = 12  # stream pieces read from a replay that sets no length


def shape(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def request_of(name: str, model: str, **body_changes) -> tuple[dict, dict | None]:
    """The captured request ``name`` with ``$MODEL`` and ``$TOOLS`` filled in and ``body_changes`` merged into its body
    (a nested dict is merged one level deep: ``options={"num_predict": 8}`` keeps the other options)."""
    s = shape(name)
    body = copy.deepcopy(s.get("body"))
    if body is not None:
        for key in ("model", "name"):
            if body.get(key) == "$MODEL":
                body[key] = model
        if body.get("tools") == "$TOOLS":
            body["tools"] = TOOLS
        for key, value in body_changes.items():
            if isinstance(value, dict) and isinstance(body.get(key), dict):
                body[key] = {**body[key], **value}
            elif value is None:
                body.pop(key, None)
            else:
                body[key] = value
    return s, body


def send(server, name: str, model: str, **body_changes) -> httpx.Response:
    """Replay a captured request and read the whole answer."""
    s, body = request_of(name, model, **body_changes)
    content = None if body is None else json.dumps(body).encode()
    with httpx.Client(timeout=600) as c:
        return c.request(s["method"], server.url(s["path"]), headers=s["headers"], content=content)


def first_lines(server, name: str, model: str, n: int = PIECES) -> tuple[httpx.Response, list[str]]:
    """Replay a captured streaming request, read its first ``n`` non-empty lines, then disconnect (as Open WebUI's
    Stop button does)."""
    s, body = request_of(name, model)
    lines: list[str] = []
    with httpx.Client(timeout=600) as c, c.stream(s["method"], server.url(s["path"]), headers=s["headers"],
                                                   content=json.dumps(body).encode()) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        for line in r.iter_lines():
            if line.strip():
                lines.append(line)
            if len(lines) >= n:
                break
    return r, lines


def ollama_error(r: httpx.Response) -> str:
    """The text Open WebUI shows for a failed Ollama request: ``{"error": "..."}``."""
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert isinstance(body.get("error"), dict) and body["error"].get("message"), body
    return body["error"]


@pytest.fixture(scope="module")
def demo():
    """`octo serve demo` as a user runs it (the demo's own context length, no options), on ONNX Runtime, named so
    that the run does not depend on the start-up benchmark: its prefix cache serves the 17.8k-token tool block again
    in under a second, where llama.cpp reuses no prompt longer than half its context and prefills the block again
    for every request (minutes each on 2 busy cores)."""
    with run_octo("demo", "--engine", "onnx", timeout=600) as server:
        yield server


# -- what Open WebUI reads ------------------------------------------------------------------------------------
def check_ndjson_piece(piece: dict, model: str) -> None:
    assert piece["model"] == model and piece["done"] is False
    datetime.fromisoformat(piece["created_at"])
    assert piece["message"]["role"] == "assistant" and isinstance(piece["message"]["content"], str)
    for call in piece["message"].get("tool_calls") or []:  # utils/response.py: function.name, arguments as an object
        assert isinstance(call["function"]["name"], str) and isinstance(call["function"]["arguments"], dict)


def check_ndjson_end(last: dict, model: str, bound: int) -> None:
    """The last object: ``convert_ollama_usage_to_openai`` reads the counts and the durations (nanoseconds)."""
    assert last["model"] == model and last["done"] is True and last["done_reason"] in ("stop", "length")
    for key in ("prompt_eval_count", "eval_count", "total_duration", "load_duration", "prompt_eval_duration",
                "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0, key
    assert 0 < last["prompt_eval_count"] < bound and last["eval_count"] > 0


def ndjson_answer(r: httpx.Response, model: str, bound: int) -> list[dict]:
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    for piece in lines[:-1]:
        check_ndjson_piece(piece, model)
    check_ndjson_end(lines[-1], model, bound)
    return lines


def sse_events(text_lines: list[str]) -> list[dict | str]:
    """The ``data:`` events of an SSE stream as Open WebUI's middleware reads them (other lines, keep-alive comments
    included, are skipped)."""
    events: list[dict | str] = []
    for line in text_lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_chunk(chunk: dict, model: str) -> None:
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == model
    choice = chunk["choices"][0]
    assert isinstance(choice["delta"], dict)
    assert choice["delta"].get("content") is None or isinstance(choice["delta"]["content"], str)


def window(server) -> int:
    """The demo's context length (as /v1/models lists it), plus one: the bound a prompt and its answer stay under."""
    return next(m for m in server.get_json("/v1/models")["data"] if m["id"] == OPENAI_MODEL)["context_length"] + 1


# -- the Ollama connection: model management -----------------------------------------------------------------
def test_tags_lists_names_open_webui_can_key_on(demo):
    r = send(demo, "ollama_tags", OLLAMA_MODEL)
    assert r.status_code == 200
    models = r.json()["models"]
    by_model = {m["model"]: m for m in models}  # get_all_models keys on m["model"], fetch_ollama_models reads name
    assert OLLAMA_MODEL in by_model and by_model[OLLAMA_MODEL]["name"] == OLLAMA_MODEL
    for m in models:
        assert isinstance(m["name"], str) and isinstance(m["size"], int) and isinstance(m["details"], dict)
        assert not m["name"].startswith("/") and not m["model"].startswith("/"), "a server path on every screen"
        datetime.fromisoformat(m["modified_at"])


def test_ps_expiry_parses_as_open_webui_parses_it(demo):
    r = send(demo, "ollama_ps", OLLAMA_MODEL)
    assert r.status_code == 200
    loaded = {m["model"]: m for m in r.json()["models"]}
    assert OLLAMA_MODEL in loaded  # the start-up model, loaded
    datetime.fromisoformat(loaded[OLLAMA_MODEL]["expires_at"])  # routers/ollama.py: datetime.fromisoformat(...)


def test_version_is_an_ollama_version(demo):
    r = send(demo, "ollama_version", OLLAMA_MODEL)
    assert r.status_code == 200
    version = r.json()["version"]
    # Open WebUI: tuple(map(int, re.sub(r'^v|-.*', '', v).split('.'))); clients gate features on Ollama's
    # version, and structured outputs (``format`` as a schema, which octo serves) came with Ollama 0.5.0
    numbers = tuple(map(int, re.sub(r"^v|-.*", "", version).split(".")))
    assert len(numbers) == 3 and numbers >= (0, 5, 0), version


def test_delete_of_a_model_octo_did_not_pull_is_refused_before_unloading(demo):
    r = send(demo, "ollama_delete", OLLAMA_MODEL)
    assert 400 <= r.status_code < 500 and r.status_code != 404
    assert "not found" not in ollama_error(r).lower()  # the name /api/tags lists is known
    assert OLLAMA_MODEL in {m["model"] for m in demo.get_json("/api/ps")["models"]}  # still loaded


def test_pull_progress_and_delete_as_the_manage_dialog_sends_them(tmp_path):
    """Manage Ollama: pull a catalog model (from a stand-in hub), then delete it."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(json.dumps({"models": [{"id": "pullme", "family": "llama", "task": "chat",
                                               "default_variant": "4bit", "variants": {
                                                   "4bit": {"llamacpp": "hf://org/P-GGUF/P-Q4_K_M.gguf"}}}]}))
    with HubStandin() as hub:
        hub.add_repo("org/P-GGUF", {"P-Q4_K_M.gguf": gguf_bytes() + b"\0" * (3 << 20)})
        env = {"HF_ENDPOINT": hub.url, "OCTO_CATALOG": str(catalog), "HF_HUB_CACHE": str(tmp_path / "hub")}
        with run_octo(env=env) as server:
            r = send(server, "ollama_pull", "pullme")  # no "stream": Ollama streams, Open WebUI reads lines
            assert r.status_code == 200, r.text
            progress = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            assert all(isinstance(p["status"], str) and "error" not in p for p in progress)
            assert progress[-1]["status"] == "success"
            files = [p for p in progress if p.get("digest")]  # the frontend's progress bar: completed / total
            assert files and all(isinstance(p["total"], int) and 0 <= p["completed"] <= p["total"] for p in files)
            assert files[-1]["completed"] == files[-1]["total"]
            for p in files:  # docs/ollama.md: "the digest field names the file" (Ollama: sha256:<hex>)
                assert "/resolve/" not in p["digest"] and "…" not in p["digest"], p["digest"]
            listed = {m["model"] for m in send(server, "ollama_tags", "").json()["models"]}
            assert "pullme:latest" in listed
            r = send(server, "ollama_delete", "pullme:latest")  # the dialog sends the name /api/tags listed
            assert r.status_code == 200, r.text
            assert "pullme:latest" not in {m["model"] for m in send(server, "ollama_tags", "").json()["models"]}
            r = send(server, "ollama_delete", "pullme:latest")
            assert r.status_code == 404 and ollama_error(r)


# -- the Ollama connection: chat ------------------------------------------------------------------------------
def test_first_turn_with_the_36_builtin_tools_streams(demo):
    """The request that failed with 400 context_length_exceeded: Open WebUI's default chat, tools attached."""
    r, lines = first_lines(demo, "ollama_chat_first_turn", OLLAMA_MODEL)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    for line in lines:
        piece = json.loads(line)
        if not piece["done"]:
            check_ndjson_piece(piece, OLLAMA_MODEL)
    lines = ndjson_answer(send(demo, "ollama_chat_first_turn", OLLAMA_MODEL, options={"num_predict": 16}),
                          OLLAMA_MODEL, window(demo))
    assert "".join(p["message"]["content"] for p in lines)


def test_second_turn_streams(demo):
    r, lines = first_lines(demo, "ollama_chat_second_turn", OLLAMA_MODEL)
    assert r.status_code == 200, r.text[:500]
    assert all(json.loads(line)["message"]["role"] == "assistant" for line in lines)
    ndjson_answer(send(demo, "ollama_chat_second_turn", OLLAMA_MODEL, options={"num_predict": 16}), OLLAMA_MODEL,
                  window(demo))


@pytest.mark.parametrize("task, cap", [("ollama_task_title", None), ("ollama_task_follow_ups", 32),
                                       ("ollama_task_tags", 32)])
def test_title_follow_ups_and_tags(demo, task, cap):
    """Not streamed; the title sets num_predict 1000 itself, the follow-ups and tags set no length."""
    changes = {"options": {"num_predict": cap}} if cap else {}
    r = send(demo, task, OLLAMA_MODEL, **changes)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    answer = r.json()
    assert isinstance(answer["message"]["content"], str)  # convert_response_ollama_to_openai
    check_ndjson_end(answer, OLLAMA_MODEL, window(demo))


def test_a_saved_model_with_advanced_params_chats(demo):
    """A Workspace model with 20 Advanced Params (num_thread, num_batch, use_mmap, use_mlock, num_keep, num_gpu,
    repeat_last_n, mirostat 2, tfs_z 0.95, logit_bias as Open WebUI's "12:5" string, num_ctx 2048...): Ollama
    ignores what it cannot use, and octo too, with one warning line naming them; num_ctx 2048 is the window, so
    the 17.8k-token request is truncated to it."""
    lines = ndjson_answer(send(demo, "ollama_chat_saved_model_options", OLLAMA_MODEL), OLLAMA_MODEL, 2048 + 1)
    assert lines[-1]["prompt_eval_count"] + lines[-1]["eval_count"] <= 2048
    warned = [line for line in demo.log().splitlines() if "WARNING" in line and "num_thread" in line]
    assert warned and all(name in warned[-1] for name in ("mirostat", "use_mmap", "num_batch", "logit_bias"))


# -- the OpenAI connection ---------------------------------------------------------------------------------------
def test_models_list_and_the_demos_context(demo):
    r = send(demo, "openai_models", OPENAI_MODEL)
    assert r.status_code == 200
    listed = {m["id"]: m for m in r.json()["data"]}
    assert OPENAI_MODEL in listed
    assert listed[OPENAI_MODEL]["context_length"] >= 32768  # a context real models have: the 36 tools fit


def test_openai_first_turn_with_the_36_builtin_tools_streams(demo):
    r, lines = first_lines(demo, "openai_chat_first_turn", OPENAI_MODEL)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("text/event-stream")
    for event in sse_events(lines):
        check_chunk(event, OPENAI_MODEL)
    r = send(demo, "openai_chat_first_turn", OPENAI_MODEL, max_tokens=16)
    assert r.status_code == 200, r.text[:500]
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    for event in events[:-1]:
        check_chunk(event, OPENAI_MODEL)


def test_openai_second_turn_streams(demo):
    r, lines = first_lines(demo, "openai_chat_second_turn", OPENAI_MODEL)
    assert r.status_code == 200, r.text[:500]
    assert sse_events(lines)


@pytest.mark.parametrize("task", ["openai_task_title", "openai_task_follow_ups", "openai_task_tags"])
def test_openai_title_follow_ups_and_tags(demo, task):
    r = send(demo, task, OPENAI_MODEL)
    assert r.status_code == 200, r.text[:500]
    answer = r.json()
    assert answer["object"] == "chat.completion" and isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] > 0


def test_openai_tagged_name_as_ollama_lists_it(demo):
    """The name /api/tags lists, on the OpenAI route (a client that lists through one API and chats through the
    other)."""
    r = send(demo, "openai_task_title", OLLAMA_MODEL, max_tokens=4)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["model"] == OLLAMA_MODEL


def test_openai_saved_model_params(demo):
    """Seed, temperature, top_p, min_p, penalties, logit_bias {"12": 5}, stop and max_tokens are accepted; Reasoning
    Effort on a model that does not reason is OpenAI's 400 naming the parameter (Open WebUI shows its message)."""
    r = send(demo, "openai_chat_saved_model_params", OPENAI_MODEL, reasoning_effort=None)
    assert r.status_code == 200, r.text[:500]
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]"
    r = send(demo, "openai_chat_saved_model_params", OPENAI_MODEL)
    assert r.status_code == 400 and openai_error(r)["param"] == "reasoning_effort"


def test_openai_conversation_past_the_context_keeps_openais_400(demo):
    """The second turn after an answer that filled the context (no max_tokens: the random model ran to the end):
    the OpenAI route does not truncate."""
    _, body = request_of("openai_chat_second_turn", OPENAI_MODEL)
    long_reply = FILLER * (window(demo) * 6 // len(FILLER))
    body["messages"][1]["content"] = long_reply
    r = send(demo, "openai_chat_second_turn", OPENAI_MODEL, messages=body["messages"])
    assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded"


# -- last: unloading ---------------------------------------------------------------------------------------------
def test_eject_unloads_and_the_next_request_loads_again(demo):
    """The model selector's Eject button (last here: it empties the prefix cache the other tests share)."""
    r = send(demo, "ollama_unload", OLLAMA_MODEL)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["done"] is True and answer["model"] == OLLAMA_MODEL
    assert OLLAMA_MODEL not in {m["model"] for m in demo.get_json("/api/ps")["models"]}
    r = send(demo, "ollama_task_title", OLLAMA_MODEL, options={"num_predict": 8})
    assert r.status_code == 200 and r.json()["done"] is True, r.text[:500]
    assert OLLAMA_MODEL in {m["model"] for m in demo.get_json("/api/ps")["models"]}
