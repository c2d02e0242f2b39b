"""The start-up benchmark of a vision-language model: an image prompt measured beside the text metrics, scored, shown
in the selection's table; with fake engines of known speed."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_selection import _Cand, _Fake

from octo.engine import Feed, MediaChunk, media_token_ids
from octo.runtime.benchmark import IMAGE_SIZE, IMAGE_WEIGHT, WEIGHTS, bench_image, micro_benchmark, score
from octo.runtime.selection import select


class _Seeing(_Fake):
    """A fake engine whose model takes images: a picture takes 12 positions; its encode takes ``encode_s``."""

    media_kinds = frozenset({"image"})
    encode_s = 0.05
    fail = False

    def load(self, artifact, name):
        info = super().load(artifact, name)
        info.media = frozenset({"image"})
        self.fed_images: list[int] = []
        return info

    def render_chat(self, messages, add_generation_prompt=True, tools=None):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def tokenize_media(self, parts):
        tokens, chunks = [], []
        for p in parts:
            if isinstance(p, str):
                tokens += self.tokenize(p)
            else:
                chunks.append(MediaChunk("image", p.digest, len(tokens), 12))
                tokens += media_token_ids(p.digest, 12)
        return tokens, chunks

    def encode_media(self, chunk):
        if self.fail:
            raise RuntimeError("no vision tower")
        self.spend(self.encode_s)
        return ("embedding", chunk.digest)

    def step(self, feeds: list[Feed]):
        for f in feeds:
            if f.media is not None:
                assert f.media.embedding == ("embedding", f.media.digest) and f.seq.n_cached == f.media.pos
                self.fed_images.append(len(f.tokens))
            else:
                assert all(t >= 0 for t in f.tokens)
        return super().step(feeds)


class SeeingFast(_Seeing):
    name = "seeingfast"
    encode_s = 0.02


class SeeingSlow(_Seeing):
    name = "seeingslow"
    encode_s = 0.4


class Blind(_Seeing):
    name = "blind"
    fail = True


def _engine(cls, home):
    e = cls()
    e.load(str(home), "m")
    return e


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    art = tmp_path / "model.bin"
    art.write_bytes(b"x" * 1000)
    return art


def test_a_vision_models_benchmark_measures_an_image_prompt_apart_from_the_text_budget(home):
    e = _engine(SeeingSlow, home)
    t0 = time.perf_counter()
    r = micro_benchmark(e, seconds=0.6)
    assert r["error"] is None and r.get("image_error") is None
    assert r["image_tokens"] == 12 and e.fed_images == [12]  # the picture went whole, once encoded
    assert 0.4 <= r["image_encode_s"] <= r["image_prefill_s"] < 2.0
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["batch_decode_tok_s"] > 0
    assert not r["conditions"]["budget_too_small"]  # the image's time is not taken from the text budget
    assert r["seconds"] >= r["image_prefill_s"] and time.perf_counter() - t0 < 4.0
    assert r["score"] == score(r) > 0


def test_the_score_gives_images_per_second_their_weight():
    text = {"prefill_tok_s": 100.0, "decode_tok_s": 20.0, "batch_decode_tok_s": 60.0}
    plain = score(text)
    assert plain == round(60.0 ** WEIGHTS["batch_decode_tok_s"] * 20.0 ** 0.3 * 100.0 ** 0.2, 3)
    one_s = score({**text, "image_prefill_s": 1.0})  # one image a second: a factor of 1
    assert one_s == round(plain ** (1 - IMAGE_WEIGHT), 3)
    assert score({**text, "image_prefill_s": 0.5}) == round(one_s * 2 ** IMAGE_WEIGHT, 3)
    assert score({**text, "image_prefill_s": None}) < 0.1 * one_s  # a vision model whose picture failed


def test_an_engine_that_cannot_take_the_picture_is_recorded_and_scored_as_such(home):
    r = micro_benchmark(_engine(Blind, home), seconds=0.4)
    assert r["error"] is None and r["image_prefill_s"] is None
    assert r["image_error"] == "RuntimeError: no vision tower" and r["decode_tok_s"] > 0  # text still measured
    assert r["score"] < 0.1 * score({k: v for k, v in r.items() if k != "image_prefill_s"})


def test_the_selection_weighs_the_image_and_its_table_shows_it(home):
    said: list[str] = []
    name, cand, results, _ = asyncio.run(select({"seeingslow": _Cand(SeeingSlow, str(home)),
                                                 "seeingfast": _Cand(SeeingFast, str(home))},
                                                seconds=0.4, say=said.append))
    assert name == "seeingfast"  # the same text speed, a faster picture
    assert results["seeingslow"]["image_prefill_s"] > results["seeingfast"]["image_prefill_s"]
    head = next(line for line in said if line.startswith("engine"))
    assert "image s" in head
    row = next(line for line in said if line.startswith("seeingslow"))
    assert f"{results['seeingslow']['image_prefill_s']:9.2f}" in row
    assert any("image " in line and "s to the first token (12 image tokens" in line for line in said)


def test_the_picture_is_fixed():
    a, b = bench_image(), bench_image()
    assert (a.width, a.height) == IMAGE_SIZE and len(a.data) == 3 * IMAGE_SIZE[0] * IMAGE_SIZE[1]
    assert a.digest == b.digest and a.data == b.data


def test_a_vision_models_benchmark_may_take_its_load_time_longer():
    from octo.engine import ModelInfo
    from octo.runtime.process import BENCH_GRACE

    text = ModelInfo(name="m", n_ctx=8, eos_token_ids=frozenset(), n_vocab=8)
    vision = ModelInfo(name="m", n_ctx=8, eos_token_ids=frozenset(), n_vocab=8, media=frozenset({"image"}))
    assert BENCH_GRACE(3.0) == BENCH_GRACE(3.0, {"info": text, "load_seconds": 40.0}) == 29.0
    assert BENCH_GRACE(3.0, {"info": vision, "load_seconds": 40.0}) == 69.0
