"""The whisper engine on synthetic checkpoints: loading, options, parity with whisper.transcribe, batching."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
whisper = pytest.importorskip("whisper")

from octo.engines.whisper import WhisperEngine, WhisperSegment  # noqa: E402

from octo.engine import EngineConfig, Task, TranscriptionRequest  # noqa: E402
from octo.errors import ConfigError, InvalidRequest  # noqa: E402
from octo.synth.whisper import SHAPES, build_whisper, build_whisper_hf, speech  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("ffmpeg") is None,
    reason="espeak-ng and ffmpeg are needed (installed by .ci/run)",
)

MAX_NEW = 12  # random weights babble: bound every 30-second window
OPTS = {"max_new_tokens": str(MAX_NEW), "temperature_increment": "0"}  # greedy only: deterministic


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    texts = {
        "hello": "Hello world. This is a test of the speech transcription service.",
        "numbers": "One two three four five six seven.",
        "weather": "The weather today is sunny with a light breeze.",
    }
    out = {k: whisper.load_audio(str(speech(t, d / f"{k}.wav"))) for k, t in texts.items()}
    out["french"] = whisper.load_audio(
        str(speech("Bonjour tout le monde, comment allez-vous?", d / "fr.wav", voice="fr"))
    )
    return out


@pytest.fixture(scope="module")
def ckpt():
    return build_whisper("test")


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = WhisperEngine(EngineConfig(options=dict(OPTS)))
    eng.load(str(ckpt), "whisper-test")
    return eng


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return whisper.load_model(str(ckpt), device="cpu")


def reference(model, audio, **kw):
    return whisper.transcribe(model, audio, fp16=False, sample_len=MAX_NEW, temperature=0.0, **kw)


def same(result, ref) -> None:
    assert result.text == ref["text"]
    assert [(s.start, s.end, s.text, s.tokens) for s in result.segments] == [
        (s["start"], s["end"], s["text"], s["tokens"]) for s in ref["segments"]
    ]


# -- checkpoints and loading -------------------------------------------------------------------------
def test_synthetic_checkpoint_is_whisper_format(ckpt):
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert set(data) == {"dims", "model_state_dict"}
    assert data["dims"] == SHAPES["test"]
    assert all(t.dtype == torch.float16 for t in data["model_state_dict"].values())
    model = whisper.load_model(str(ckpt), device="cpu")  # openai-whisper's own loader reads it
    assert model.is_multilingual and model.dims.n_mels == 80


def test_real_tiny_shape(tmp_path):
    path = build_whisper("tiny.en", out=tmp_path / "tiny.en.pt")
    model = whisper.load_model(str(path), device="cpu")
    assert not model.is_multilingual
    n = sum(p.numel() for p in model.parameters())
    assert 37_000_000 < n < 38_000_000  # whisper tiny.en: 37.8 M parameters (the "39 M" of the paper's table)


def test_artifact_format(ckpt, tmp_path):
    assert WhisperEngine.artifact_format(str(ckpt)) == "whisper"
    other = tmp_path / "other.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, other)
    assert WhisperEngine.artifact_format(str(other)) is None
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    assert WhisperEngine.artifact_format(str(text)) is None
    assert WhisperEngine.artifact_format(str(tmp_path / "missing.pt")) is None
    assert WhisperEngine.artifact_format(str(build_whisper_hf("test"))) == "whisper"
    assert WhisperEngine.artifact_format(str(tmp_path)) is None


def test_detect_and_info(engine):
    assert WhisperEngine.detect().available
    assert WhisperEngine.tasks == {Task.TRANSCRIPTION} and WhisperEngine.formats == {"whisper"}
    info = engine.info
    assert info.name == "whisper-test" and info.n_ctx == 448 and info.n_vocab == 51865
    assert info.extra["max_new_tokens"] == MAX_NEW and info.extra["device"] == "cpu"


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"bogus": "1"}, "Unknown option 'bogus'"),
        ({"beam_size": "zero"}, "beam_size"),
        ({"max_new_tokens": "0"}, "max_new_tokens"),
        ({"fp16": "maybe"}, "fp16"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        WhisperEngine(EngineConfig(options=options))


def test_fp16_on_cpu_is_refused(ckpt):
    with pytest.raises(ConfigError, match="fp16"):
        WhisperEngine(EngineConfig(options={"fp16": "true", "device": "cpu"})).load(str(ckpt), "x")


def test_not_a_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x04junk")
    with pytest.raises(ConfigError, match="not a whisper checkpoint"):
        WhisperEngine(EngineConfig()).load(str(bad), "x")


# -- transcription -------------------------------------------------------------------------------------
def test_matches_whisper_transcribe(engine, ref_model, clips):
    """One request follows whisper.transcribe exactly: language detection, windows, segments, tokens."""
    result = engine.transcribe(TranscriptionRequest(audio=clips["hello"]))
    ref = reference(ref_model, clips["hello"])
    same(result, ref)
    assert result.language == ref["language"]
    assert result.duration == pytest.approx(len(clips["hello"]) / 16000)
    assert all(isinstance(s, WhisperSegment) for s in result.segments)


def test_matches_whisper_with_language_prompt_and_translate(engine, ref_model, clips):
    audio = clips["numbers"]
    got = engine.transcribe(TranscriptionRequest(audio=audio, language="English", prompt="Counting:"))
    same(got, reference(ref_model, audio, language="en", initial_prompt="Counting:"))
    assert got.language == "en"
    got = engine.transcribe(TranscriptionRequest(audio=clips["french"], task="translate", language="fr"))
    same(got, reference(ref_model, clips["french"], language="fr", task="translate"))


def test_word_timestamps_match_whisper(engine, ref_model, clips):
    got = engine.transcribe(TranscriptionRequest(audio=clips["weather"], language="en", word_timestamps=True))
    ref = reference(ref_model, clips["weather"], language="en", word_timestamps=True)
    same(got, ref)
    words = [w for s in got.segments for w in (s.words or [])]
    ref_words = [w for s in ref["segments"] for w in s.get("words", [])]
    assert words and [(w["word"], w["start"], w["end"]) for w in words] == [
        (w["word"], w["start"], w["end"]) for w in ref_words
    ]


def test_batch_equals_one_at_a_time(engine, clips):
    """Concurrent requests batched together do not leak into each other: each gets its own answer."""
    reqs = [
        TranscriptionRequest(audio=clips["hello"]),
        TranscriptionRequest(audio=clips["numbers"], language="en"),
        TranscriptionRequest(audio=clips["weather"], prompt="Forecast."),
        TranscriptionRequest(audio=clips["french"], task="translate"),
        TranscriptionRequest(audio=clips["hello"][: 16000 * 2], language="en"),
        TranscriptionRequest(audio=np.zeros(16000, np.float32), language="en"),
    ]
    alone = [engine.transcribe(r) for r in reqs]
    batched = engine.transcribe_batch(reqs)
    for a, b in zip(alone, batched, strict=True):
        assert (b.text, b.language, [(s.start, s.end, s.text) for s in b.segments]) == (
            a.text,
            a.language,
            [(s.start, s.end, s.text) for s in a.segments],
        )
    # different audio, different outputs: a batch that mixed rows up could not pass the check above
    assert len({tuple(tuple(s.tokens) for s in r.segments) for r in batched[:4]}) == 4


def test_long_audio_uses_several_windows(engine, ref_model, clips):
    audio = np.concatenate([clips["hello"]] * 10)  # ~40 s: two 30-second windows at least
    got = engine.transcribe(TranscriptionRequest(audio=audio, language="en"))
    same(got, reference(ref_model, audio, language="en"))
    assert max(s.end for s in got.segments) > 30.0


def test_bad_request_fails_alone_in_a_batch(engine, clips):
    out = engine.transcribe_batch(
        [
            TranscriptionRequest(audio=clips["hello"], language="klingon"),
            TranscriptionRequest(audio=clips["hello"], language="en"),
        ]
    )
    assert isinstance(out[0], InvalidRequest) and out[0].param == "language"
    assert out[1].language == "en" and out[1].segments
    with pytest.raises(InvalidRequest, match="klingon"):
        engine.transcribe(TranscriptionRequest(audio=clips["hello"], language="klingon"))


def test_english_only_model(tmp_path, clips):
    eng = WhisperEngine(EngineConfig(options=dict(OPTS)))
    eng.load(str(build_whisper("test.en")), "test.en")
    assert eng.transcribe(TranscriptionRequest(audio=clips["hello"])).language == "en"
    with pytest.raises(InvalidRequest, match="English-only"):
        eng.transcribe(TranscriptionRequest(audio=clips["hello"], task="translate"))
    with pytest.raises(InvalidRequest, match="English-only"):
        eng.transcribe(TranscriptionRequest(audio=clips["hello"], language="fr"))


def test_max_new_tokens_bounds_babble(ckpt, clips):
    eng = WhisperEngine(EngineConfig(options={"max_new_tokens": "3", "temperature_increment": "0"}))
    eng.load(str(ckpt), "x")
    result = eng.transcribe(TranscriptionRequest(audio=clips["hello"], language="en"))
    assert result.segments and all(len(s.tokens) <= 3 for s in result.segments)


def test_temperature_fallback_runs(ckpt, clips):
    """With fallback on, random weights fail the thresholds and later windows use higher temperatures."""
    eng = WhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    eng.load(str(ckpt), "x")
    result = eng.transcribe(TranscriptionRequest(audio=clips["numbers"], language="en"))
    assert any(s.temperature > 0 for s in result.segments)


# -- Hugging Face transformers folders (openai/whisper-* on the hub) ---------------------------------
def test_hf_folder_loads_the_same_model(ckpt, clips):
    folder = build_whisper_hf("test")
    eng = WhisperEngine(EngineConfig(options=dict(OPTS)))
    eng.load(str(folder), "hf")
    ref = whisper.load_model(str(ckpt), device="cpu")
    got = eng.model.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(got[name], value), name
    assert eng.info.extra["alignment_heads"] == "checkpoint"
    audio = clips["hello"]
    assert eng.transcribe(TranscriptionRequest(audio=audio)).text == reference(ref, audio)["text"]


def test_hf_folder_matches_transformers():
    """transformers itself loads the folder with no missing weight and computes the same logits."""
    transformers = pytest.importorskip("transformers")
    folder = build_whisper_hf("test")
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(str(folder), torch_dtype=torch.float32)
    hf.eval()
    eng = WhisperEngine(EngineConfig(options=dict(OPTS)))
    eng.load(str(folder), "hf")
    mel = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[50258, 50259, 50359, 50363, 440, 1002]])
    with torch.no_grad():
        ours = eng.model(mel, tokens)
        theirs = hf(input_features=mel, decoder_input_ids=tokens).logits
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=1e-3)


def test_official_checkpoint_gets_its_alignment_heads(tmp_path, monkeypatch):
    """A file whose SHA-256 is that of an OpenAI checkpoint gets whisper's own alignment heads."""
    import hashlib

    from octo.engines.whisper import official_name

    path = build_whisper("tiny", out=tmp_path / "tiny.pt")  # the real tiny dimensions
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert official_name(path) is None  # not OpenAI's file
    monkeypatch.setitem(whisper._MODELS, "tiny", f"https://example.invalid/models/{digest}/tiny.pt")
    assert official_name(path) == "tiny"
    eng = WhisperEngine(EngineConfig(options=dict(OPTS)))
    eng.load(str(path), "tiny")
    assert eng.info.extra["alignment_heads"] == "official"
    expected = whisper.model.Whisper(eng.model.dims)
    expected.set_alignment_heads(whisper._ALIGNMENT_HEADS["tiny"])
    assert torch.equal(eng.model.alignment_heads.to_dense(), expected.alignment_heads.to_dense())
    assert not torch.equal(
        eng.model.alignment_heads.to_dense(), whisper.model.Whisper(eng.model.dims).alignment_heads.to_dense()
    )


def test_short_request_is_answered_before_a_long_one_ends(engine, clips):
    """on_done reports each request when its own last window is done, not when the whole batch is."""
    long = TranscriptionRequest(audio=np.concatenate([clips["hello"]] * 20), language="en")  # ~90 s
    short = TranscriptionRequest(audio=clips["numbers"], language="en")
    bad = TranscriptionRequest(audio=clips["numbers"], language="xx")
    seen = []
    out = engine.transcribe_batch([long, short, bad], lambda i, r: seen.append((i, r)))
    assert [i for i, _ in seen] == [2, 1, 0]  # the invalid one at once, the short one next, the long one last
    assert all(out[i] is r for i, r in seen)
    assert isinstance(out[2], InvalidRequest) and out[1].text == engine.transcribe(short).text
