"""What every request handler can reach: ``request.app[STATE]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from octo.config import ServerConfig


@dataclass
class AppState:
    config: ServerConfig
    registry: Any  # octo.runtime.registry.Registry: every servable model and the loaded ones' handles
    metrics: Any = None
    started: float = 0.0
    draining: bool = False  # SIGTERM: new requests get 503 while the running ones finish (--shutdown-timeout)
    inflight: int = 0  # requests being handled (not counting /health and /metrics)
    store: Any = None  # octo.serving.response_store.ResponseStore, opened on the first Responses API request

    @property
    def handle(self) -> Any:
        """The loaded model's handle, when exactly one is loaded (plugins and tests of a one-model server)."""
        loaded = self.registry.loaded()
        if len(loaded) != 1:
            raise LookupError(f"{len(loaded)} models are loaded; use state.registry")
        return loaded[0].handle


STATE = web.AppKey("octo_state", AppState)
