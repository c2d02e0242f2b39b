"""The steady synthetic Whisper: every speech engine decodes the same tokens, so engines compare at equal work.

Also OpenAI's per-window token budget on every engine (``max_new_tokens``, default ``n_text_ctx // 2``):
CTranslate2 halves the ``max_length`` faster-whisper hands it, and whisper.cpp fails a window that reaches its
own cap unless ``max_tokens`` is set.
"""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("whisper")

from octo.engines.faster_whisper import ct2_max_new_tokens  # noqa: E402
from octo.engines.whispercpp import window_budget  # noqa: E402

from octo.engine import EngineConfig, TranscriptionRequest  # noqa: E402
from octo.synth.speech import build_whisper_ct2, build_whisper_ggml  # noqa: E402
from octo.synth.whisper import (  # noqa: E402
    SHAPES,
    STEADY_LENGTH,
    build_whisper,
    steady_tokens,
    steady_transcript,
)

SHAPE = "test3"  # a 3-layer decoder: whisper.cpp takes 2 layers for a distilled model (no timestamps)
DIMS = SHAPES[SHAPE]
EOT, TIMESTAMP_BEGIN = 50257, 50364
BUILD = {"whisper": build_whisper, "faster-whisper": build_whisper_ct2, "whispercpp": build_whisper_ggml}
NEEDS = {"whisper": "whisper", "faster-whisper": "faster_whisper", "whispercpp": "pywhispercpp"}
ENGINES = [pytest.param(e, marks=pytest.mark.skipif(importlib.util.find_spec(m) is None, reason=f"{m} missing"))
           for e, m in NEEDS.items()]


def expected() -> list[int]:
    return steady_transcript(DIMS["n_vocab"], DIMS["n_text_ctx"])


def test_the_steady_weights_point_each_position_at_its_token():
    """Read back from the checkpoint alone: the token whose embedding the positional embedding of ``p`` points at
    is ``steady_tokens[p]``; the transcript is <|0.00|>, distinct words, then <|endoftext|>; the encoder is the
    plain model's (same seed), the decoder blocks' output projections are small."""
    steady = torch.load(build_whisper(SHAPE, steady=True), map_location="cpu", weights_only=True)["model_state_dict"]
    plain = torch.load(build_whisper(SHAPE), map_location="cpu", weights_only=True)["model_state_dict"]
    emb = steady["decoder.token_embedding.weight"].float()
    pos = steady["decoder.positional_embedding"].float()
    read = (pos @ emb.T).argmax(-1).tolist()
    assert read == steady_tokens(DIMS["n_vocab"], DIMS["n_text_ctx"])
    want = expected()
    assert len(want) == STEADY_LENGTH and want[0] == TIMESTAMP_BEGIN
    assert len(set(want[1:])) == STEADY_LENGTH - 1 and max(want[1:]) < EOT
    assert read[2 + STEADY_LENGTH] == EOT  # after <|startoftranscript|><|lang|><|task|> and the transcript
    for name, value in plain.items():
        if name.startswith("encoder."):
            assert torch.equal(value, steady[name]), name
    out = steady["decoder.blocks.0.mlp.2.weight"].float().abs().mean()
    assert out < 0.05 * plain["decoder.blocks.0.mlp.2.weight"].float().abs().mean()


@pytest.fixture(scope="module")
def spoken(tmp_path_factory):
    from octo.synth.whisper import speech

    return speech("The steady model decodes the same words whatever it hears. " * 2,
                  tmp_path_factory.mktemp("steady") / "speech.wav")


@pytest.mark.skipif(shutil.which("ffmpeg") is None or shutil.which("espeak-ng") is None,
                    reason="espeak-ng speaks the clip, ffmpeg decodes the upload")
@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_decodes_the_steady_transcript_through_octo(engine, spoken):
    """``octo serve`` with each engine, the official SDK with default settings: the same tokens and text on every
    engine, one window, greedy at temperature 0 with no fallback (log-probability ~0, ratio < 2.4)."""
    pytest.importorskip("openai")
    from serverproc import run_octo
    from whisper.tokenizer import get_tokenizer

    with run_octo(str(BUILD[engine](SHAPE, steady=True)), "--engine", engine) as server:
        r = server.openai().audio.transcriptions.create(model="whisper-1", file=spoken.open("rb"),
                                                         response_format="verbose_json")
    want = expected()
    assert [s.tokens for s in r.segments] == [want]
    assert r.text.strip() == get_tokenizer(True).decode(want[1:]).strip()
    seg = r.segments[0]
    assert seg.temperature == 0.0 and seg.avg_logprob > -0.01 and seg.compression_ratio < 2.4, seg


def _engine(engine: str, **options: str):
    from octo.plugins import engine_registry

    e = engine_registry()[engine](EngineConfig(options=dict(options, threads="1")))
    e.load(str(BUILD[engine](SHAPE, steady=True)), "steady")
    return e


def _tokens(engine, seconds: float = 12.0) -> list[list[int]]:
    audio = (np.random.default_rng(0).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    return [s.tokens for s in engine.transcribe(TranscriptionRequest(audio=audio, language="en")).segments]


@pytest.mark.parametrize("engine", ENGINES[:2])
def test_a_window_decodes_max_new_tokens_as_openai_does(engine):
    """``max_new_tokens`` N: N sampled tokens in the window, on openai-whisper and on faster-whisper (where
    CTranslate2 stopped at N/2 + 1 before: it halves the max_length faster-whisper passes)."""
    assert _tokens(_engine(engine, max_new_tokens="150")) == [expected()[:150]]


def test_faster_whisper_token_budget_arithmetic():
    """CTranslate2 decodes min(T // 2, T - (prompt - 1)) for T = prompt + max_new_tokens; the engine's value makes
    that OpenAI's min(N, n_text_ctx + 1 - prompt)."""
    for n, prompt in [(224, 3), (224, 4), (8, 3), (150, 120), (224, 150), (224, 227), (100, 227)]:
        total = prompt + ct2_max_new_tokens(n, prompt, 448)
        assert total <= 448
        assert min(total // 2, total - (prompt - 1)) == min(n, 448 + 1 - prompt), (n, prompt)


@pytest.mark.skipif(importlib.util.find_spec("pywhispercpp") is None, reason="pywhispercpp missing")
def test_whispercpp_window_budget():
    """whisper.cpp's loop stops at n_text_ctx/2 - 4 = 220 tokens; ``max_tokens`` = N - 1 ends a window after N
    (closing it with a timestamp: whisper.cpp's rule), below that cap."""
    assert window_budget(None, 448) == (220, 219)
    assert window_budget(224, 448) == (220, 219)
    assert window_budget(8, 448) == (8, 7)
    first = _tokens(_engine("whispercpp", max_new_tokens="150"))[0]
    assert len(first) == 150 and first[:149] == expected()[:149] and first[149] > TIMESTAMP_BEGIN
