"""M-RoPE images on the llama.cpp engine (engines/llamacpp/vision.py) with the synthetic Qwen2.5-VL
(``demo-vision-qwen``: a GGUF and its projector by llama.cpp's own converter), through the shared scheduler.

The reference is libmtmd's own evaluation on a context of its own (``mtmd_helper_eval_chunks``: llama.cpp's image
positions and ``n_past``, what llama-server runs), then greedy decoding: octo must give the same tokens, with images
anywhere in the prompt, beside other streams, after a prefix-cache hit, after a restore cut inside an image, and when
sequences share an image's KV in flight. ``bench/vision_parity.py --model demo-vision-qwen`` makes the same check
against llama-server itself."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import io

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("transformers", reason="building the synthetic vision model needs transformers")
pytest.importorskip("PIL", reason="Pillow is not installed")

import numpy as np  # noqa: E402
from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from octo.engines.llamacpp.native import Batch  # noqa: E402
from octo.engines.llamacpp.vision import floor, position  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from octo.engine import EngineConfig, MediaInput, SamplingParams, Sequence  # noqa: E402
from octo.scheduler.admission import Scheduler  # noqa: E402
from octo.scheduler.jobs import GenerationRequest  # noqa: E402
from octo.scheduler.prefix_cache import PrefixCache  # noqa: E402

MARK = "<<image>>"


@pytest.fixture(scope="module")
def gguf() -> str:
    from octo.synth.vision import build_vision_gguf

    return str(build_vision_gguf("demo-vision-qwen"))


@pytest.fixture(scope="module")
def engine(gguf):
    e = LlamaCppEngine(EngineConfig(max_batch=4, options={"n_threads": 2}))
    e.load(gguf, "demo-vision-qwen")
    yield e
    e.unload()


def picture(color: tuple[int, int, int], size: tuple[int, int] = (80, 60), circle: bool = False) -> MediaInput:
    img = Image.new("RGB", size, color)
    if circle:
        ImageDraw.Draw(img).ellipse((10, 10, size[0] // 2, size[1] // 2), fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return MediaInput("image", hashlib.sha256(buf.getvalue()).hexdigest(), img.tobytes(), img.width, img.height)


def parts_of(e, turns: list[str], images: list[MediaInput]) -> list:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    pieces = e.render_chat(messages).split(MARK)
    parts: list = [pieces[0]]
    for img, rest in zip(images, pieces[1:], strict=True):
        parts += [img, rest]
    return parts


def request(e, parts: list, max_tokens: int = 10) -> GenerationRequest:
    tokens, chunks = e.tokenize_media(parts)
    return GenerationRequest(tokens, SamplingParams(temperature=0.0), max_tokens=max_tokens, media=tuple(chunks))


def run(e, *reqs: GenerationRequest, cache: bool = False) -> list:
    """The results of requests submitted together to one scheduler (``cache``: with a prefix cache, in turn)."""
    async def go():
        s = Scheduler(e, max_batch=4, cache=PrefixCache(64 << 20, e.kv_free) if cache else None)
        s.start()
        try:
            if cache:
                return [await s.submit(r)[0].result for r in reqs]
            return [await t.result for t in [s.submit(r)[0] for r in reqs]]
        finally:
            s.stop()

    return asyncio.run(go())


def reference(e, parts: list, max_tokens: int = 10) -> tuple[int, list[int]]:
    """(prompt tokens, greedy tokens) by libmtmd's own evaluation of the prompt on a context of its own."""
    M, L = e.vision.M, e.lib
    marker = M.mtmd_default_marker().decode()
    raw = "".join(marker if isinstance(p, MediaInput) else p for p in parts).encode()
    images = [p for p in parts if isinstance(p, MediaInput)]
    pixels = [(ctypes.c_uint8 * len(p.data)).from_buffer_copy(p.data) for p in images]
    bitmaps = [M.mtmd_bitmap_init(p.width, p.height, px) for p, px in zip(images, pixels, strict=True)]
    text = M.mtmd_input_text(raw, len(raw), True, True)
    chunks = M.mtmd_input_chunks_init()
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 2048, 512, 512, 2, 2
    lctx = L.llama_init_from_model(e.model, params)
    try:
        arr = (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        assert M.mtmd_tokenize(e.vision.ctx, chunks, ctypes.byref(text), arr, len(bitmaps)) == 0
        n_prompt = M.mtmd_helper_get_n_tokens(chunks)
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(e.vision.ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        out: list[int] = []
        b, pos = Batch(1), n_past.value
        for _ in range(max_tokens):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(lctx, -1), shape=(e.n_vocab,))
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in e.info.eos_token_ids:
                break
            b.token[0], b.pos[0], b.seq[0], b.logits[0] = tok, pos, 0, 1
            b.struct.n_tokens = 1
            assert L.llama_decode(lctx, b.struct) == 0
            pos += 1
        return n_prompt, out
    finally:
        L.llama_free(lctx)
        M.mtmd_input_chunks_free(chunks)
        for bmp in bitmaps:
            M.mtmd_bitmap_free(bmp)


def test_an_image_takes_max_rows_cols_positions_and_the_projector_says_m_rope(engine):
    assert engine.info.takes_images and engine.info.extra["image_positions"] == "M-RoPE (2D)"
    req = request(engine, parts_of(engine, [f"{MARK}What is this?"], [picture((255, 0, 0), (200, 60))]))
    (chunk,) = req.media
    seq = Sequence(0, list(req.prompt_tokens), req.sampling, media=req.media)
    n_pos = chunk.data.n_pos
    assert chunk.n_tokens > n_pos > 1 and chunk.n_tokens % n_pos == 0  # a wide image: max(nx, ny) = nx columns
    end = len(req.prompt_tokens)
    assert position(seq, chunk.pos) == chunk.pos and position(seq, chunk.end) == chunk.pos + n_pos
    assert position(seq, end) == end - chunk.n_tokens + n_pos
    assert position(seq, chunk.pos + 3) == chunk.pos  # inside: the temporal position every image cell holds
    assert floor(seq, chunk.pos + 3) == chunk.pos and floor(seq, chunk.end) == chunk.end


@pytest.mark.parametrize("where", ["image then question", "question then image", "two images, one wide"])
def test_octo_answers_as_libmtmd_evaluates_the_prompt(engine, where):
    red, blue, wide = picture((220, 30, 30)), picture((20, 40, 230)), picture((30, 160, 60), (160, 60), circle=True)
    turns, images = {
        "image then question": ([f"{MARK}What is in this picture?"], [red]),
        "question then image": ([f"What is in this picture? {MARK}"], [blue]),
        "two images, one wide": ([f"Compare {MARK} and {MARK} please."], [wide, red]),
    }[where]
    parts = parts_of(engine, turns, images)
    n_prompt, expected = reference(engine, parts)
    req = request(engine, parts)
    assert len(req.prompt_tokens) == n_prompt
    assert run(engine, req)[0].token_ids == expected


def test_the_answer_depends_on_the_image(engine):
    outs = {tuple(run(engine, request(engine, parts_of(engine, [f"{MARK}What?"], [picture(c)])))[0].token_ids)
            for c in ((255, 0, 0), (0, 0, 255), (0, 128, 0))}
    assert len(outs) == 3


def test_images_beside_text_streams_answer_as_alone(engine):
    text = request(engine, parts_of(engine, ["Tell me about the harbor and the lighthouse."], []), max_tokens=16)
    a = request(engine, parts_of(engine, [f"{MARK}What is this?"], [picture((0, 128, 0), circle=True)]))
    b = request(engine, parts_of(engine, [f"Two: {MARK} {MARK}"], [picture((9, 9, 200)), picture((200, 9, 9))]))
    alone = [run(engine, r)[0].token_ids for r in (text, a, b)]
    assert [r.token_ids for r in run(engine, text, a, b)] == alone


def test_a_second_turn_reuses_the_images_kv_and_answers_as_fresh(engine):
    pic = picture((0, 0, 255), (120, 60))
    first = parts_of(engine, [f"Look: {MARK}What is this?"], [pic])
    r1 = run(engine, request(engine, first))[0]
    second = parts_of(engine, [f"Look: {MARK}What is this?", r1.text, "And the colour?"], [pic])
    fresh = run(engine, request(engine, second))[0]
    cached = run(engine, request(engine, first), request(engine, second), cache=True)[1]
    n_prompt, expected = reference(engine, second)
    assert cached.cached_tokens > request(engine, second).media[0].end  # through the image, from the cache
    assert fresh.cached_tokens == 0 and cached.token_ids == fresh.token_ids == expected


@pytest.mark.parametrize("entries", ["cells", "snapshots"])
def test_another_question_about_the_same_picture_reuses_only_what_it_shares(engine, gguf, entries):
    """The cache entry holds more than the new prompt shares (the first question and its answer after the image): the
    copy (shared cells: llama_memory_seq_cp) or the cut (a RAM snapshot: llama_memory_seq_rm) goes by position."""
    e = engine
    if entries == "snapshots":
        e = LlamaCppEngine(EngineConfig(max_batch=4, options={"n_threads": 2, "cache_seqs": 0}))
        e.load(gguf, "demo-vision-qwen")
    try:
        pic = picture((0, 90, 160), (100, 60))
        first = parts_of(e, [f"Look: {MARK} What colour is the sky in it?"], [pic])
        other = parts_of(e, [f"Look: {MARK} Where was it taken?"], [pic])
        results = run(e, request(e, first), request(e, other), cache=True)
        assert request(e, other).media[0].end < results[1].cached_tokens < len(request(e, first).prompt_tokens)
        assert results[1].token_ids == reference(e, other)[1]
    finally:
        if e is not engine:
            e.unload()


def test_a_restore_cut_inside_an_image_keeps_the_text_before_it(engine):
    """A prefix that ends inside an M-RoPE image is restored up to the image's start (its cells share one position:
    llama.cpp keeps all or none), and the rest is computed: the same answer."""
    from octo.engine import Feed

    parts = parts_of(engine, [f"Here it is: {MARK} describe it."], [picture((200, 100, 0))])
    expected = run(engine, request(engine, parts))[0].token_ids
    donor_req = request(engine, parts)
    (c,) = donor_req.media
    donor = Sequence(1, list(donor_req.prompt_tokens), donor_req.sampling, media=donor_req.media)
    engine.add_sequence(donor)
    try:
        c.embedding = engine.encode_media(c)
        for feed in (Feed(donor, donor.tokens[:c.pos], False), Feed(donor, donor.tokens[c.pos:c.end], False, media=c),
                     Feed(donor, donor.tokens[c.end:-1], False)):
            engine.step([feed])
        handle = engine.kv_save(donor)
    finally:
        engine.remove_sequence(donor)
    again = request(engine, parts)
    seq = Sequence(2, list(again.prompt_tokens), again.sampling, media=again.media)
    engine.add_sequence(seq)
    try:
        engine.kv_restore(seq, handle, c.pos + 5)  # inside the image
        assert seq.n_cached == c.pos
        seq.media[0].embedding = engine.encode_media(seq.media[0])
        engine.step([Feed(seq, seq.tokens[c.pos:c.end], False, media=seq.media[0])])
        out = engine.step([Feed(seq, seq.tokens[c.end:], True)])
    finally:
        engine.remove_sequence(seq)
        engine.kv_free(handle)
    assert out[0] == expected[0]


def test_sequences_sharing_an_image_in_flight_answer_as_alone(engine):
    """Two requests for the same long prompt with an image, sent together: the second joins the first's KV (in-flight
    sharing copies cells by position) and both answer as alone."""
    story = " ".join(["The old lighthouse stood at the edge of the harbor."] * 6)
    parts = parts_of(engine, [f"{story} {MARK} What is in it?"], [picture((90, 10, 200), (100, 60))])
    alone = run(engine, request(engine, parts))[0].token_ids
    results = run(engine, request(engine, parts), request(engine, parts, max_tokens=6))
    assert results[0].token_ids == alone and results[1].token_ids == alone[:6]
    assert results[1].cached_tokens > 0  # it took the first one's prefix
