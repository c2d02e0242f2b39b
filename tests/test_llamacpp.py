"""The llama.cpp engine driven directly (no server): loading, tokenizer and template, batched greedy decoding
against bare llama-cpp-python, sampling, prefix-cache KV reuse, embeddings, errors. Output constraints (masks from
the shared layer) and logprobs: tests/test_llamacpp_logits.py.

Uses the tiny synthetic GGUF (qwen2 architecture, 64 hidden, 2 layers, 4k vocab), built once and cached under
``$OCTO_HOME/synth``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from octo.engines.llamacpp.native import physical_cores  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence, Task  # noqa: E402
from octo.errors import ConfigError, ContextLengthExceeded, InvalidRequest, UnsupportedParameter  # noqa: E402,F401

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and",
    "Numbers can be written in many ways:",
    "def add(a, b):",
    "She opened the letter carefully,",
    "In the spring the river rose",
    "A good engine answers quickly,",
    "Hello",
    "Café, naïve, résumé",
]
SYSTEM = (
    "You are a careful assistant. The old lighthouse stood at the edge of the harbor, and every evening "
    "the keeper climbed the narrow stairs to light the lamp. Answer briefly and never forget the rocks."
)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


@pytest.fixture(scope="module")
def engine(gguf_path):
    e = LlamaCppEngine(EngineConfig(max_batch=8))
    e.load(gguf_path, "tiny")
    yield e
    e.unload()


def generate(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    sampling: list[SamplingParams] | None = None,
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """A minimal continuous-batching loop over Engine.step: prefill every prompt, then decode together."""
    sampling = sampling or [SamplingParams(temperature=0) for _ in prompts]
    seqs = [Sequence(id=i, tokens=list(p), sampling=s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=False))]
    for s in seqs:
        engine.add_sequence(s)
    out: dict[int, list[int]] = {s.id: [] for s in seqs}
    feeds = [Feed(s, s.tokens[s.n_cached :], True) for s in seqs]
    while feeds:
        tokens = engine.step(feeds)
        nxt = []
        for f, t in zip(feeds, tokens, strict=False):
            f.seq.tokens.append(t)
            out[f.seq.id].append(t)
            done = len(out[f.seq.id]) >= max_tokens or (stop_at_eos and t in engine.info.eos_token_ids)
            if not done:
                nxt.append(Feed(f.seq, [t], True))
        feeds = nxt
    for s in seqs:
        engine.remove_sequence(s)
    return [out[s.id] for s in seqs]


def text_of(engine, tokens: list[int]) -> str:
    eos = engine.info.eos_token_ids
    return b"".join(engine.token_bytes(t) for t in tokens if t not in eos).decode("utf-8", "ignore")


# -- discovery, options, loading ------------------------------------------------------------------------------
def test_registered_and_detected():
    from octo.engines import llamacpp

    seen = []
    llamacpp.register_engines(seen.append)
    assert seen == [LlamaCppEngine]
    assert LlamaCppEngine.name == "llamacpp" and LlamaCppEngine.formats == {"gguf"}
    d = LlamaCppEngine.detect()
    assert d.available and llama_cpp.__version__ in d.reason


def test_artifact_format(gguf_path, tmp_path):
    assert LlamaCppEngine.artifact_format(gguf_path) == "gguf"
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert LlamaCppEngine.artifact_format(str(other)) is None
    assert LlamaCppEngine.artifact_format(str(tmp_path / "missing.gguf")) is None


def test_unknown_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="n_tread"):
        LlamaCppEngine(EngineConfig(options={"n_tread": "2"}))
    with pytest.raises(ConfigError, match="n_ctx"):
        LlamaCppEngine(EngineConfig(options={"n_ctx": "lots"}))
    with pytest.raises(ConfigError, match="flash_attn"):
        LlamaCppEngine(EngineConfig(options={"flash_attn": "maybe"}))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_gguf", "missing"])
def test_corrupt_file_is_a_clear_config_error(gguf_path, tmp_path, damage):
    data = Path(gguf_path).read_bytes()
    bad = tmp_path / "bad.gguf"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"GGUF" + os.urandom(4096))
    elif damage == "not_gguf":
        bad.write_bytes(b"PK\x03\x04" + data[4:1000])
    e = LlamaCppEngine(EngineConfig(max_batch=2))
    with pytest.raises(ConfigError) as err:
        e.load(str(bad), "bad")
    assert "bad.gguf" in err.value.message


def test_detect_names_the_backends_without_loading_the_library(tmp_path):
    import subprocess
    import sys
    import types

    from octo.engines.llamacpp import loading

    (tmp_path / "lib").mkdir()
    for name in ("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so.0", "ggml-vulkan.dll", "libllama.so"):
        (tmp_path / "lib" / name).touch()
    assert loading.backends(types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])) == \
        "GPU offload: CUDA, Vulkan"
    (tmp_path / "lib" / "libggml-cuda.so.0").unlink()
    (tmp_path / "lib" / "ggml-vulkan.dll").unlink()
    assert loading.backends(types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])) == "CPU"
    code = ("import sys; from octo.engines.llamacpp import LlamaCppEngine as E; d = E.detect(); "
            "print(d.available, d.reason, 'llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True llama-cpp-python ") and out.strip().endswith("False")


def test_the_end_of_generation_ids_are_those_llama_cpp_names(engine):
    """(scanned in a thread while the context is made: loading.EogScan)"""
    direct = {t for t in range(engine.n_vocab) if engine.lib.llama_vocab_is_eog(engine.vocab, t)}
    assert engine.info.eos_token_ids == direct and len(direct) >= 2


def test_model_info(engine):
    info = engine.info
    assert info.n_ctx == 2048  # qwen2.context_length of the tiny shape
    assert info.n_vocab == 4096
    assert info.tasks == {Task.CHAT, Task.COMPLETION}
    im_end = engine.tokenize("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in info.eos_token_ids
    assert engine.tokenize("<|endoftext|>")[0] in info.eos_token_ids
    assert info.extra["threads"] == physical_cores()
    assert info.extra["file_type"] == "Q8_0"
    assert info.extra["kv_unified"] is True and info.extra["cache_seqs"] == 16
    assert info.extra["n_seq_max"] == 8 + 16  # the batch's sequences, and the prefix cache's shared-cell entries


def test_options_n_ctx_and_threads(gguf_path):
    e = LlamaCppEngine(EngineConfig(max_batch=2, options={"n_ctx": "512", "n_threads": "1"}))
    info = e.load(gguf_path, "tiny")
    try:
        assert info.n_ctx == 512 and info.extra["threads"] == 1
        with pytest.raises(ContextLengthExceeded, match="512"):
            e.add_sequence(Sequence(id=1, tokens=[300] * 600, sampling=SamplingParams(temperature=0)))
        # the refused prompt left no slot behind: both slots are still usable
        out = generate(e, [e.tokenize(PROMPTS[0]), e.tokenize(PROMPTS[1])], 4)
        assert all(len(o) >= 1 for o in out)
    finally:
        e.unload()


def test_full_kv_pool_refuses_new_sequences_with_503(gguf_path):
    from octo.errors import Overloaded

    e = LlamaCppEngine(EngineConfig(max_batch=2, options={"n_ctx": "256", "kv_cells": "256"}))
    assert e.load(gguf_path, "tiny").extra["kv_cells"] == 256
    try:
        a = Sequence(id=1, tokens=[300 + i % 50 for i in range(200)], sampling=SamplingParams(temperature=0))
        e.add_sequence(a)
        e.step([Feed(a, list(a.tokens), True)])
        b = Sequence(id=2, tokens=[400] * 150, sampling=SamplingParams(temperature=0))
        with pytest.raises(Overloaded) as err:
            e.add_sequence(b)
        assert err.value.status == 503 and "Retry-After" in err.value.headers
        e.remove_sequence(a)
        e.add_sequence(b)  # room again
        e.remove_sequence(b)
    finally:
        e.unload()


# -- tokenizer and chat template ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare(gguf_path):
    """Bare llama-cpp-python on the same file, same flash-attention setting as the engine's default (auto=on)."""
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=2048, n_threads=physical_cores(), flash_attn=True, verbose=False)
    yield llm
    llm.close()


def test_tokenize_and_pieces_match_llama_cpp(engine, bare):
    texts = PROMPTS + ["<|im_start|>user\nHi<|im_end|>\n", "  spaces\tand\nnewlines ", "🙂 👍🏽 ✨ 你好"]
    for text in texts:
        assert engine.tokenize(text) == bare.tokenize(text.encode(), add_bos=True, special=True)
        assert engine.tokenize(text, special=False) == bare.tokenize(text.encode(), add_bos=True, special=False)
        toks = engine.tokenize(text, special=False)
        assert b"".join(engine.token_bytes(t) for t in toks) == text.encode()
    assert engine.token_bytes(engine.tokenize("<|im_end|>")[0]) == b""


def test_pieces_read_by_two_threads_at_once_are_each_threads_own(engine):
    """llama_token_to_piece runs without the GIL: the deferred vocabulary build (a thread of its own) and request
    handling may both miss the piece cache at once; each must get its own token's bytes, not the other's."""
    import threading

    n = engine.info.n_vocab
    expected = {}
    for t in range(n):
        expected[t] = engine.token_bytes(t)
    got: dict[int, list[bytes]] = {0: [], 1: []}
    for _ in range(3):
        engine._pieces.clear()  # every call misses the cache and reads into the piece buffer
        start = threading.Barrier(2)

        def read(k: int, start: threading.Barrier = start) -> None:
            start.wait()
            order = range(n) if k == 0 else range(n - 1, -1, -1)
            got[k] = [(t, engine.token_bytes(t)) for t in order]

        threads = [threading.Thread(target=read, args=(k,)) for k in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for k in (0, 1):
            wrong = [t for t, b in got[k] if b != expected[t]]
            assert not wrong, f"thread {k} read another token's bytes for {len(wrong)} tokens, e.g. {wrong[:5]}"


def test_chat_template_renders_like_transformers(engine):
    transformers = pytest.importorskip("transformers")
    from octo.synth import build_hf

    hf = transformers.AutoTokenizer.from_pretrained(str(build_hf("tiny")))
    chats = [
        [{"role": "user", "content": "Hello there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Café?"},
        ],
    ]
    for messages in chats:
        for gen in (True, False):
            ours = engine.render_chat(messages, add_generation_prompt=gen)
            assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert engine.tokenize(ours) == hf(ours, add_special_tokens=False)["input_ids"]


def test_chat_template_error_is_400(engine):
    from octo.engines.llamacpp.template import ChatTemplate

    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", None, "<|im_end|>")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])


# -- generation correctness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_equals_create_completion(engine, bare, prompt):
    ref = bare.create_completion(prompt, max_tokens=24, temperature=0)
    out = generate(engine, [engine.tokenize(prompt)], 24)[0]
    assert text_of(engine, out) == ref["choices"][0]["text"]
    n_gen = len([t for t in out if t not in engine.info.eos_token_ids])
    assert (len(engine.tokenize(prompt)), n_gen) == (ref["usage"]["prompt_tokens"], ref["usage"]["completion_tokens"])


def test_greedy_equals_create_completion_without_flash_attention(gguf_path):
    e = LlamaCppEngine(EngineConfig(max_batch=2, options={"flash_attn": "off"}))
    e.load(gguf_path, "tiny")
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=2048, n_threads=physical_cores(), verbose=False)
    try:
        for prompt in PROMPTS[4:6]:
            ref = llm.create_completion(prompt, max_tokens=24, temperature=0)
            assert text_of(e, generate(e, [e.tokenize(prompt)], 24)[0]) == ref["choices"][0]["text"]
    finally:
        llm.close()
        e.unload()


def test_temperature_zero_is_deterministic(engine):
    p = engine.tokenize(PROMPTS[0])
    assert generate(engine, [p], 20) == generate(engine, [p], 20)


def test_seed_reproduces_the_sample(engine):
    p = engine.tokenize(PROMPTS[1])

    def sample(seed):
        return generate(engine, [p], 24, [SamplingParams(temperature=1.0, top_p=0.95, top_k=100, seed=seed)])[0]

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c
    assert a != generate(engine, [p], 24)[0]  # it really sampled


def test_sequence_in_a_batch_of_8_equals_alone(engine):
    prompts = [engine.tokenize(p) for p in PROMPTS]
    alone = [generate(engine, [p], 32, stop_at_eos=False)[0] for p in prompts]
    together = generate(engine, prompts, 32, stop_at_eos=False)
    assert together == alone


@pytest.mark.parametrize("options", [{"flash_attn": "off"}, {"kv_unified": "false"}])
def test_eight_sequences_with_chunked_prefill_all_complete(gguf_path, options):
    """Prompts fed in 7-token chunks while the others already decode: same tokens as one-shot prefill.

    Exact equality needs a KV layout that does not change the summation order: with flash attention over a
    unified pool, interleaved cells reorder the online softmax, and this random-weight model's near-tied
    logits flip on such last-bit differences (measured; not a bug). Hence flash attention off, or one KV
    stream per sequence."""
    engine = LlamaCppEngine(EngineConfig(max_batch=8, options=options))
    engine.load(gguf_path, "tiny")
    prompts = [engine.tokenize(SYSTEM + " " + p) for p in PROMPTS]
    ref = generate(engine, prompts, 12, stop_at_eos=False)
    seqs = [Sequence(id=i, tokens=list(p), sampling=SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_sequence(s)
    n_prompt = [len(p) for p in prompts]
    while any(len(s.tokens) - n < 12 for s, n in zip(seqs, n_prompt, strict=False)):
        feeds, budget = [], 7
        for s, n in zip(seqs, n_prompt, strict=False):
            if len(s.tokens) - n >= 12:
                continue
            left = len(s.tokens) - s.n_cached
            if left == 1:
                feeds.append(Feed(s, s.tokens[-1:], True))
            elif budget > 0:
                take = min(left, budget)
                budget -= take
                feeds.append(Feed(s, s.tokens[s.n_cached : s.n_cached + take], take == left))
        for f, t in zip(feeds, engine.step(feeds), strict=False):
            if t is not None:
                f.seq.tokens.append(t)
    for s in seqs:
        engine.remove_sequence(s)
    engine.unload()
    assert [s.tokens[n:] for s, n in zip(seqs, n_prompt, strict=False)] == ref


def test_sampling_params_reach_the_native_chain(engine):
    p = engine.tokenize(PROMPTS[2])
    greedy = generate(engine, [p], 8, stop_at_eos=False)[0]
    banned = generate(engine, [p], 8, [SamplingParams(temperature=0, logit_bias={greedy[0]: -100})], stop_at_eos=False)[
        0
    ]
    assert banned[0] != greedy[0] and greedy[0] not in banned
    forced = generate(engine, [p], 3, [SamplingParams(temperature=0, logit_bias={1000: 100.0})], False)[0]
    assert forced == [1000, 1000, 1000]
    topk1 = generate(engine, [p], 8, [SamplingParams(temperature=1.5, top_k=1, seed=3)], False)[0]
    assert topk1 == greedy
    rep = generate(
        engine,
        [p],
        16,
        [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)],
        False,
    )[0]
    assert len(set(rep)) > len(set(generate(engine, [p], 16, stop_at_eos=False)[0]))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        generate(engine, [p], 1, [SamplingParams(temperature=0, logit_bias={10**6: 1.0})])
    assert engine.free_ids and len(engine.free_ids) == 8  # failed add_sequence leaked no slot


def test_declared_sampling_params():
    assert LlamaCppEngine.sampling_params == {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
    }
    # constraints come as masks from the shared layer (octo.text.constrain), not as sampling parameters
    assert LlamaCppEngine.supports_masks and LlamaCppEngine.supports_logprobs
    assert LlamaCppEngine.supports_prompt_logprobs


# -- prefix cache --------------------------------------------------------------------------------------------
def test_prefix_cache_hit_gives_the_same_output_as_a_miss(engine):
    first = engine.tokenize(
        engine.render_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lighthouse?"}]
        )
    )
    second = engine.tokenize(
        engine.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who lights the lamp?"}])
    )
    miss = generate(engine, [second], 16, stop_at_eos=False)[0]
    a = Sequence(id=1, tokens=list(first), sampling=SamplingParams(temperature=0))
    engine.add_sequence(a)
    engine.step([Feed(a, list(first), True)])
    handle = engine.kv_save(a)
    engine.remove_sequence(a)
    assert handle.tokens == tuple(first) and handle.nbytes > 0
    common = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert common > 40  # the shared system prompt and user header
    b = Sequence(id=2, tokens=list(second), sampling=SamplingParams(temperature=0))
    engine.add_sequence(b)
    engine.kv_restore(b, handle, common)
    assert b.n_cached == common
    out, feed = [], Feed(b, second[common:], True)
    for _ in range(16):
        t = engine.step([feed])[0]
        b.tokens.append(t)
        out.append(t)
        feed = Feed(b, [t], True)
    engine.remove_sequence(b)
    engine.kv_free(handle)
    assert out == miss


def test_kv_snapshot_size_is_real_bytes(engine):
    toks = engine.tokenize(SYSTEM)
    s = Sequence(id=1, tokens=list(toks), sampling=SamplingParams(temperature=0))
    engine.add_sequence(s)
    engine.step([Feed(s, list(toks), True)])
    h = engine.kv_save(s)
    engine.remove_sequence(s)
    # 2 layers x (K + V) x 2 KV heads x 16 dims x f16 per token, plus a small header
    per_token = 2 * 2 * 2 * 16 * 2
    assert len(toks) * per_token <= h.nbytes < len(toks) * per_token + 4096


def test_restore_of_a_longer_handle_is_truncated(engine):
    toks = engine.tokenize(SYSTEM)
    a = Sequence(id=1, tokens=list(toks), sampling=SamplingParams(temperature=0))
    engine.add_sequence(a)
    engine.step([Feed(a, list(toks), True)])
    h = engine.kv_save(a)
    engine.remove_sequence(a)
    b = Sequence(id=2, tokens=list(toks[:10]) + [5, 6, 7], sampling=SamplingParams(temperature=0))
    engine.add_sequence(b)
    engine.kv_restore(b, h, 10)
    assert b.n_cached == 10
    mem = engine.mem
    assert llama_cpp.llama_memory_seq_pos_max(mem, b.slot.seq_id) == 9
    engine.remove_sequence(b)


# -- embeddings -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedder():
    from octo.synth.gguf import build_gguf

    e = LlamaCppEngine(EngineConfig(max_batch=4))
    e.load(str(build_gguf("tiny", ftype="f16", pooling="mean")), "tiny-embed")
    yield e
    e.unload()


def test_embeddings_are_batched_normalised_and_order_independent(embedder):
    import numpy as np

    info = embedder.info
    assert info.tasks == {Task.EMBEDDINGS} and info.embedding_dim == 64 and info.extra["pooling"] == "mean"
    texts = PROMPTS[:6]  # 6 inputs with max_batch 4: two llama_decode calls
    batch = embedder.embed(texts)
    assert batch.n_tokens == sum(len(embedder.tokenize(t, special=False)) for t in texts)
    singles = [embedder.embed([t]).vectors[0] for t in texts]
    v = np.array(batch.vectors)
    assert v.shape == (6, 64)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(v, np.array(singles), atol=1e-4)
    assert not np.allclose(v[0], v[1])
    with pytest.raises(InvalidRequest, match="embedding model"):
        embedder.add_sequence(Sequence(id=1, tokens=[1, 2], sampling=SamplingParams()))


def test_generative_model_refuses_embeddings(engine):
    with pytest.raises(InvalidRequest, match="not an embedding model"):
        engine.embed(["hello"])


def test_repack_probe_decides_and_the_option_overrides(gguf_path, monkeypatch, tmp_path):
    """A host where the probe's child crashes loads with repack off (use_extra_bufts=false); -o repack wins."""
    from octo.engines.llamacpp import probe

    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    monkeypatch.setattr(probe, "_probe", lambda: (False, "SIGSEGV"))
    e = LlamaCppEngine(EngineConfig(max_batch=1))
    try:
        extra = e.load(gguf_path, "tiny").extra
        assert (extra["repack"], extra["repack_source"]) == (False, "probe")
        assert generate(e, [e.tokenize(PROMPTS[0])], 3)[0]  # serves without repacking
    finally:
        e.unload()
    # the verdict is cached for this host and build: a second load does not probe again
    monkeypatch.setattr(probe, "_probe", lambda: pytest.fail("probed twice"))
    assert probe.repack_safe(LlamaCppEngine.version()) is False
    e = LlamaCppEngine(EngineConfig(max_batch=1, options={"repack": "true"}))
    try:
        extra = e.load(gguf_path, "tiny").extra
        assert (extra["repack"], extra["repack_source"]) == (True, "option")
    finally:
        e.unload()
    with pytest.raises(ConfigError, match="repack"):
        LlamaCppEngine(EngineConfig(options={"repack": "maybe"}))


def test_repack_probe_child_runs_here():
    """The real probe child decodes the tiny quantized models (exit 0 here; a signal on a crashing host)."""
    from octo.engines.llamacpp import probe

    verdict, detail = probe._probe()
    assert verdict is not None, detail
