"""Images on the MLX engine (engines/mlx/vision.py, mlx-vlm) with the synthetic Gemma 3 vision model written by
mlx-vlm's own converter (octo.synth.vision_mlx), driven through the shared scheduler: the prompt cut at the image as
llama.cpp cuts it, greedy output that depends on the image, logits that match mlx-vlm's own generation, a second turn
that reuses the image's KV with the same output, images beside text streams in one batch, and the refusals."""

from __future__ import annotations

import asyncio
import hashlib
import io

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install 'octo[mlx]')")
pytest.importorskip("torch", reason="building the synthetic vision model needs torch (pip install 'octo[synth]')")
pytest.importorskip("sentencepiece", reason="building the synthetic vision model needs sentencepiece")
pytest.importorskip("PIL", reason="Pillow is not installed")

from octo.engines.mlx import MLXEngine, vision  # noqa: E402
from octo.engines.mlx.batch import prefix_view, snapshot_cache, whole  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from octo.engine import EngineConfig, MediaInput, SamplingParams  # noqa: E402
from octo.errors import ConfigError, InvalidRequest  # noqa: E402
from octo.scheduler.admission import Scheduler  # noqa: E402
from octo.scheduler.jobs import GenerationRequest  # noqa: E402
from octo.scheduler.prefix_cache import PrefixCache  # noqa: E402

MARK = "<<image>>"


@pytest.fixture(scope="module")
def folder() -> str:
    from octo.synth.vision_mlx import build_vision_mlx

    return str(build_vision_mlx("demo-vision"))


@pytest.fixture(scope="module")
def engine(folder):
    e = MLXEngine(EngineConfig(max_batch=4))
    e.load(folder, "demo-vision")
    yield e
    e.unload()


def picture(color: tuple[int, int, int], circle: bool = False) -> MediaInput:
    img = Image.new("RGB", (80, 60), color)
    if circle:
        ImageDraw.Draw(img).ellipse((10, 10, 50, 50), fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return MediaInput("image", hashlib.sha256(buf.getvalue()).hexdigest(), img.tobytes(), img.width, img.height)


def request(e, turns: list[str], images: list[MediaInput], max_tokens: int = 8, **sampling) -> GenerationRequest:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    pieces = e.render_chat(messages).split(MARK)
    parts: list = [pieces[0]]
    for img, rest in zip(images, pieces[1:], strict=True):
        parts += [img, rest]
    tokens, chunks = e.tokenize_media(parts) if images else (e.tokenize(pieces[0]), [])
    logprobs = sampling.pop("logprobs", -1)
    return GenerationRequest(tokens, SamplingParams(**{"temperature": 0.0, **sampling}), max_tokens=max_tokens,
                             media=tuple(chunks), logprobs=logprobs)


def run(e, *reqs: GenerationRequest, cache: PrefixCache | None = None) -> list:
    """The results of requests submitted together to one scheduler."""
    async def go():
        s = Scheduler(e, max_batch=4, cache=cache)
        s.start()
        try:
            return [await t.result for t in [s.submit(r)[0] for r in reqs]]
        finally:
            s.stop()

    return asyncio.run(go())


def test_a_vision_folder_takes_images_placed_as_llama_cpp_places_them(engine):
    assert engine.info.media == frozenset({"image"}) and engine.info.takes_images
    assert engine.info.extra["vision"].startswith("mlx-vlm ") and engine.info.extra["vision_bytes"] > 0
    req = request(engine, [f"{MARK}What is this?"], [picture((255, 0, 0))])
    (chunk,) = req.media
    assert chunk.n_tokens == 16 and chunk.data.shape == (1, 3, 64, 64)  # 64x64 pixels, 8x8 patches pooled 2x2
    toks, special = req.prompt_tokens, engine.special_tokens()
    assert toks[0] == 2 and toks[1] != 2  # one BOS: the template's
    assert toks[chunk.pos - 1] == special["<start_of_image>"] and toks[chunk.end] == special["<end_of_image>"]
    assert all(t < 0 for t in toks[chunk.pos:chunk.end]) and all(t >= 0 for t in toks[chunk.end:])


def test_the_prompt_is_llama_cpps_token_for_token(engine):
    """The same request on the same model's GGUF: the same tokens, the same image positions and placeholders."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.synth.vision import build_vision_gguf

    gguf = LlamaCppEngine(EngineConfig(max_batch=1))
    gguf.load(str(build_vision_gguf("demo-vision")), "demo-vision")
    try:
        pics, turns = [picture((0, 128, 0), circle=True), picture((9, 9, 9))], [f"Look: {MARK}What?", "A ball.",
                                                                                 f"And {MARK}?"]
        ours, theirs = request(engine, turns, pics), request(gguf, turns, pics)
        assert ours.prompt_tokens == theirs.prompt_tokens
        assert [(c.pos, c.n_tokens, c.digest) for c in ours.media] == [(c.pos, c.n_tokens, c.digest)
                                                                       for c in theirs.media]
    finally:
        gguf.unload()


def test_greedy_output_depends_on_the_image(engine):
    pics = [picture((255, 0, 0)), picture((0, 0, 255)), picture((0, 128, 0), circle=True)]
    outs = run(engine, *[request(engine, [f"{MARK}What is this?"], [p]) for p in pics])
    tokens = [tuple(r.token_ids) for r in outs]
    assert len(set(tokens)) == 3, tokens
    again = run(engine, request(engine, [f"{MARK}What is this?"], [pics[0]]))[0]
    assert tuple(again.token_ids) == tokens[0]  # the same image, the same answer


def test_the_logits_match_mlx_vlms_own_generation(engine, folder):
    """octo's first token's logprobs for an image prompt against mlx-vlm's generate_step on the same folder and
    token ids (its own model, processor and prompt cache), and the greedy tokens after them."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load

    pic = picture((30, 30, 200), circle=True)
    req = request(engine, [f"{MARK}What is this?"], [pic], logprobs=5)
    ours = run(engine, req)[0]
    model, processor = load(folder)
    (chunk,) = req.media
    ids = list(req.prompt_tokens)
    ids[chunk.pos:chunk.end] = [vision_image_token(folder)] * chunk.n_tokens
    img = Image.frombytes("RGB", (pic.width, pic.height), pic.data)
    pixels = mx.array(np.asarray(processor.image_processor(images=[img], return_tensors="np")["pixel_values"]))
    steps = generate_step(mx.array([ids]), model, pixels, mx.ones((1, len(ids))), temperature=0.0)
    theirs_tokens, first = [], None
    for _, (tok, lp) in zip(range(len(ours.token_ids)), steps, strict=False):
        theirs_tokens.append(int(tok.item()) if hasattr(tok, "item") else int(tok))
        first = np.array(lp) if first is None else first
    assert ours.token_ids == theirs_tokens
    _, lp, top = ours.logprobs[0]
    best = np.argsort(-first)[:5]
    assert lp == pytest.approx(float(first[best[0]]), abs=2e-4)
    assert [v for _, v in top] == pytest.approx([float(first[i]) for i in best], abs=2e-4)


def vision_image_token(folder: str) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(folder) / "config.json").read_text())["image_token_index"]


def test_a_second_turn_reuses_the_images_kv_and_answers_as_without_the_cache(engine):
    pic = picture((0, 0, 255))
    first = request(engine, [f"Look: {MARK}What is this?"], [pic])

    def turns(answer: str) -> list[str]:
        return [f"Look: {MARK}What is this?", answer, "And the colour?"]

    cache = PrefixCache(64 << 20, engine.kv_free)

    async def go():
        s = Scheduler(engine, max_batch=4, cache=cache)
        s.start()
        try:
            r1 = await s.submit(first)[0].result
            return r1, await s.submit(request(engine, turns(r1.text), [pic]))[0].result
        finally:
            s.stop()

    r1, cached = asyncio.run(go())
    fresh = run(engine, request(engine, turns(r1.text), [pic]))[0]
    assert cached.cached_tokens > first.media[0].end  # the image's positions came from the cache
    assert fresh.cached_tokens == 0 and cached.token_ids == fresh.token_ids
    other = run(engine, request(engine, turns(r1.text), [picture((1, 2, 3))]), cache=cache)[0]
    assert other.cached_tokens <= first.media[0].pos  # another picture shares only the text before it


def test_images_beside_text_streams_answer_as_alone(engine):
    text = request(engine, ["Tell me about the harbor and the old lighthouse."], [], max_tokens=24)
    image = request(engine, [f"{MARK}What is this?"], [picture((0, 128, 0), circle=True)], max_tokens=12)
    image2 = request(engine, [f"Two: {MARK}and {MARK}"], [picture((200, 0, 0)), picture((0, 0, 0))], max_tokens=12)
    alone = [run(engine, r)[0].token_ids for r in (text, image, image2)]
    together = [r.token_ids for r in run(engine, text, image, image2)]
    assert together == alone


def test_penalties_skip_the_images_positions(engine):
    r = request(engine, [f"{MARK}What is this?"], [picture((255, 0, 0))], max_tokens=6, repetition_penalty=1.3,
                presence_penalty=0.5, frequency_penalty=0.5)
    out = run(engine, r)[0]
    plain = run(engine, request(engine, [f"{MARK}What is this?"], [picture((255, 0, 0))], max_tokens=6))[0]
    assert len(out.token_ids) == 6 and len(set(out.token_ids)) > len(set(plain.token_ids))


def test_a_sliding_window_is_cut_only_while_it_holds_every_position():
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=8)
    c.update_and_fetch(mx.ones((1, 1, 6, 4)), mx.ones((1, 1, 6, 4)))
    saved = snapshot_cache([c])
    assert whole([c]) and saved[0].offset == 6
    (view,) = prefix_view(saved, 4)
    view.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    assert view.offset == 5 and saved[0].keys.shape[2] == 6 and mx.all(saved[0].keys == 1).item()  # a copy
    c.update_and_fetch(mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)))  # 9 positions: the first left the window
    assert not whole([c]) and snapshot_cache([c]) is None


def test_vision_off_serves_the_text_model_alone(folder):
    e = MLXEngine(EngineConfig(max_batch=2, options={"vision": "off"}))
    e.load(folder, "demo-vision")
    try:
        assert e.info.media == frozenset() and "vision" not in e.info.extra
        with pytest.raises(InvalidRequest, match="takes no images"):
            e.tokenize_media(["a", picture((1, 2, 3)), "b"])
        out = run(e, request(e, ["Tell me about the harbor."], [], max_tokens=4))[0]
        assert len(out.token_ids) == 4
    finally:
        e.unload()


def test_a_vision_architecture_it_does_not_place_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match="takes images for gemma3 only; -o vision=off"):
        vision.load(tmp_path, {"model_type": "llava", "vision_config": {}}, None, None, None, "auto")
    assert vision.load(tmp_path, {"model_type": "llava", "vision_config": {}}, None, None, None, "off") is None
    assert vision.load(tmp_path, {"model_type": "qwen2"}, None, None, None, "auto") is None  # a text model
    with pytest.raises(ConfigError, match="Option 'vision' must be auto or off"):
        MLXEngine(EngineConfig(options={"vision": "maybe"}))
