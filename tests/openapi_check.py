"""Validation against OpenAI's published OpenAPI schemas (the subset in tests/data, see scripts/openapi_subset.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

SUBSET = Path(__file__).resolve().parent / "data" / "openai_openapi_subset.json"


@functools.cache
def _validator(name: str):
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = _nullable(json.loads(SUBSET.read_text()))
    registry = Registry().with_resource("urn:openai", Resource.from_contents(doc, default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)


def _nullable(node):
    """OpenAI's spec says 3.1 but still marks optional nulls with OpenAPI 3.0's ``nullable: true``, which JSON Schema
    ignores: turn it into a ``null`` type (and a ``None`` enum member), as the spec means it."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.pop("nullable", False):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        if "type" not in out and "enum" not in out:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _event_schemas() -> dict[str, str]:
    """Streaming event type -> the schema of that event (the members of ResponseStreamEvent's anyOf)."""
    doc = json.loads(SUBSET.read_text())["components"]["schemas"]
    out = {}
    for member in doc["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in doc[name].get("properties", {}).get("type", {}).get("enum", []):
            out[kind] = name
    return out


def check_event(event: dict) -> None:
    """A Responses streaming event against the schema of its type (precise errors, unlike the anyOf)."""
    name = _event_schemas().get(event.get("type"))
    if name is None:
        raise AssertionError(f"unknown Responses event type {event.get('type')!r}")
    check(name, event)


def check(name: str, instance: dict) -> None:
    """Raise AssertionError listing every way ``instance`` breaks OpenAI's schema ``name``."""
    errors = sorted(_validator(name).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:10]]
        raise AssertionError(f"{name} schema violations:\n" + "\n".join(lines))
