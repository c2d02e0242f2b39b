"""Images on the llama.cpp engine (engines/llamacpp/vision.py, libmtmd) with the synthetic Gemma 3 vision model
(octo.synth.vision: a GGUF and its projector written by llama.cpp's own converter), driven through the shared
scheduler: the projector found beside the GGUF, the prompt cut at the image, greedy output that depends on the image,
a second turn that reuses the image's KV with the same output, an image beside a text stream in one batch, and the
projector's errors at load."""

from __future__ import annotations

import asyncio
import hashlib
import io
import shutil

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")
pytest.importorskip("PIL", reason="Pillow is not installed")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from octo.engine import EngineConfig, MediaInput, SamplingParams  # noqa: E402
from octo.errors import ConfigError, InvalidRequest  # noqa: E402
from octo.scheduler.admission import Scheduler  # noqa: E402
from octo.scheduler.jobs import GenerationRequest  # noqa: E402
from octo.scheduler.prefix_cache import PrefixCache  # noqa: E402

MARK = "<<image>>"


@pytest.fixture(scope="module")
def gguf() -> str:
    from octo.synth.vision import build_vision_gguf

    return str(build_vision_gguf("demo-vision"))


@pytest.fixture(scope="module")
def engine(gguf):
    e = LlamaCppEngine(EngineConfig(max_batch=4))
    e.load(gguf, "demo-vision")
    yield e
    e.unload()


def picture(color: tuple[int, int, int], circle: bool = False) -> MediaInput:
    img = Image.new("RGB", (80, 60), color)
    if circle:
        ImageDraw.Draw(img).ellipse((10, 10, 50, 50), fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return MediaInput("image", hashlib.sha256(buf.getvalue()).hexdigest(), img.tobytes(), img.width, img.height)


def request(e, turns: list[str], images: list[MediaInput], max_tokens: int = 8) -> GenerationRequest:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    pieces = e.render_chat(messages).split(MARK)
    parts: list = [pieces[0]]
    for img, rest in zip(images, pieces[1:], strict=True):
        parts += [img, rest]
    tokens, chunks = e.tokenize_media(parts)
    return GenerationRequest(tokens, SamplingParams(temperature=0.0), max_tokens=max_tokens, media=tuple(chunks))


def run(e, *reqs: GenerationRequest) -> list:
    """The results of requests submitted together to one scheduler."""
    async def go():
        s = Scheduler(e, max_batch=4)
        s.start()
        try:
            return [await t.result for t in [s.submit(r)[0] for r in reqs]]
        finally:
            s.stop()

    return asyncio.run(go())


def conversation(e, first: GenerationRequest, turns, pic: MediaInput) -> tuple:
    """A first turn, then the next (built from the first's answer), in one scheduler with a prefix cache."""
    async def go():
        s = Scheduler(e, max_batch=4, cache=PrefixCache(64 << 20, e.kv_free))
        s.start()
        try:
            r1 = await s.submit(first)[0].result
            return r1, await s.submit(request(e, turns(r1.text), [pic]))[0].result
        finally:
            s.stop()

    return asyncio.run(go())


def test_the_projector_beside_the_gguf_makes_the_model_take_images(engine, gguf):
    assert engine.info.media == frozenset({"image"}) and engine.info.takes_images
    assert engine.info.extra["mmproj"].endswith("mmproj-demo-vision-f16.gguf")
    assert engine.info.extra["image_attention"] == "non-causal"  # Gemma 3 reads an image bidirectionally
    req = request(engine, [f"{MARK}What is this?"], [picture((255, 0, 0))])
    (chunk,) = req.media
    assert chunk.n_tokens == 16  # 64x64 pixels, 8x8 patches pooled 2x2
    toks = req.prompt_tokens
    special = engine.special_tokens()
    assert toks[0] == engine.bos and toks[1] != engine.bos  # one BOS: the template's
    assert toks[chunk.pos - 1] == special["<start_of_image>"] and toks[chunk.end] == special["<end_of_image>"]
    assert all(t < 0 for t in toks[chunk.pos:chunk.end]) and all(t >= 0 for t in toks[chunk.end:])


def test_greedy_output_depends_on_the_image(engine):
    pics = [picture((255, 0, 0)), picture((0, 0, 255)), picture((0, 128, 0), circle=True)]
    outs = run(engine, *[request(engine, [f"{MARK}What is this?"], [p]) for p in pics])
    tokens = [tuple(r.token_ids) for r in outs]
    assert len(set(tokens)) == 3, tokens
    again = run(engine, request(engine, [f"{MARK}What is this?"], [pics[0]]))[0]
    assert tuple(again.token_ids) == tokens[0]  # the same image, the same answer


def test_a_second_turn_reuses_the_images_kv_and_answers_as_without_the_cache(engine):
    pic = picture((0, 0, 255))
    first = request(engine, [f"Look: {MARK}What is this?"], [pic])

    def turns(answer: str) -> list[str]:
        return [f"Look: {MARK}What is this?", answer, "And the colour?"]

    r1, cached = conversation(engine, first, turns, pic)
    fresh = run(engine, request(engine, turns(r1.text), [pic]))[0]
    assert cached.cached_tokens > first.media[0].end  # the image's positions came from the cache
    assert fresh.cached_tokens == 0 and cached.token_ids == fresh.token_ids


def test_an_image_beside_a_text_stream_answers_as_alone(engine):
    text = request(engine, ["Tell me about the harbor and the old lighthouse."], [], max_tokens=24)
    image = request(engine, [f"{MARK}What is this?"], [picture((0, 128, 0), circle=True)])
    alone = [run(engine, text)[0].token_ids, run(engine, image)[0].token_ids]
    together = [r.token_ids for r in run(engine, text, image)]
    assert together == alone


def test_without_a_projector_the_model_is_text_only(gguf):
    e = LlamaCppEngine(EngineConfig(max_batch=2, options={"mmproj": "none"}))
    e.load(gguf, "demo-vision")
    try:
        assert e.info.media == frozenset() and "mmproj" not in e.info.extra
        with pytest.raises(InvalidRequest, match="takes no images"):
            e.tokenize_media(["a", picture((1, 2, 3)), "b"])
    finally:
        e.unload()


def test_a_projector_that_does_not_load_fails_the_load_saying_so(gguf, tmp_path):
    bad = LlamaCppEngine(EngineConfig(max_batch=2, options={"mmproj": gguf}))  # the model itself: no projector
    with pytest.raises(ConfigError, match="could not load the projector"):
        bad.load(gguf, "demo-vision")
    model = tmp_path / "m.gguf"
    shutil.copy(gguf, model)
    for name in ("mmproj-a.gguf", "mmproj-b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ConfigError, match="2 projectors beside m.gguf"):
        LlamaCppEngine(EngineConfig(max_batch=2)).load(str(model), "m")


def test_the_memory_guard_counts_the_projector(gguf):
    from pathlib import Path

    from octo.runtime.memguard import gguf_kv_bytes, model_bytes

    model = Path(gguf)
    projector = model.parent / "mmproj-demo-vision-f16.gguf"
    assert model_bytes(model) == model.stat().st_size + gguf_kv_bytes(model) + projector.stat().st_size
