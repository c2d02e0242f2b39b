"""The constrained-decoding vocabulary of a model is built in a lull after it starts serving, never in the way of
its first requests nor of its unload (octo.runtime.model.DeferredVocab)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def _handle():
    from octo.config import ServerConfig
    from octo.plugins import engine_registry
    from octo.runtime.model import ModelHandle, load_engine
    from octo.synth.gguf import build_gguf

    config = ServerConfig(max_batch=2, options={"n_threads": "1", "n_ctx": "512"})
    engine = load_engine(engine_registry()["llamacpp"], config, str(build_gguf("tiny", ftype="q8_0")), "tiny")
    handle = ModelHandle("tiny", (), "llamacpp", engine, "tiny")
    handle.start(config)
    return handle, engine


def _vocab_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "octo-vocab"]


async def test_an_unload_before_the_lull_stops_the_wait_and_builds_nothing():
    from octo.text.constrain import vocab_built

    handle, engine = _handle()
    await asyncio.sleep(0.3)
    assert not vocab_built(engine) and _vocab_threads()  # waiting for a lull: no request came yet (5 s)
    t0 = time.monotonic()
    handle.stop()
    assert time.monotonic() - t0 < 3
    deadline = time.monotonic() + 5
    while _vocab_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _vocab_threads()


async def test_with_no_request_it_is_built_after_the_idle_delay(monkeypatch):
    from octo.runtime import model
    from octo.text.constrain import vocab_built

    monkeypatch.setattr(model, "VOCAB_UNUSED_S", 0.5)
    handle, engine = _handle()
    try:
        deadline = time.monotonic() + 20
        while not vocab_built(engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert vocab_built(engine)
    finally:
        handle.stop()
