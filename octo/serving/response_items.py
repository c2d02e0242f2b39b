"""``GET /v1/responses/{id}/input_items``: the input items a stored response was generated from, in the Responses API's
shapes, from the conversation the store keeps (octo.serving.response_store): chat messages, their images as
``input_image`` parts."""

from __future__ import annotations

import hashlib
from typing import Any

from octo.errors import InvalidRequest
from octo.serving.responses import INCLUDE_LOGPROBS, INCLUDE_REASONING

INCLUDABLE = frozenset({"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                        "message.input_image.image_url", "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs", INCLUDE_REASONING, INCLUDE_LOGPROBS})


def _item_id(rid: str, prefix: str, *where: int) -> str:
    """A stable id of one input item of response ``rid`` (the same at every listing, so pages can point at it)."""
    return f"{prefix}_{hashlib.sha256(':'.join(map(str, (rid, *where))).encode()).hexdigest()[:40]}"


def input_items(rid: str, conversation: list[dict[str, Any]], image_urls: bool = False) -> list[dict[str, Any]]:
    """The input items a stored response was generated from, oldest first, in the Responses API's shapes: the stored
    conversation (earlier turns of a ``previous_response_id`` chain, their answers and this request's input) without
    the response's own answer; ``instructions`` are not items. An image is an ``input_image`` part, its URL null
    unless ``image_urls`` (``include=message.input_image.image_url``, as OpenAI's API)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(conversation[:-1]):
        role, content = m["role"], m.get("content")
        if role == "tool":
            output = _parts(content, role, image_urls) if isinstance(content, list) else content or ""
            out.append({"id": _item_id(rid, "fco", i), "type": "function_call_output", "call_id":
                        m.get("tool_call_id", ""), "output": output, "status": "completed"})
            continue
        if content or not m.get("tool_calls"):
            out.append({"id": _item_id(rid, "msg", i), "type": "message", "role": role,
                        "content": _parts(content, role, image_urls), "status": "completed"})
        for j, c in enumerate(m.get("tool_calls") or ()):
            out.append({"id": _item_id(rid, "fc", i, j), "type": "function_call", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                        "status": "completed"})
    return out


def _parts(content: str | list[dict[str, Any]] | None, role: str, image_urls: bool) -> list[dict[str, Any]]:
    """A chat message's content as Responses content parts (a list holds text and ``image_url`` parts)."""
    def text(t: str) -> dict[str, Any]:
        return {"type": "output_text", "text": t, "annotations": []} if role == "assistant" else \
            {"type": "input_text", "text": t}

    if not isinstance(content, list):
        return [text(content or "")]
    return [text(p["text"]) if p["type"] == "text" else
            {"type": "input_image", "image_url": p["image_url"]["url"] if image_urls else None, "file_id": None,
             "detail": p["image_url"].get("detail") or "auto"} for p in content]


def input_items_page(rid: str, conversation: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """OpenAI's list of a response's input items: ``order`` (``desc``, the default, newest first, or ``asc``),
    ``limit`` (1-100, default 20), ``after`` / ``before`` (an item id: the items after or before it in that order),
    ``include`` (``message.input_image.image_url``: images' URLs; the other includable fields are accepted: these
    items carry none of them)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid value for 'order': expected 'asc' or 'desc'.", param="order",
                             code="invalid_value")
    raw = query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise InvalidRequest("Invalid value for 'limit': an integer from 1 to 100.", param="limit",
                             code="invalid_value")
    include = query.getall("include", []) + query.getall("include[]", [])
    for value in include:
        if value not in INCLUDABLE:
            raise InvalidRequest(f"Invalid value for 'include': '{value[:100]}' is not an includable field.",
                                 param="include", code="invalid_value")
    items = input_items(rid, conversation, "message.input_image.image_url" in include)
    if order == "desc":
        items.reverse()
    ids = [it["id"] for it in items]
    start, end = 0, len(items)
    for name in ("after", "before"):
        cursor = query.get(name)
        if cursor is None:
            continue
        if cursor not in ids:
            raise InvalidRequest(f"No input item with id '{cursor[:100]}' in response '{rid}'.", param=name)
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    page = items[start:end][:int(raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}
