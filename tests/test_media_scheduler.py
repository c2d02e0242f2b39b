"""Images in the shared scheduler (octo.scheduler.media, octo.scheduler.planner) with a scripted engine that takes
them: encodes on their own thread while other streams decode, an image fed whole once encoded, the prefix cache keyed
by the image, the same image encoded once, a failed encode failing its request alone."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig, Feed, MediaChunk, MediaInput, SamplingParams, Sequence, media_token_ids
from octo.errors import EngineError
from octo.scheduler.admission import Scheduler
from octo.scheduler.jobs import GenerationRequest
from octo.scheduler.media import take
from octo.scheduler.prefix_cache import PrefixCache

MARK = "<img>"


class PictureEngine(EchoEngine):
    """The echo engine with images: an image takes ``3 + width % 4`` positions; its encode sleeps ``encode_s``; the
    reply echoes the last user message with each image as the word ``img:<digest[:8]>``."""

    media_kinds = frozenset({"image"})

    def __init__(self, config: EngineConfig | None = None, encode_s: float = 0.0, fail: str | None = None) -> None:
        super().__init__(config)
        self.encode_s, self.fail = encode_s, fail
        self.encoded: list[str] = []
        self.fed: list[tuple[int, str, int, int]] = []  # (sequence, digest, first position, positions)
        self.encoding = False
        self.steps_while_encoding = 0
        self._first: dict[int, str] = {}  # an image's first placeholder -> its digest

    def load(self, artifact: str, name: str):
        info = super().load(artifact, name)
        info.media = frozenset({"image"})
        return info

    def tokenize_media(self, parts):
        tokens: list[int] = []
        chunks: list[MediaChunk] = []
        for p in parts:
            if isinstance(p, str):
                tokens += self.tokenize(p)
                continue
            n = 3 + p.width % 4
            chunks.append(MediaChunk("image", p.digest, len(tokens), n, data=p.digest))
            ids = media_token_ids(p.digest, n)
            self._first[ids[0]] = p.digest
            tokens += ids
        return tokens, chunks

    def encode_media(self, chunk: MediaChunk):
        self.encoding = True
        try:
            time.sleep(self.encode_s)
        finally:
            self.encoding = False
        if chunk.digest == self.fail:
            raise EngineError("this image cannot be encoded")
        self.encoded.append(chunk.digest)
        return ("embedding", chunk.digest)

    def step(self, feeds: list[Feed]):
        self.steps_while_encoding += self.encoding
        for f in feeds:
            m = f.media
            if m is not None:
                assert m.embedding == ("embedding", m.digest)
                assert f.tokens == media_token_ids(m.digest, m.n_tokens)[f.seq.n_cached - m.pos:]
                assert f.seq.n_cached + len(f.tokens) == m.end  # the rest of the image, whole
                self.fed.append((f.seq.id, m.digest, f.seq.n_cached, len(f.tokens)))
            else:
                assert all(t >= 0 for t in f.tokens), "a text feed carried image positions"
        return super().step(feeds)

    def _reply(self, history: list[int]) -> list[int]:
        words = []
        for tok in history:
            if tok >= 0:
                words.append(tok)
            elif tok in self._first:
                words.append(self._id(" img:" + self._first[tok][:8]))
        return super()._reply(words)


def image(width: int = 8, seed: int = 0) -> MediaInput:
    raw = f"{width}-{seed}".encode()
    return MediaInput("image", hashlib.sha256(raw).hexdigest(), bytes(3 * width), width, 1)


def request(e: PictureEngine, text: str, images: list[MediaInput], stream: bool = False, **kw) -> GenerationRequest:
    prompt = e.render_chat([{"role": "user", "content": text}])
    pieces = prompt.split(MARK)
    parts: list = [pieces[0]]
    for img, rest in zip(images, pieces[1:], strict=True):
        parts += [img, rest]
    tokens, chunks = e.tokenize_media(parts)
    return GenerationRequest(tokens, stream=stream, media=tuple(chunks), **kw)


def engine(encode_s: float = 0.0, fail: str | None = None, **opts) -> PictureEngine:
    e = PictureEngine(EngineConfig(options=opts), encode_s=encode_s, fail=fail)
    e.load("x", "m")
    return e


async def test_an_image_is_encoded_then_fed_whole_and_the_answer_depends_on_it():
    e = engine()
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        a, b = image(8), image(9)
        ra = await s.submit(request(e, f"look {MARK} what is it ?", [a]))[0].result
        rb = await s.submit(request(e, f"look {MARK} what is it ?", [b]))[0].result
        assert ra.text == f"look img:{a.digest[:8]} what is it ?" and rb.text == f"look img:{b.digest[:8]} what is it ?"
        assert ra.prompt_tokens == rb.prompt_tokens - 1  # the image's positions count (3 + 8 % 4, 3 + 9 % 4)
        assert e.encoded == [a.digest, b.digest]
        assert [(d, n) for _, d, _, n in e.fed] == [(a.digest, 3), (b.digest, 4)]
        assert s.stats()["media"]["encodes"] == 2
    finally:
        s.stop()


async def test_other_streams_decode_while_an_image_encodes():
    e = engine(encode_s=0.8, token_delay_ms="10")
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        text = s.submit(request(e, " ".join(f"w{i}" for i in range(80)), [], stream=True))[0]
        stamps = []
        async for _ in text.deltas():
            stamps.append(time.perf_counter())
            if len(stamps) == 5:  # the image request arrives while the text one decodes
                picture = s.submit(request(e, f"see {MARK} now", [image(8)]))[0]
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert e.steps_while_encoding >= 10  # the text stream went on stepping during the encode
        assert max(gaps) < 0.4, max(gaps)  # never stalled for the encode's 0.8 s
        assert (await picture.result).text.startswith("see img:")
    finally:
        s.stop()


async def test_a_second_turn_with_the_same_image_reuses_its_kv_and_needs_no_encode():
    e = engine()
    s = Scheduler(e, max_batch=4, cache=PrefixCache(1 << 20, e.kv_free))
    s.start()
    try:
        img = image(10)
        first = request(e, f"p q r s {MARK} b c", [img])
        r1 = await s.submit(first)[0].result
        again = request(e, f"p q r s {MARK} b c d e", [img])
        r2 = await s.submit(again)[0].result
        assert e.encoded == [img.digest]  # the cached prefix held the image: no second encode
        assert r2.cached_tokens > first.media[0].end and r1.text != r2.text
        other = request(e, f"p q r s {MARK} b c d e", [image(10, seed=1)])  # the same size, another picture
        r3 = await s.submit(other)[0].result
        assert r3.cached_tokens == other.media[0].pos  # shared up to the image, not into it
        assert len(e.encoded) == 2
    finally:
        s.stop()


async def test_the_same_image_in_requests_sent_together_is_encoded_once():
    e = engine(encode_s=0.2)
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        img = image(8)
        tickets = [s.submit(request(e, f"q{i} {MARK} ok", [img]))[0] for i in range(3)]
        results = [await t.result for t in tickets]
        assert [r.text for r in results] == [f"q{i} img:{img.digest[:8]} ok" for i in range(3)]
        assert e.encoded == [img.digest]
    finally:
        s.stop()


async def test_a_failed_encode_fails_its_request_alone():
    bad = image(8, seed=7)
    e = engine(encode_s=0.05, fail=bad.digest)
    s = Scheduler(e, max_batch=4)
    s.start()
    try:
        doomed = s.submit(request(e, f"x {MARK} y", [bad]))[0]
        fine = s.submit(request(e, f"x {MARK} y", [image(8)]))[0]
        plain = s.submit(request(e, "just text", []))[0]
        with pytest.raises(EngineError, match="cannot be encoded"):
            await asyncio.wait_for(doomed.result, 5)
        assert (await fine.result).text.startswith("x img:") and (await plain.result).text == "just text"
    finally:
        s.stop()


async def test_an_image_larger_than_a_prompt_chunk_goes_in_one_feed():
    e = engine()
    e.prefill_chunk = 2
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        img = image(11)  # 6 positions, three times the chunk
        r = await s.submit(request(e, f"one two three {MARK} four five", [img]))[0].result
        assert r.text.endswith("four five") and [n for *_, n in e.fed] == [6]
    finally:
        s.stop()


async def test_a_request_cancelled_while_its_image_encodes_leaves():
    e = engine(encode_s=0.5)
    s = Scheduler(e, max_batch=2)
    s.start()
    try:
        t = s.submit(request(e, f"x {MARK} y", [image(8)], stream=True))[0]
        await s.wait_admitted(t)
        t.cancel()
        assert (await asyncio.wait_for(t.result, 5)).finish_reason == "cancelled"
        assert (await s.submit(request(e, "after", []))[0].result).text == "after"
    finally:
        s.stop()


def test_placeholder_ids_are_negative_int32_distinct_per_image_and_stable():
    a, b = media_token_ids("ab" * 32, 300), media_token_ids("cd" * 32, 300)
    assert a == media_token_ids("ab" * 32, 300) and a[:10] == media_token_ids("ab" * 32, 10)
    assert all(-(2**31) <= t < -1 for t in a + b)
    assert not set(a) & set(b) and len(set(a)) == 300


def test_take_cuts_text_before_an_image_and_waits_for_its_encode():
    chunk = MediaChunk("image", "d" * 64, 4, 5)
    seq = Sequence(1, [1, 2, 3, 4, *media_token_ids(chunk.digest, 5), 7, 8], SamplingParams(), media=(chunk,))
    assert take(seq, 100, 100, False) == (4, None)  # text up to the image
    seq.n_cached = 4
    assert take(seq, 100, 100, False) == (0, None)  # not encoded yet
    chunk.embedding = "e"
    assert take(seq, 100, 100, False) == (5, chunk)
    assert take(seq, 100, 3, False) == (0, None) and take(seq, 100, 3, True) == (5, chunk)  # alone, it goes anyway
    seq.n_cached = 6  # (inside the image: its rest)
    assert take(seq, 100, 100, False) == (3, chunk)
    seq.n_cached = 9
    assert take(seq, 1, 100, False) == (1, None)
