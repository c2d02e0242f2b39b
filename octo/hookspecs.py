"""Plugin hooks of octo (pluggy). Built-in engines and third-party plugins implement the same hooks.

A plugin is any module or object with functions marked ``@hookimpl``; third-party packages expose it
through the ``octo`` entry-point group, local files through ``--plugins-dir``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "octo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_engines(register: Callable[[type], None]) -> None:
    """Call ``register(EngineClass)`` for each :class:`octo.engine.Engine` subclass the plugin provides."""


@hookspec
def register_routes(app: Any) -> None:
    """Add routes or middlewares to the aiohttp application before it starts. octo's own checks (Host, CORS, API key,
    errors in the API's shape) run before a plugin's middlewares and routes, and what a plugin's route answers or
    streams gets the request id and CORS headers too (octo.server.guard, octo.server.stamp)."""


@hookspec
def register_commands(cli: Any) -> None:
    """Add click commands to the ``octo`` command group."""
