"""One served model: resolution, engine choice, loading, and its scheduler (``ModelHandle``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from octo.config import ServerConfig
from octo.engine import Engine, EngineConfig, Task
from octo.errors import ConfigError
from octo.prefix_cache import PrefixCache
from octo.scheduler import Scheduler

log = logging.getLogger("octo.model")


@dataclass
class ModelHandle:
    name: str
    aliases: tuple[str, ...]
    engine_name: str
    engine: Engine
    artifact: str
    scheduler: Scheduler | None = None
    cache: PrefixCache | None = None
    selection: dict[str, Any] = field(default_factory=dict)  # how the engine was chosen (/v1/engines)
    benchmarks: dict[str, Any] = field(default_factory=dict)  # engine name -> benchmark result

    @property
    def info(self):
        return self.engine.info

    @property
    def tasks(self) -> frozenset[Task]:
        return self.engine.info.tasks or self.engine.tasks

    @property
    def task(self) -> str:
        """The main task: "transcription", "embeddings" or "chat"."""
        for t in (Task.TRANSCRIPTION, Task.CHAT, Task.EMBEDDINGS):
            if t in self.tasks:
                return t.value
        return next(iter(self.tasks)).value

    @functools.cached_property
    def fingerprint(self) -> str:
        return f"octo-{self.engine_name}-{self.engine.version()}"

    def matches(self, model: str | None) -> bool:
        """Whether a request's ``model`` field names this model (absent means the served one)."""
        if not model or model == self.name or model in self.aliases:
            return True
        # OpenAI clients name their hosted models; accept those names for the matching task
        return model == "whisper-1" and self.task == "transcription"

    def start(self, config: ServerConfig) -> None:
        cache = None
        if not config.no_cache and config.cache_size_mb > 0 and self.engine.tasks & {Task.CHAT, Task.COMPLETION}:
            cache = PrefixCache(int(config.cache_size_mb * 2**20), self.engine.kv_free)
        self.cache = cache
        self.scheduler = Scheduler(self.engine, max_batch=config.max_batch, max_queue=config.max_queue,
                                   queue_timeout=config.queue_timeout, cache=cache)
        self.scheduler.start()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        try:
            self.engine.unload()
        except Exception:  # noqa: BLE001
            log.exception("engine unload failed")


def make_engine(cls: type[Engine], config: ServerConfig) -> Engine:
    return cls(EngineConfig(max_batch=config.max_batch, options=dict(config.options)))


def load_engine(cls: type[Engine], config: ServerConfig, artifact: str, name: str) -> Engine:
    """Construct and load an engine; any failure is a ConfigError naming the engine and artifact."""
    engine = make_engine(cls, config)
    try:
        engine.load(artifact, name)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"Engine '{cls.name}' could not load '{artifact}': {type(exc).__name__}: {exc}") from exc
    if engine.info is None:
        raise ConfigError(f"Engine '{cls.name}' returned no model info for '{artifact}'.")
    return engine
