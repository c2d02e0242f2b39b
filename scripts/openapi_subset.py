"""Extract the schemas octo's tests validate responses against from OpenAI's published OpenAPI spec
(github.com/openai/openai-openapi, openapi.json) into tests/data/openai_openapi_subset.json: the named roots and
every schema they reference, unchanged. The tests run offline, so the subset is committed; re-run this to refresh it:

    python scripts/openapi_subset.py PATH/TO/openapi.json [COMMIT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = ["Response", "ResponseStreamEvent", "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "DeleteResponse"]
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "openai_openapi_subset.json"


def refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    schemas = spec["components"]["schemas"]
    keep: set[str] = set()
    todo = [r for r in ROOTS if r in schemas]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        refs(schemas[name], found)
        todo += sorted(found - keep)
    subset = {"source": "https://github.com/openai/openai-openapi openapi.json",
              "commit": sys.argv[2] if len(sys.argv) > 2 else None, "openapi": spec.get("openapi"),
              "components": {"schemas": {k: schemas[k] for k in sorted(keep)}}}
    OUT.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")
    print(f"{len(keep)} schemas -> {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
