"""The onnx engine driven directly (no server): loading, tokenizer and template, greedy decoding against
onnxruntime-genai's own ``og.Generator`` on the same folder, batches vs alone, joining a running batch,
cancellation, prefix-cache KV reuse, sampling, the generator (batch window) backend, errors.

Uses the tiny synthetic onnxruntime-genai folders (qwen2 architecture, 64 hidden, 2 layers, 4k vocab; int4 and
fp32), built once by onnxruntime-genai's model builder and cached under ``$OCTO_HOME/synth``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'octo[onnx]')")
for _mod in ("torch", "transformers", "onnx_ir"):  # the model builder's imports
    pytest.importorskip(_mod, reason=f"{_mod} is needed by onnxruntime-genai's model builder")

from octo.engines.onnx import OnnxEngine  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import ConfigError, EngineError, InvalidRequest  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and",
    "Numbers can be written in many ways:",
    "def add(a, b):",
    "She opened the letter carefully, read it twice, and then laughed out loud.",
    "In the spring the river rose",
    "Hello",
]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def int4_dir() -> str:
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="int4"))


@pytest.fixture(scope="module")
def fp32_dir() -> str:
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="fp32"))


def make_engine(folder: str, max_batch: int = 4, **options: str) -> OnnxEngine:
    e = OnnxEngine(EngineConfig(max_batch=max_batch, options=dict(options)))
    e.load(folder, "tiny")
    return e


@pytest.fixture(scope="module")
def engine(int4_dir):
    e = make_engine(int4_dir)
    yield e
    e.unload()


def og_greedy(folder: str, prompt: list[int], n: int, **search) -> list[int]:
    """onnxruntime-genai's own generation loop on the same folder."""
    model = og_greedy.models.get(folder) or og_greedy.models.setdefault(folder, og.Model(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n, **search)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, np.int32))
    out = []
    while len(out) < n and not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


og_greedy.models = {}


def generate(engine, prompts: list[list[int]], n: int, sampling=GREEDY, chunk: int = 256,
             join_at: list[int] | None = None, cancel: dict[int, int] | None = None) -> list[list[int]]:
    """Drive ``engine`` the way the scheduler does: one step per iteration over every active sequence (decode
    tokens, then prompt chunks); sequence ``i`` joins at step ``join_at[i]`` and, if ``cancel[i]`` is set, is
    removed once it has that many tokens. Returns the tokens generated per sequence."""
    join_at = join_at or [0] * len(prompts)
    cancel = cancel or {}
    seqs = [Sequence(i, list(p), sampling) for i, p in enumerate(prompts)]
    outs: list[list[int]] = [[] for _ in prompts]
    active: list[Sequence] = []
    step = 0
    while any(len(outs[s.id]) < n and s.id not in cancel or s in active for s in seqs):
        for s in seqs:
            if join_at[s.id] == step:
                engine.add_sequence(s)
                active.append(s)
        feeds = []
        for s in active:
            left = len(s.tokens) - s.n_cached
            take = min(left, chunk if engine.batching == "continuous" else left)
            feeds.append(Feed(s, s.tokens[s.n_cached:s.n_cached + take], take == left))
        if feeds:
            for f, tok in zip(feeds, engine.step(feeds), strict=True):
                if tok is not None:
                    f.seq.tokens.append(tok)
                    outs[f.seq.id].append(tok)
        for s in list(active):
            if len(outs[s.id]) >= (cancel.get(s.id) or n):
                engine.remove_sequence(s)
                active.remove(s)
        step += 1
        assert step < 10_000
    return outs


# -- loading, text ------------------------------------------------------------------------------------------
def test_detect_and_format(int4_dir, tmp_path):
    assert OnnxEngine.detect().available
    assert OnnxEngine.artifact_format(int4_dir) == "onnx"
    assert OnnxEngine.artifact_format(str(Path(int4_dir) / "genai_config.json")) == "onnx"
    assert OnnxEngine.artifact_format(str(tmp_path)) is None
    assert {"onnxruntime", "onnxruntime-genai"} <= set(OnnxEngine.aliases)


def test_model_info(engine, int4_dir):
    cfg = json.loads((Path(int4_dir) / "genai_config.json").read_text())["model"]
    info = engine.info
    assert info.n_ctx == cfg["context_length"] == 2048
    assert info.eos_token_ids == frozenset(cfg["eos_token_id"])
    assert info.n_vocab == 4096
    assert info.extra["batching"] == "continuous:session"
    assert info.extra["precision"] == "int4"
    assert engine.batching == "continuous"


def test_tokenizer_matches_onnxruntime_genai(engine, int4_dir):
    tok = og.Tokenizer(og.Model(int4_dir))
    texts = PROMPTS + ["<|im_start|>user\nHi, café 42!<|im_end|>\n", "  spaces\t\n\n and 你好 🙂"]
    for text in texts:
        assert engine.tokenize(text) == tok.encode(text).tolist(), text
        assert b"".join(engine.token_bytes(t) for t in engine.tokenize(text)).decode() == text.replace(
            "<|im_start|>", "").replace("<|im_end|>", "")
    special = engine.tokenize("<|im_start|>")
    assert len(special) == 1 and engine.token_bytes(special[0]) == b""
    assert len(engine.tokenize("<|im_start|>", special=False)) > 1
    assert engine.token_bytes(10**6) == b""


def test_chat_template(engine):
    text = engine.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not engine.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith(
        "assistant\n")


def test_unknown_option_and_bad_values(int4_dir):
    with pytest.raises(ConfigError, match="Unknown option 'n_threads' for engine onnx"):
        OnnxEngine(EngineConfig(options={"n_threads": "2"}))
    with pytest.raises(ConfigError, match="backend"):
        OnnxEngine(EngineConfig(options={"backend": "gpu"}))
    with pytest.raises(ConfigError, match="exceeds the model's context length"):
        make_engine(int4_dir, n_ctx="100000")


# -- greedy correctness -------------------------------------------------------------------------------------
def test_greedy_equals_og_generator(engine, int4_dir):
    prompts = [engine.tokenize(p) for p in PROMPTS]
    want = [og_greedy(int4_dir, p, 24) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)  # distinct outputs: the comparison can fail
    assert generate(engine, prompts[:1], 24) == want[:1]
    assert [generate(engine, [p], 24)[0] for p in prompts] == want


def test_batch_equals_alone_with_joins_and_chunks(int4_dir):
    engine = make_engine(int4_dir, max_batch=6)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    alone = [generate(engine, [p], 20)[0] for p in prompts]
    assert generate(engine, prompts, 20) == alone
    # sequences join a running batch at different steps, prompts prefilled 3 tokens per step
    assert generate(engine, prompts, 20, chunk=3, join_at=[0, 0, 2, 5, 9, 14]) == alone
    engine.unload()


def test_cancelled_sequence_leaves_the_batch(int4_dir):
    engine = make_engine(int4_dir, max_batch=3)
    prompts = [engine.tokenize(p) for p in PROMPTS[:5]]
    alone = [generate(engine, [p], 16)[0] for p in prompts]
    runs: list[int] = []
    run = engine.backend.runner.run

    def counting_run(row0, n_rows, tokens, lengths, every=False):
        runs.append(n_rows)
        return run(row0, n_rows, tokens, lengths, every)

    engine.backend.runner.run = counting_run
    # 3 rows: sequence 1 is cancelled after 3 tokens and 3 takes its row while 0 and 2 decode on; 4 joins
    # when 0 and 2 are done
    outs = generate(engine, prompts, 16, join_at=[0, 0, 0, 6, 17], cancel={1: 3})
    assert outs[1] == alone[1][:3]
    assert [outs[i] for i in (0, 2, 3, 4)] == [alone[i] for i in (0, 2, 3, 4)]
    # step 0: three prompt passes (1 row each); steps 1-2: 3 rows; step 3, after the cancellation: 2 rows
    assert runs[:6] == [1, 1, 1, 3, 3, 2]
    assert max(runs) == 3 and len(engine.backend.rows) == 0
    engine.unload()


def test_full_engine_refuses_another_sequence(int4_dir):
    engine = make_engine(int4_dir, max_batch=1)
    engine.add_sequence(Sequence(1, [1, 2, 3], GREEDY))
    with pytest.raises(EngineError):
        engine.add_sequence(Sequence(2, [1, 2, 3], GREEDY))
    engine.unload()


def test_fp32_equals_transformers(fp32_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from octo.synth.hf import build_hf

    engine = make_engine(fp32_dir)
    hf = AutoModelForCausalLM.from_pretrained(build_hf("tiny"), dtype=torch.float32)
    for text in PROMPTS[:4]:
        prompt = engine.tokenize(text)
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert generate(engine, [prompt], 16)[0] == ids, text
    engine.unload()


# -- prefix cache -------------------------------------------------------------------------------------------
def test_kv_save_restore_reuses_a_prefix(engine):
    system = engine.tokenize("<|im_start|>system\nYou are a careful assistant. Answer briefly.<|im_end|>\n")
    first = system + engine.tokenize("<|im_start|>user\nTell me about the lighthouse.<|im_end|>\n")
    second = system + engine.tokenize("<|im_start|>user\nAnd the river?<|im_end|>\n")
    want = generate(engine, [second], 12)[0]
    seq = Sequence(1, list(first), GREEDY)
    engine.add_sequence(seq)
    tok = engine.step([Feed(seq, list(first), True)])[0]
    seq.tokens.append(tok)
    handle = engine.kv_save(seq)
    engine.remove_sequence(seq)
    assert handle.tokens == tuple(first) and handle.nbytes == len(first) * engine.backend.runner.bytes_per_token
    # a new sequence sharing only the system prompt restores those positions and prefills the rest
    new = Sequence(2, list(second), GREEDY)
    engine.add_sequence(new)
    engine.kv_restore(new, handle, len(system))
    assert new.n_cached == len(system)
    out = []
    feed = Feed(new, new.tokens[new.n_cached:], True)
    for _ in range(12):
        tok = engine.step([feed])[0]
        new.tokens.append(tok)
        out.append(tok)
        feed = Feed(new, [tok], True)
    engine.remove_sequence(new)
    assert out == want
    engine.kv_free(handle)
    assert handle.data is None
    bad = Sequence(3, engine.tokenize("Something else entirely, longer than that."), GREEDY)
    engine.add_sequence(bad)
    with pytest.raises(ValueError):
        engine.kv_restore(bad, handle, 4)
    engine.remove_sequence(bad)


# -- sampling -----------------------------------------------------------------------------------------------
def test_sampling_seeded_and_filters(engine):
    prompt = [engine.tokenize(PROMPTS[0])]
    greedy = generate(engine, prompt, 16)[0]
    a = generate(engine, prompt, 16, SamplingParams(temperature=1.0, seed=7))[0]
    b = generate(engine, prompt, 16, SamplingParams(temperature=1.0, seed=7))[0]
    c = generate(engine, prompt, 16, SamplingParams(temperature=1.0, seed=8))[0]
    assert a == b and a != c and a != greedy
    assert generate(engine, prompt, 16, SamplingParams(temperature=0.8, top_k=1, seed=3))[0] == greedy
    assert generate(engine, prompt, 16, SamplingParams(temperature=0.8, top_p=1e-6, seed=3))[0] == greedy
    forced = engine.tokenize(" lighthouse")[0]
    biased = generate(engine, prompt, 4, SamplingParams(temperature=1.0, seed=1, logit_bias={forced: 100.0}))
    assert biased[0] == [forced] * 4
    banned = generate(engine, prompt, 16, SamplingParams(temperature=0.0, logit_bias={greedy[0]: -100.0}))
    assert banned[0][0] != greedy[0]
    # seeded sampling is the same alone and inside a batch of other sequences
    others = [engine.tokenize(p) for p in PROMPTS[1:4]]
    assert generate(engine, prompt + others, 16, SamplingParams(temperature=1.0, seed=7))[0] == a


def test_repetition_penalty_equals_og(int4_dir):
    engine = make_engine(int4_dir, penalty_last_n="-1")
    for text in PROMPTS[:3]:
        prompt = engine.tokenize(text)
        want = og_greedy(int4_dir, prompt, 20, repetition_penalty=1.5)
        assert want != og_greedy(int4_dir, prompt, 20)
        assert generate(engine, [prompt], 20, SamplingParams(temperature=0.0, repetition_penalty=1.5))[0] == want
    engine.unload()


def test_invalid_sampling_values(engine):
    for bad in (SamplingParams(temperature=-1), SamplingParams(top_p=1.5), SamplingParams(top_k=-2),
                SamplingParams(repetition_penalty=0.0), SamplingParams(logit_bias={99999: 1.0})):
        with pytest.raises(InvalidRequest):
            engine.add_sequence(Sequence(1, [1, 2], bad))
    assert "grammar" not in engine.sampling_params and "json_schema" not in engine.sampling_params


# -- the og.Generator batch-window backend --------------------------------------------------------------------
def test_generator_backend_windows(int4_dir):
    engine = make_engine(int4_dir, backend="generator")
    assert engine.batching == "window" and engine.info.extra["batching"] == "window:generator"
    prompts = [engine.tokenize(p) for p in PROMPTS[:4]]
    want = [og_greedy(int4_dir, p, 16) for p in prompts]
    assert [generate(engine, [p], 16)[0] for p in prompts] == want
    assert generate(engine, prompts, 16) == want  # one Generator with batch_size=4
    # a cancelled row stays in its Generator until the window ends; the others are unaffected
    outs = generate(engine, prompts, 16, cancel={1: 2})
    assert outs[1] == want[1][:2] and [outs[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert engine.backend.gen is None  # every sequence left: the window (and its Generator) is gone
    seeded = SamplingParams(temperature=1.0, seed=5)
    session = make_engine(int4_dir)
    assert generate(engine, prompts[:2], 12, seeded) == generate(session, prompts[:2], 12, seeded)
    assert engine.kv_save(Sequence(9, [1, 2], GREEDY)) is None
    session.unload()
    engine.unload()


# -- onnxruntime-genai's og.Engine backend -------------------------------------------------------------------
def test_og_engine_backend(int4_dir):
    engine = make_engine(int4_dir, backend="engine")
    assert engine.batching == "continuous" and engine.info.extra["batching"] == "continuous:og.Engine"
    assert "fixed batch" in engine.info.extra["backend"]  # a CPU folder: no paged attention
    prompts = [engine.tokenize(p) for p in PROMPTS[:4]]
    want = [og_greedy(int4_dir, p, 16) for p in prompts]
    assert [generate(engine, [p], 16)[0] for p in prompts] == want
    assert generate(engine, prompts, 16) == want
    assert generate(engine, prompts, 16, chunk=5) == want  # prompts fed in chunks start one whole turn
    # a sequence that joins a running batch waits inside the library (fixed batch on CPU), then runs
    assert generate(engine, prompts[:2], 16, join_at=[0, 3]) == want[:2]
    outs = generate(engine, prompts, 16, cancel={1: 2})
    assert outs[1] == want[1][:2] and [outs[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert not engine.backend.live  # every request was closed
    # the library wants every call from the thread that made its Engine: another thread (the scheduler's, after
    # the start-up benchmark ran in the main one) gets its own
    import threading

    other: list = []
    worker = threading.Thread(target=lambda: other.append(generate(engine, prompts[:1], 8)))
    worker.start()
    worker.join()
    assert other == [[want[0][:8]]]
    sampled = generate(engine, prompts[:2], 12, SamplingParams(temperature=1.5, top_k=50))
    assert sampled != [w[:12] for w in want[:2]] and all(0 <= t < engine.info.n_vocab for o in sampled for t in o)
    assert engine.kv_save(Sequence(9, [1, 2], GREEDY)) is None
    # the library takes a per-turn seed only with paged attention: refused (400 naming it) on this folder
    assert "min_p" not in engine.sampling_params and "seed" not in engine.sampling_params
    engine.unload()


def test_paged_attention_folder_selects_og_engine(int4_dir, tmp_path, monkeypatch):
    import shutil

    from octo.engines.onnx import ogengine

    folder = tmp_path / "paged"
    shutil.copytree(int4_dir, folder)
    assert not ogengine.has_dynamic_batching(folder)
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["engine"] = {"dynamic_batching": {"block_size": 256, "max_batch_size": 8, "num_blocks": 64}}
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    assert ogengine.has_dynamic_batching(folder)
    # this CPU build of the library cannot run paged attention (nor is the copied model paged), so only the
    # routing is checked here: auto picks og.Engine, the one backend that can drive such a folder
    chosen = []

    class Probe(ogengine.EngineBackend):
        def __init__(self, folder, *args):
            chosen.append(folder)
            raise RuntimeError("probe")

    monkeypatch.setattr(ogengine, "EngineBackend", Probe)
    with pytest.raises(RuntimeError, match="probe"):
        make_engine(str(folder))
    assert chosen == [folder]


def test_synthetic_build_is_cached(int4_dir, fp32_dir):
    from octo.synth.onnx import build_onnx

    meta = json.loads((Path(int4_dir) / ".complete").read_text())
    assert meta["shape"] == "tiny" and meta["precision"] == "int4"
    stamp = (Path(int4_dir) / "model.onnx").stat().st_mtime_ns
    assert build_onnx("tiny", precision="int4") == Path(int4_dir)
    assert (Path(int4_dir) / "model.onnx").stat().st_mtime_ns == stamp
    for folder in (int4_dir, fp32_dir):
        names = {p.name for p in Path(folder).iterdir()}
        assert {"genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= names
    assert b"MatMulNBits" in (Path(int4_dir) / "model.onnx").read_bytes()
    assert b"MatMulNBits" not in (Path(fp32_dir) / "model.onnx").read_bytes()
    with pytest.raises(ValueError, match="precision"):
        build_onnx("tiny", precision="int2")


def test_folder_without_shared_kv_buffer_falls_back_to_generator(int4_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(int4_dir, folder)
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["search"]["past_present_share_buffer"] = False
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="shared past/present KV buffer"):
        make_engine(str(folder), backend="session")
    engine = make_engine(str(folder))
    assert engine.batching == "window" and engine.info.extra["batching"] == "window:generator"
    prompt = engine.tokenize(PROMPTS[0])
    assert generate(engine, [prompt], 12)[0] == og_greedy(int4_dir, prompt, 12)
    engine.unload()
    with pytest.raises(ConfigError, match="not an onnxruntime-genai model folder"):
        make_engine(str(tmp_path))
