"""The speech engines' formats, synthetic conversions (same weights in every format) and request checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
whisper = pytest.importorskip("whisper")
ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("faster_whisper")
pytest.importorskip("pywhispercpp")

from octo.engines.faster_whisper import FasterWhisperEngine  # noqa: E402
from octo.engines.whispercpp import WhisperCppEngine  # noqa: E402

from octo.engine import EngineConfig, TranscriptionRequest  # noqa: E402
from octo.errors import ConfigError, InvalidRequest  # noqa: E402
from octo.models.catalog import load_catalog  # noqa: E402
from octo.models.formats import detect_repo, inspect_path  # noqa: E402
from octo.plugins import engine_registry  # noqa: E402
from octo.synth.speech import build_whisper_ct2, build_whisper_ggml  # noqa: E402
from octo.synth.whisper import build_whisper  # noqa: E402

SHAPE = "test3"


def _mel(seconds: float = 4.0):
    audio = (np.random.default_rng(1).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    return whisper.log_mel_spectrogram(whisper.pad_or_trim(audio), 80)[None]


def test_ct2_conversion_keeps_the_weights():
    """The CTranslate2 float32 folder's encoder matches openai-whisper's on the same mel (within 1e-4)."""
    model = whisper.load_model(str(build_whisper(SHAPE)), device="cpu")
    mel = _mel()
    with torch.no_grad():
        ref = model.encoder(mel).numpy()
    ct2 = ctranslate2.models.Whisper(str(build_whisper_ct2(SHAPE)), device="cpu", compute_type="float32")
    out = np.array(ct2.encode(ctranslate2.StorageView.from_array(mel.numpy()), to_cpu=True))
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() < 1e-4
    # the decoder too: the same first greedy tokens after the same prompt
    prompt = [50258, 50259, 50359, 50363]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
    got = ct2.generate(ctranslate2.StorageView.from_array(ref), [prompt], max_length=8, beam_size=1,
                       suppress_blank=False, suppress_tokens=[], return_scores=False)[0].sequences_ids[0]
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(len(got)):
            logits = model.decoder(tokens, torch.from_numpy(ref))[0, -1]
            tokens = torch.cat([tokens, logits.argmax().view(1, 1)], 1)
    assert got == tokens[0, len(prompt):].tolist()


def test_ggml_file_follows_whisper_cpp_layout():
    """Header, mel filters, vocabulary and tensors as whisper.cpp reads them; the f32 file holds the same values."""
    ckpt = torch.load(build_whisper(SHAPE), map_location="cpu", weights_only=True)
    path = build_whisper_ggml(SHAPE, ftype="f32")
    data = path.read_bytes()
    magic, *hp = struct.unpack("<12i", data[:48])
    assert magic == 0x67676D6C and hp[:10] == [ckpt["dims"][k] for k in (
        "n_vocab", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer", "n_text_ctx", "n_text_state",
        "n_text_head", "n_text_layer", "n_mels")] and hp[10] == 0
    off = 48
    rows, cols = struct.unpack("<ii", data[off:off + 8])
    off += 8 + 4 * rows * cols
    (n_tokens,) = struct.unpack("<i", data[off:off + 4])
    off += 4
    for _ in range(n_tokens):
        off += 4 + struct.unpack("<i", data[off:off + 4])[0]
    seen = 0
    while off < len(data):
        n_dims, n_name, ftype = struct.unpack("<iii", data[off:off + 12])
        off += 12
        shape = struct.unpack(f"<{n_dims}i", data[off:off + 4 * n_dims])[::-1]
        off += 4 * n_dims
        name = data[off:off + n_name].decode()
        off += n_name
        size = int(np.prod(shape)) * 4
        value = np.frombuffer(data[off:off + size], "<f4").reshape(shape)
        off += size
        ref = ckpt["model_state_dict"][name].float().numpy()
        assert ftype == 0 and np.array_equal(value.reshape(ref.shape), ref), name
        seen += 1
    assert seen == len(ckpt["model_state_dict"])
    assert inspect_path(path)[:2] == ("ggml", "transcription")
    assert inspect_path(build_whisper_ct2(SHAPE))[:2] == ("ct2", "transcription")


def test_engines_registered_with_their_formats():
    reg = engine_registry()
    assert reg["faster-whisper"] is FasterWhisperEngine and reg["whispercpp"] is WhisperCppEngine
    assert FasterWhisperEngine.detect().available and WhisperCppEngine.detect().available
    assert FasterWhisperEngine.artifact_format(str(build_whisper_ct2(SHAPE))) == "ct2"
    assert WhisperCppEngine.artifact_format(str(build_whisper_ggml(SHAPE))) == "ggml"
    assert FasterWhisperEngine.artifact_format(str(build_whisper(SHAPE))) is None


def test_catalog_variants_for_every_speech_engine():
    formats = {c.name: c.formats for c in engine_registry().values()}
    r = load_catalog().resolve("whisper-base", formats)
    assert r.task == "transcription" and r.name == "whisper-base"
    assert r.artifacts["faster-whisper"].uri == "hf://Systran/faster-whisper-base"
    assert r.artifacts["faster-whisper"].format == "ct2"
    assert r.artifacts["whispercpp"].uri == "hf://ggerganov/whisper.cpp/ggml-base.bin"
    assert r.artifacts["whisper"].format == "whisper"


def test_hub_repositories_by_files():
    files = ["README.md", "config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    assert detect_repo("Systran/faster-whisper-small", files, None)["ct2"]["uri"] == "hf://Systran/faster-whisper-small"
    ggml = ["ggml-base.bin", "ggml-base-q5_1.bin", "ggml-base-encoder.mlmodelc.zip"]
    assert detect_repo("x/whisper-ggml", ggml, "q5_1")["ggml"]["uri"] == "hf://x/whisper-ggml/ggml-base-q5_1.bin"


@pytest.mark.parametrize("cls", [FasterWhisperEngine, WhisperCppEngine])
def test_options_and_requests_are_checked(cls):
    with pytest.raises(ConfigError, match="Unknown option 'nope'"):
        cls(EngineConfig(options={"nope": "1"}))
    with pytest.raises(ConfigError, match="beam_size"):
        cls(EngineConfig(options={"beam_size": "0"}))
    engine = cls(EngineConfig(options={"max_new_tokens": "4", "temperature_increment": "0"}))
    path = build_whisper_ct2(SHAPE) if cls is FasterWhisperEngine else build_whisper_ggml(SHAPE)
    engine.load(str(path), "t")
    audio = np.zeros(16000, np.float32)
    with pytest.raises(InvalidRequest, match="Language 'klingon'"):
        engine.transcribe(TranscriptionRequest(audio=audio, language="klingon"))
    r = engine.transcribe(TranscriptionRequest(audio=audio, language="english", task="translate"))
    assert r.language == "en" and r.duration == 1.0
    results = engine.transcribe_batch([TranscriptionRequest(audio=audio, task="bogus"),
                                       TranscriptionRequest(audio=audio, language="en")])
    assert isinstance(results[0], InvalidRequest) and results[1].duration == 1.0


def test_faster_whisper_offers_its_thread_counts_and_switches_them(monkeypatch):
    """Threads are measured unless set: all cores first, then one; a switch reloads the model on that count and
    it transcribes the same (greedy, same weights); ``-o threads`` fixes the count."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    engine = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6", "temperature_increment": "0"}))
    engine.load(str(build_whisper_ct2(SHAPE)), "t")
    assert engine.thread_counts() == [4, 1] and engine.info.extra["threads"] == 4
    audio = (np.random.default_rng(3).standard_normal(16000) * 0.1).astype(np.float32)
    before = engine.transcribe(TranscriptionRequest(audio=audio, language="en")).text
    old = engine.model
    engine.set_threads(1)
    assert engine.model is not old and engine.model.model.num_active_batches == 0
    assert engine.info.extra["threads"] == 1 and engine.thread_counts() == [1, 4]
    assert engine.info.extra["encoder_threads"] == 4  # its encoder on a copy on all cores (SplitModel)
    assert engine.transcribe(TranscriptionRequest(audio=audio, language="en")).text == before
    same = engine.model
    engine.set_threads(1)  # the count it has: no reload
    assert engine.model is same
    fixed = FasterWhisperEngine(EngineConfig(options={"threads": "2"}))
    fixed.load(str(build_whisper_ct2(SHAPE)), "t")
    assert fixed.thread_counts() == [] and fixed.info.extra["threads"] == 2


def test_faster_whisper_encodes_on_all_cores_where_its_decoder_runs_on_fewer(monkeypatch):
    """On fewer threads than cores the decoder's model gets a second copy for the encoder on all cores: every
    encode goes there (single requests and batches), every decode to the decoder's model, and the transcript is
    the one-model transcript. ``-o encoder_threads`` sets the count (equal to ``threads``: one copy); a model.bin
    past ``SPLIT_MAX_BYTES`` keeps one copy (its weights would double)."""
    import os

    import octo.engines.faster_whisper as fw

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    path = str(build_whisper_ct2(SHAPE))
    opts = {"max_new_tokens": "6", "temperature_increment": "0", "threads": "1"}
    audio = (np.random.default_rng(3).standard_normal(16000) * 0.1).astype(np.float32)
    one = FasterWhisperEngine(EngineConfig(options={**opts, "encoder_threads": "1"}))
    one.load(path, "t")
    assert one.info.extra["encoder_threads"] == 1 and not isinstance(one.model.model, fw.SplitModel)
    split = FasterWhisperEngine(EngineConfig(options=opts))
    split.load(path, "t")
    ct2 = split.model.model
    assert isinstance(ct2, fw.SplitModel) and split.info.extra["encoder_threads"] == 4
    assert ct2.encoder is not ct2.decoder and ct2.is_multilingual == ct2.decoder.is_multilingual

    calls = []

    class Spy:
        def __init__(self, model, kind):
            self.model, self.kind = model, kind

        def __getattr__(self, name):
            if name in ("encode", "generate"):
                calls.append((self.kind, name))
            return getattr(self.model, name)

    ct2.encoder, ct2.decoder = Spy(ct2.encoder, "encoder"), Spy(ct2.decoder, "decoder")
    want = one.transcribe(TranscriptionRequest(audio=audio, language="en"))
    assert split.transcribe(TranscriptionRequest(audio=audio, language="en")).text == want.text
    assert ("encoder", "encode") in calls and ("decoder", "generate") in calls
    assert ("decoder", "encode") not in calls and ("encoder", "generate") not in calls
    calls.clear()
    batch = split.transcribe_batch([TranscriptionRequest(audio=audio, language="en") for _ in range(2)])
    assert [r.text for r in batch] == [want.text] * 2
    assert calls.count(("encoder", "encode")) == 1 and ("decoder", "encode") not in calls  # one batched encode
    monkeypatch.setattr(fw, "SPLIT_MAX_BYTES", 1000)
    big = FasterWhisperEngine(EngineConfig(options=opts))
    big.load(path, "t")
    assert big.info.extra["encoder_threads"] == 1 and not isinstance(big.model.model, fw.SplitModel)


def _probe_env(monkeypatch, tmp_path, cores=4):
    import os

    from octo import benchload

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(benchload, "quiet_now", lambda window=0.2: True)
    monkeypatch.setattr(benchload, "LoadMonitor", Monitor)


class Monitor:
    """A load monitor that saw what ``disturbed`` says (a test's verdict must not depend on the host's load)."""

    disturbed = False

    def start(self):
        return self

    def stop(self):
        return {"disturbed": self.disturbed}


def test_faster_whisper_measures_its_thread_counts_while_idle_and_caches_the_verdict(monkeypatch, tmp_path):
    """A model no start-up benchmark measured serves on all cores at once; its idle-time probe times the other count
    beside it and switches only to a clear winner (the copy it measured: no reload), caches the verdict, and the
    next load serves on it with no probe. A start-up benchmark's ``set_threads`` makes the probe moot."""
    import octo.engines.faster_whisper.tuning as tuning

    _probe_env(monkeypatch, tmp_path)
    speed = {4: 2.0, 1: 1.0}
    monkeypatch.setattr(tuning, "measure", lambda model, interrupted: speed[threads_of(model)])
    path = str(build_whisper_ct2(SHAPE))
    engine = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    engine.load(path, "t")
    assert engine.info.extra["threads"] == 4 and engine.probe is not None
    serving = engine.model
    assert engine.idle_work(lambda: False) is None and engine.probe is None
    assert engine.info.extra["threads"] == 1 and engine.model is not serving
    assert engine.info.extra["threads_chosen_by"] == "idle probe"
    record = tuning.read_record(engine)
    assert record["threads"] == 1 and record["seconds"] == {"4": 2.0, "1": 1.0}
    again = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    again.load(path, "t")
    assert again.info.extra["threads"] == 1 and again.probe is None
    assert again.info.extra["threads_chosen_by"] == "cached idle probe"
    chosen = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6", "compute_type": "float32"}))
    chosen.load(path, "t")  # other settings: their own verdict (none yet)
    assert chosen.probe is not None
    chosen.set_threads(4)
    assert chosen.probe is None and chosen.idle_work(lambda: False) is None


def threads_of(model) -> int:
    ct2 = model.model
    return 1 if hasattr(ct2, "encoder_threads") else 4  # (4 cores: the one-thread decoder has its encoder copy)


def test_faster_whisper_thread_probe_keeps_serving_when_interrupted_disturbed_or_close(monkeypatch, tmp_path):
    """A waiting request stops the probe with the serving model untouched (tried again at the next idle moment); a
    disturbed measurement is not followed and not repeated before its retry time (recorded for later starts); a
    challenger within the margin does not serve (the verdict stays the current count)."""
    import octo.engines.faster_whisper.tuning as tuning

    _probe_env(monkeypatch, tmp_path)
    path = str(build_whisper_ct2(SHAPE))
    engine = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    engine.load(path, "t")
    serving = engine.model
    asked = []
    assert engine.idle_work(lambda: asked.append(1) or len(asked) > 2) == tuning.INTERRUPTED_RETRY_S
    assert engine.model is serving and engine.probe is not None and tuning.read_record(engine) is None

    monkeypatch.setattr(Monitor, "disturbed", True)
    monkeypatch.setattr(tuning, "measure", lambda model, interrupted: {4: 2.0, 1: 1.0}[threads_of(model)])
    wait = engine.idle_work(lambda: False)
    assert wait > 500 and engine.model is serving and engine.info.extra["threads"] == 4
    assert tuning.read_record(engine)["pending"] and tuning.read_record(engine)["attempts"] == 1
    later = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    later.load(path, "t")  # a later start: the disturbed try's retry time holds
    assert later.idle_work(lambda: False) > 500 and later.info.extra["threads"] == 4

    monkeypatch.setattr(Monitor, "disturbed", False)
    monkeypatch.setenv("OCTO_HOME", str(tmp_path / "other"))
    close = FasterWhisperEngine(EngineConfig(options={"max_new_tokens": "6"}))
    close.load(path, "t")
    monkeypatch.setattr(tuning, "measure", lambda model, interrupted: {4: 1.0, 1: 0.95}[threads_of(model)])
    assert close.idle_work(lambda: False) is None
    assert close.info.extra["threads"] == 4 and tuning.read_record(close)["threads"] == 4


def test_faster_whisper_thread_probe_measures_equal_work(monkeypatch, tmp_path):
    """The probe's work on a real model: an encode and PROBE_TOKENS decoded tokens (end-of-text suppressed), timed."""
    import octo.engines.faster_whisper.tuning as tuning

    _probe_env(monkeypatch, tmp_path)
    engine = FasterWhisperEngine(EngineConfig(options={}))
    engine.load(str(build_whisper_ct2(SHAPE)), "t")
    generated = []
    real_generate = type(engine.model.model).generate

    class Counting:
        def __init__(self, ct2):
            self.ct2 = ct2

        def __getattr__(self, name):
            return getattr(self.ct2, name)

        def generate(self, *args, **kwargs):
            out = real_generate(self.ct2, *args, **kwargs)
            generated.append(len(out[0].sequences_ids[0]))
            return out

    engine.model.model = Counting(engine.model.model)
    seconds = tuning.measure(engine.model, lambda: False)
    assert seconds > 0 and len(generated) == 2 and generated[-1] == tuning.PROBE_TOKENS  # (the first: untimed)
    with pytest.raises(tuning.Interrupted):
        tuning.measure(engine.model, lambda: True)
