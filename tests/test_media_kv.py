"""Images and memory: KV pressure counts an image's positions (admission, preemption and resumption, with the image
fed again or restored), and the memory guard counts the projector the engine loads (beside the GGUF, the one
``--mmproj`` names, none with ``--mmproj none``)."""

from __future__ import annotations

import asyncio

import pytest
from hub_standin import gguf_bytes
from test_media_scheduler import MARK, PictureEngine, image, request

from octo.engine import EngineConfig, MediaChunk, media_token_ids
from octo.runtime.memguard import gguf_kv_bytes, model_bytes
from octo.scheduler.admission import Scheduler


class BigPictures(PictureEngine):
    """Pictures of 40 positions each: the KV pool fills with images more than with text."""

    def tokenize_media(self, parts):
        tokens, chunks = [], []
        for p in parts:
            if isinstance(p, str):
                tokens += self.tokenize(p)
                continue
            chunks.append(MediaChunk("image", p.digest, len(tokens), 40, data=p.digest))
            ids = media_token_ids(p.digest, 40)
            self._first[ids[0]] = p.digest
            tokens += ids
        return tokens, chunks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_image_positions_take_kv_cells_through_admission_preemption_and_resumption(mode):
    # four prompts of a 40-position picture and ~30 words, with ~30-token answers, in a 150-cell pool: they need
    # ~400 cells together: two prompts fit (their images take most of the pool), two answers do not
    e = BigPictures(EngineConfig(options={"kv_cells": "150", "token_delay_ms": "3"}))
    e.load("x", "m")
    s = Scheduler(e, max_batch=4, preempt=mode)
    s.start()
    try:
        words = [" ".join(f"w{i}y{j}" for j in range(28)) for i in range(4)]
        reqs = [request(e, f"{MARK} {w}", [image(8, seed=i)]) for i, w in enumerate(words)]
        assert all(len(r.prompt_tokens) > 40 + 28 for r in reqs)  # the picture's positions are in the prompt
        tickets = [s.submit(r)[0] for r in reqs]
        results = [await asyncio.wait_for(t.result, 30) for t in tickets]
        for i, (w, r) in enumerate(zip(words, results, strict=True)):
            assert r.text == f"img:{image(8, seed=i).digest[:8]} {w}" and r.finish_reason == "stop"
        stats = s.stats()
        assert stats["total_preemptions"] > 0 and stats["total_resumed"] == stats["total_preemptions"]
        assert e.kv_room() == 150  # every cell came back
        assert sorted(e.encoded) == sorted(image(8, seed=i).digest for i in range(4))  # each picture encoded once
    finally:
        s.stop()


def test_the_memory_guard_counts_the_projector_the_engine_loads(tmp_path):
    model = tmp_path / "m-Q4_K_M.gguf"
    model.write_bytes(gguf_bytes("qwen2vl") + bytes(1000))
    base = model.stat().st_size + gguf_kv_bytes(model)
    assert model_bytes(model) == base  # a text model: no projector
    beside = tmp_path / "mmproj-m-f16.gguf"
    beside.write_bytes(bytes(300))
    assert model_bytes(model) == base + 300  # the one beside it
    elsewhere = tmp_path / "other" / "proj.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(bytes(700))
    assert model_bytes(model, {"mmproj": str(elsewhere)}) == base + 700  # --mmproj PATH
    assert model_bytes(model, {"mmproj": "none"}) == base  # --mmproj none: text only
    (tmp_path / "mmproj-m-f32.gguf").write_bytes(bytes(600))
    assert model_bytes(model) == base  # two beside it: the engine refuses to guess, so does the guard
    assert model_bytes(model, {"mmproj": str(beside)}) == base + 300
