"""What every request handler can reach: ``request.app[STATE]``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from octo.config import ServerConfig


@dataclass
class AppState:
    config: ServerConfig
    handle: Any  # octo.model.ModelHandle
    engines: list[dict[str, Any]] = field(default_factory=list)  # /v1/engines rows, filled at start-up
    metrics: Any = None
    started: float = 0.0


STATE = web.AppKey("octo_state", AppState)
