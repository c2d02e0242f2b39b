"""Every stream event kind through every placement of a model, on every chat API (real `octo serve`, official SDKs).

The model (the ``faulty`` test engine: echo with fault words, ``-o think=1`` so ``<think>`` text is its reasoning) runs
in the gateway (``--isolation thread``), in an engine worker (``--isolation process``) and on a Ray Serve replica
(``--cluster ray``): one server per placement for the whole module. Each case sends one request, streamed and not, on
OpenAI Chat Completions, Responses and Anthropic Messages, that makes the engine loop post one kind of event (text,
reasoning, tool-call deltas, logprobs, cached prompt tokens, an error after some text; every one ends with its done
or error event). What the client saw is checked for what that kind must show, and must be the same in every
placement (ids and times aside): the events are one vocabulary (``octo.scheduler.events``), whichever way they travel.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from serverproc import REPO, run_octo

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODEL = "m"
PLUGINS = str(REPO / "tests" / "plugins")
SERVE = (MODEL, "--engine", "faulty", "--plugins-dir", PLUGINS, "-o", "think=1", "-o", "after=3")
PLACEMENTS = {"thread": ("--isolation", "thread"), "process": ("--isolation", "process"),
              "ray": ("--cluster", "ray", "--replicas", "1", "--replica-cpus", "0.5")}
SAID = "<think> first I plan </think> then I answer"
CALL = {"name": "get_time", "arguments": {"zone": "UTC"}}
TOOL_SAID = f"<think> I need the time </think> <tool_call> {json.dumps(CALL)} </tool_call>"
SCHEMA = {"type": "object", "properties": {"zone": {"type": "string"}}}
LONG = "the keeper climbs the narrow stairs to light the lamp every evening " * 5
PROMPTS = {"text": "hello there small world", "reasoning": SAID, "tool": TOOL_SAID, "logprobs": "count one two three",
           "cached": LONG, "error": "one two three SEQFAIL four five six"}
APIS = ("chat", "responses", "messages")
SEEN: dict[tuple, Any] = {}  # (api, kind, stream) -> what the first placement's client saw


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def server(request):
    if request.param == "ray":
        pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'octo[ray]')")
    with run_octo(*SERVE, *PLACEMENTS[request.param], timeout=240.0) as s:
        s.placement = request.param
        yield s


# -- one request per API, what its client saw as plain data -----------------------------------------------------
def _error(exc: Exception) -> dict[str, Any]:
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else {}
    return {"raised": type(exc).__name__, "status": getattr(exc, "status_code", None),
            "code": err.get("code") or err.get("type"), "message": err.get("message") or str(exc)}


def chat(server, kind: str, stream: bool) -> Any:
    kw: dict[str, Any] = {"max_tokens": 64}
    if kind == "tool":
        kw["tools"] = [{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}}]
    if kind == "logprobs":
        kw.update(logprobs=True, top_logprobs=1)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    client = server.openai(max_retries=0)
    try:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[kind]}],
                                           stream=stream, **kw)
        return [c.model_dump() for c in r] if stream else r.model_dump()
    except openai.APIError as exc:
        return _error(exc)


def responses(server, kind: str, stream: bool) -> Any:
    kw: dict[str, Any] = {"max_output_tokens": 64}
    if kind == "tool":
        kw["tools"] = [{"type": "function", "name": "get_time", "parameters": SCHEMA}]
    if kind == "logprobs":
        kw.update(include=["message.output_text.logprobs"], top_logprobs=1)
    client = server.openai(max_retries=0)
    try:
        r = client.responses.create(model=MODEL, input=PROMPTS[kind], stream=stream, store=False, **kw)
        return [e.model_dump() for e in r] if stream else r.model_dump()
    except openai.APIError as exc:
        return _error(exc)


def messages(server, kind: str, stream: bool) -> Any:
    kw: dict[str, Any] = {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if kind == "tool":
        kw["tools"] = [{"name": "get_time", "input_schema": SCHEMA}]
    client = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="x", max_retries=0)
    try:
        r = client.messages.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[kind]}],
                                   stream=stream, **kw)
        return [e.model_dump() for e in r] if stream else r.model_dump()
    except anthropic.APIError as exc:
        return _error(exc)


SEND = {"chat": chat, "responses": responses, "messages": messages}
_ID = re.compile(r"^(chatcmpl|cmpl|resp|msg|call|toolu|fc|rs)[-_][A-Za-z0-9_-]+$")


def _plain(obj: Any) -> Any:
    """``obj`` with its ids and times made placeholders (they differ from request to request)."""
    if isinstance(obj, dict):
        return {k: 0 if k in ("created", "created_at", "completed_at") else _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return "<id>" if isinstance(obj, str) and _ID.match(obj) else obj


# -- what each kind must show, from the client's data ------------------------------------------------------------
def _chat_view(got: Any, stream: bool) -> dict[str, Any]:
    if "raised" in got:
        return {"error": got}
    if not stream:
        c = got["choices"][0]
        msg = c["message"]
        return {"text": msg["content"] or "", "reasoning": msg.get("reasoning_content") or "",
                "args": "".join(t["function"]["arguments"] for t in msg.get("tool_calls") or []),
                "lps": len((c.get("logprobs") or {}).get("content") or []), "finish": c["finish_reason"],
                "cached": got["usage"]["prompt_tokens_details"]["cached_tokens"]}
    deltas = [c for ch in got for c in ch["choices"]]
    usage = next(ch["usage"] for ch in got if ch.get("usage"))
    return {"text": "".join(c["delta"].get("content") or "" for c in deltas),
            "reasoning": "".join(c["delta"].get("reasoning_content") or "" for c in deltas),
            "args": "".join(t["function"]["arguments"] or "" for c in deltas
                            for t in c["delta"].get("tool_calls") or []),
            "lps": sum(len((c.get("logprobs") or {}).get("content") or []) for c in deltas),
            "finish": next(c["finish_reason"] for c in deltas if c["finish_reason"]),
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def _responses_view(got: Any, stream: bool) -> dict[str, Any]:
    if isinstance(got, dict) and "raised" in got:
        return {"error": got}
    if stream:
        last = got[-1]
        if last["type"] == "response.failed":
            return {"error": last["response"]["error"]}
        resp = last["response"]
        streamed = "".join(e.get("delta") or "" for e in got if e["type"] == "response.output_text.delta")
        args = "".join(e.get("delta") or "" for e in got if e["type"] == "response.function_call_arguments.delta")
        lps = sum(len(e.get("logprobs") or []) for e in got if e["type"] == "response.output_text.delta")
    else:
        resp, streamed, args, lps = got, None, None, None
    text = "".join(c["text"] for item in resp["output"] if item["type"] == "message" for c in item["content"])
    view = {"text": text, "args": "".join(i["arguments"] for i in resp["output"] if i["type"] == "function_call"),
            "lps": sum(len(c.get("logprobs") or []) for item in resp["output"] if item["type"] == "message"
                       for c in item["content"]),
            "finish": resp["status"], "cached": resp["usage"]["input_tokens_details"]["cached_tokens"]}
    if stream:
        assert streamed == view["text"] and args == view["args"] and lps == view["lps"], (view, streamed, args, lps)
    return view


def _messages_view(got: Any, stream: bool) -> dict[str, Any]:
    if isinstance(got, dict) and "raised" in got:
        return {"error": got}
    if stream:
        if got[-1]["type"] == "error":
            return {"error": got[-1]["error"]}
        deltas = [e["delta"] for e in got if e["type"] == "content_block_delta"]
        start = next(e for e in got if e["type"] == "message_start")["message"]["usage"]
        return {"text": "".join(d.get("text") or "" for d in deltas),
                "reasoning": "".join(d.get("thinking") or "" for d in deltas),
                "args": "".join(d.get("partial_json") or "" for d in deltas),
                "finish": next(e for e in got if e["type"] == "message_delta")["delta"]["stop_reason"],
                "cached": start["cache_read_input_tokens"]}
    blocks = got["content"]
    return {"text": "".join(b["text"] for b in blocks if b["type"] == "text"),
            "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "args": "".join(json.dumps(b["input"]) for b in blocks if b["type"] == "tool_use"),
            "finish": got["stop_reason"], "cached": got["usage"]["cache_read_input_tokens"]}


VIEW = {"chat": _chat_view, "responses": _responses_view, "messages": _messages_view}


def _check_kind(api: str, kind: str, stream: bool, view: dict[str, Any]) -> None:
    if kind == "error":
        err = view["error"]
        assert "SEQFAIL" in str(err) or "fail" in str(err).lower(), view
        assert "Traceback" not in str(err)
        return
    assert "error" not in view, view
    if kind == "text":
        assert view["text"] == PROMPTS["text"] and view["finish"] in ("stop", "completed", "end_turn"), view
    if kind == "reasoning":
        assert view["text"] == "then I answer", view
        if api != "responses":  # Responses has no reasoning items for octo's models: the text is the answer alone
            assert view["reasoning"] == "first I plan ", view
    if kind == "tool":
        assert json.loads(view["args"]) == CALL["arguments"], view
        assert view["finish"] in ("tool_calls", "completed", "tool_use"), view
    if kind == "logprobs" and api != "messages":
        assert view["lps"] == len(PROMPTS["logprobs"].split()), view
    if kind == "cached":
        assert view["text"] == LONG.strip(), view


CASES = [(api, kind) for api in APIS for kind in PROMPTS if not (api == "messages" and kind == "logprobs")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api,kind", CASES)
def test_event_kind(server, api, kind, stream):
    if kind == "cached":  # the second time, the prompt comes from the prefix cache
        SEND[api](server, kind, stream)
    got = SEND[api](server, kind, stream)
    view = VIEW[api](got, stream)
    _check_kind(api, kind, stream, view)
    if kind == "cached":
        assert view["cached"] > 0, view
    seen = SEEN.setdefault((api, kind, stream), (server.placement, _plain(got)))
    if seen[0] != server.placement:  # the same client-side data as in the first placement, event by event
        assert _plain(got) == seen[1], f"{server.placement} differs from {seen[0]}"
