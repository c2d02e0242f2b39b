"""The tools of an Anthropic Messages request: deferred tools and the server-side tool search.

A tool with ``defer_loading: true`` is not in the prompt: the model does not see it until a tool search loads it.
Two searches load tools, as in Anthropic's API:

- **client-side** (Claude Code's own ToolSearch tool): the client answers its search call with a ``tool_result``
  holding ``tool_reference`` blocks;
- **server-side**: the request offers Anthropic's tool search tool (``tool_search_tool_regex_20251119`` or
  ``tool_search_tool_bm25_20251119``); octo offers the model a function of that name (argument ``pattern`` or
  ``query``), and when the model calls it, the gateway runs the search over the deferred tools
  (:func:`run_search`, ``octo.text.toolsearch``) and the generation goes on in the same request with the result in
  the prompt (octo.server.routes.anthropic, :class:`Turn`). The answer holds a ``server_tool_use`` block (the call)
  and a ``tool_search_tool_result`` block (its ``tool_reference`` blocks), which the client sends back in the next
  turn's history.

A referenced tool is loaded from there on: its definition is expanded in place of the reference (the tool result's
text, as Anthropic's API expands it), so the prompt's beginning stays the same and the prefix cache keeps serving it,
and its calls are parsed and may be forced. Where a variant cannot run (the regex one without the ``regex`` package)
the search tool is not offered and the deferred tools stay out of the prompt; the request still succeeds."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from octo.errors import InvalidRequest, UnsupportedParameter
from octo.protocol.anthropic import ServerTool, ToolSearchTool
from octo.text import toolsearch

log = logging.getLogger("octo.serving")
SEARCH_NAMES = ("tool_search_tool_regex", "tool_search_tool_bm25")
_ARG = {"regex": "pattern", "bm25": "query"}
_ABOUT = {
    "regex": ("Search for more tools by a regular expression (Python re syntax, at most 200 characters, e.g. "
              "\"weather\" or \"(?i)slack\") over their names, descriptions, argument names and argument "
              "descriptions. Up to 5 matching tools are loaded and can be called after the search.",
              "A Python regular expression."),
    "bm25": ("Search for more tools with a natural-language query over their names, descriptions, argument names "
             "and argument descriptions. The best matches (up to 5) are loaded and can be called after the search.",
             "Words describing the tool you need."),
}
MAX_SEARCHES = 10  # searches one answer may run before it ends with stop_reason "pause_turn"


def search_function(tool: ToolSearchTool) -> dict[str, Any]:
    """The function the model sees for a tool search tool."""
    about, arg_about = _ABOUT[tool.variant]
    arg = _ARG[tool.variant]
    return {"name": tool.name, "description": about,
            "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": arg_about}},
                           "required": [arg]}}


def _function(t: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
    description = t.description or ""
    if t.input_examples:  # shown to the model with the description, as Anthropic renders them
        examples = "\n".join(json.dumps(e, ensure_ascii=False) for e in t.input_examples)
        description = (description + "\n\n" if description else "") + "Input examples:\n" + examples
    if description:
        fn["description"] = description
    return fn


@dataclass
class ToolSet:
    """The request's tools: each custom tool's function, which are deferred, the search tool, and the deferred tools
    loaded by references in the history (:meth:`reference`, while the history is read)."""

    functions: dict[str, dict[str, Any]] = field(default_factory=dict)  # in the request's order
    deferred: set[str] = field(default_factory=set)
    search: ToolSearchTool | None = None
    searchable: bool = False  # the search tool's variant can run here
    loaded: set[str] = field(default_factory=set)  # deferred tools a reference loaded
    removed: set[str] = field(default_factory=set)  # tools a tool_removal withdrew (until a later addition)

    @classmethod
    def of(cls, tools: list[Any] | None) -> ToolSet:
        ts = cls()
        for k, t in enumerate(tools or []):
            if isinstance(t, ServerTool):
                raise UnsupportedParameter(f"tools[{k}]", f"tools of type '{t.type}' are not supported; define a "
                                           "custom tool (name, description, input_schema)")
            if isinstance(t, ToolSearchTool):
                ts._add_search(k, t)
                continue
            if t.name in ts.functions:
                raise InvalidRequest(f"Function {t.name!r} appears more than once in tools.", param=f"tools[{k}].name")
            ts.functions[t.name] = _function(t)
            if t.defer_loading:
                ts.deferred.add(t.name)
        return ts

    def _add_search(self, k: int, t: ToolSearchTool) -> None:
        if self.search is not None:
            raise InvalidRequest(f"tools[{k}]: only one tool search tool is allowed per request.", param=f"tools[{k}]")
        if t.name not in SEARCH_NAMES or not t.name.endswith(t.variant):
            raise InvalidRequest(f"tools[{k}].name: a tool of type '{t.type}' must be named "
                                 f"'tool_search_tool_{t.variant}'.", param=f"tools[{k}].name")
        if t.defer_loading:
            raise InvalidRequest(f"tools[{k}].defer_loading: the tool search tool cannot be deferred: it is what "
                                 "loads the deferred tools.", param=f"tools[{k}].defer_loading")
        self.search = t
        self.searchable = t.variant != "regex" or toolsearch.regex_available()
        if not self.searchable:
            log.warning("tool search variant %r cannot run here (the regex package is not installed): the search "
                        "tool is not offered and the deferred tools stay out of the prompt", t.type)

    def reference(self, name: str, where: str) -> dict[str, Any]:
        """The function a ``tool_reference`` names (a deferred one is loaded from here on); a 400 for another name."""
        fn = self.functions.get(name)
        if fn is None:
            raise InvalidRequest(f"{where}: tool reference '{name}' has no corresponding tool definition in tools.",
                                 param=where)
        if name in self.deferred:
            self.loaded.add(name)
        self.removed.discard(name)
        return fn

    def remove(self, name: str, where: str) -> None:
        """A ``tool_removal``: the tool is no longer offered (its definition stays where it was shown)."""
        if name not in self.functions:
            raise InvalidRequest(f"{where}: tool '{name}' is not in tools.", param=where)
        self.removed.add(name)

    def callable(self) -> list[dict[str, Any]]:
        """Every function the model may call now: the tools not deferred, the loaded ones, the search tool."""
        fns = [fn for name, fn in self.functions.items()
               if (name not in self.deferred or name in self.loaded) and name not in self.removed]
        return fns + ([search_function(self.search)] if self.search is not None and self.searchable else [])

    def in_prompt(self) -> list[dict[str, Any]]:
        """The functions listed in the prompt's tool definitions: loaded ones are expanded where referenced."""
        fns = [fn for name, fn in self.functions.items() if name not in self.deferred]
        return fns + ([search_function(self.search)] if self.search is not None and self.searchable else [])


def run_search(tool: ToolSearchTool, catalog: list[dict[str, Any]], arguments: Any) -> dict[str, Any]:
    """The ``content`` of the ``tool_search_tool_result`` of one call (``arguments``: the call's input)."""
    arg = _ARG[tool.variant]
    value = arguments.get(arg) if isinstance(arguments, dict) else None
    try:
        if value is None:
            raise toolsearch.SearchFailed("invalid_tool_input", f"the search needs a '{arg}' argument")
        if tool.variant == "regex":
            names = toolsearch.regex_search(catalog, value)
        else:
            names = toolsearch.bm25_search(catalog, value)
    except toolsearch.SearchFailed as exc:
        return {"type": "tool_search_tool_result_error", "error_code": exc.code, "error_message": exc.message}
    return {"type": "tool_search_tool_search_result",
            "tool_references": [{"type": "tool_reference", "tool_name": n} for n in names]}


def result_text(content: Any, toolset: ToolSet, where: str) -> str:
    """What the model reads for a ``tool_search_tool_result``: the loaded tools' definitions, or the error."""
    if content.type == "tool_search_tool_result_error":
        return f"Error: {content.error_code}" + (f": {content.error_message}" if content.error_message else "")
    fns = [toolset.reference(r.tool_name, f"{where}.content.tool_references[{k}].tool_name")
           for k, r in enumerate(content.tool_references)]
    return toolsearch.expansion(fns) if fns else "No tools matched the search."


def deferred_catalog(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The functions a server-side search looks through: the deferred custom tools."""
    return [_function(t) for t in tools or [] if not isinstance(t, ServerTool | ToolSearchTool) and t.defer_loading]
