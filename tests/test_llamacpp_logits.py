"""The llama.cpp engine's output constraints and logprobs (``Feed.mask``, ``Feed.logprobs``, ``Feed.prompt_logprobs``).

- Masks come from the shared constraint layer (``octo.text.constrain`` on llguidance): 8 concurrent sequences, greedy
  and seeded temperature 1, always give JSON that parses and validates, whatever the random weights prefer.
- Logprobs are checked against bare llama-cpp-python's logits of the same GGUF (``Llama(logits_all=True)``), as
  float64 log-softmax, raw or after ``octo.logits.penalise`` (bias and penalties, the chain's window).
- Prompt logprobs: every fed position whose next token is known, from raw logits, without moving the sampling index.

Uses the tiny synthetic GGUF (qwen2 architecture, 2 layers, 4k vocab, random weights) from ``$OCTO_HOME/synth``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("llguidance", reason="llguidance is not installed (pip install llguidance): no constraints")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from octo.engines.llamacpp.native import physical_cores  # noqa: E402
from octo.engines.llamacpp.template import ChatTemplate  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import EngineError  # noqa: E402
from octo.logits import allowed, log_softmax, penalise  # noqa: E402
from octo.text.constrain import Constraint, compile_constraint, vocab_for  # noqa: E402

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
# Every value bounded (integer range, enum, maxLength, maxItems; JSON whitespace is bounded by the shared layer), so
# any path through the grammar ends: a random model cannot run on forever inside a number or a string.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "ok": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["answer", "ok", "color", "name", "tags"],
    "additionalProperties": False,
}
# Logprobs of the engine vs bare llama-cpp-python's logits on the same batch shapes: the same kernels, so the same
# numbers (measured: identical here); the bound leaves room for hosts whose kernels depend on more than the shape.
TOL = 1e-3


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


@pytest.fixture(scope="module")
def bare(gguf_path):
    """Bare llama-cpp-python keeping the logits of every position (same flash-attention setting: auto = on)."""
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=1024, n_threads=physical_cores(), flash_attn=True,
                          logits_all=True, verbose=False)
    yield llm
    llm.close()


def bare_logits(llm, *chunks: list[int]) -> np.ndarray:
    """Raw logits after each token of ``chunks`` (row p: the distribution of token p + 1), float32 as llama.cpp gives
    them. One ``eval`` per chunk, in the batch shapes the engine ran (the prompt, then one token per step): llama.cpp's
    CPU matmuls pick kernels by batch rows, and a 100-row batch gives logits ~1e-2 off the 1-row ones (measured)."""
    llm.reset()
    for chunk in chunks:
        llm.eval(chunk)
    return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)


@pytest.fixture(scope="module")
def grammar(engine):
    return compile_constraint(Constraint.json_schema(SCHEMA), vocab_for(engine))


def text_of(engine, tokens: list[int]) -> str:
    return b"".join(engine.token_bytes(t) for t in tokens).decode("utf-8")


def run(engine, prompts: list[list[int]], sampling: list[SamplingParams], max_tokens: int, *, grammar=None,
        logprobs: int = -1):
    """Continuous batching over Engine.step the way the scheduler drives constraints: each sampling feed carries its
    matcher's mask, the sampled token must be allowed and is accepted, a sequence ends on EOS or once its matcher is
    done (nothing but EOS may follow). Returns per sequence (tokens, finished, [(mask copy, logprob), ...])."""
    seqs = [Sequence(id=i, tokens=list(p), sampling=s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))]
    matchers = [grammar.matcher() if grammar is not None else None for _ in seqs]
    out: list[list[int]] = [[] for _ in seqs]
    steps: list[list] = [[] for _ in seqs]
    finished = [False] * len(seqs)
    eos = engine.info.eos_token_ids
    for s in seqs:
        engine.add_sequence(s)
    try:
        feeds = [Feed(s, list(s.tokens), True) for s in seqs]
        while feeds:
            for f in feeds:
                m = matchers[f.seq.id]
                f.mask = m.bitmask().copy() if m is not None else None
                f.logprobs = logprobs
            nxt = []
            for f, t in zip(feeds, engine.step(feeds), strict=True):
                i = f.seq.id
                assert isinstance(t, int), t
                steps[i].append((f.mask, f.logprob))
                if f.mask is not None:
                    assert allowed(f.mask, t), f"sequence {i} sampled {t}, which its mask forbids"
                    assert matchers[i].accept(t), matchers[i].error
                if t in eos:
                    finished[i] = True
                    continue
                f.seq.tokens.append(t)
                out[i].append(t)
                if matchers[i] is not None and matchers[i].is_done():
                    finished[i] = True
                elif len(out[i]) < max_tokens:
                    nxt.append(Feed(f.seq, [t], True))
            feeds = nxt
    finally:
        for s in seqs:
            engine.remove_sequence(s)
    return [(out[i], finished[i], steps[i]) for i in range(len(seqs))]


def chat_prompts(engine) -> list[list[int]]:
    """Short prompts (8 chat-templated ones would not fit one 512-token step)."""
    return [engine.tokenize(f"{p} Reply in JSON:") for p in PROMPTS]


# -- (a) masks from the shared constraint layer -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "temperature-1"])
def test_eight_constrained_sequences_always_give_valid_json(engine, grammar, mode):
    prompts = chat_prompts(engine)
    if mode == "greedy":
        sampling = [SamplingParams(temperature=0) for _ in prompts]
    else:
        sampling = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    results = run(engine, prompts, sampling, 600, grammar=grammar)
    texts = []
    for tokens, finished, _ in results:
        assert finished, f"the constraint did not complete in 600 tokens: {text_of(engine, tokens)!r}"
        obj = json.loads(text_of(engine, tokens))
        jsonschema.validate(obj, SCHEMA)
        texts.append(text_of(engine, tokens))
    if mode == "greedy":  # a constrained sequence in a batch of 8 samples what it samples alone
        alone = run(engine, prompts[:1], sampling[:1], 600, grammar=grammar)[0][0]
        assert text_of(engine, alone) == texts[0]
    else:
        assert len(set(texts)) > 1  # it really sampled


def test_unconstrained_output_is_not_json(engine):
    """The control: the same model without a mask does not write this JSON by itself."""
    tokens, _, _ = run(engine, chat_prompts(engine)[:1], [SamplingParams(temperature=0)], 40)[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text_of(engine, tokens)), SCHEMA)


def test_json_object_mode_gives_an_object(engine):
    """Any JSON object: a random model rarely closes a free string, so favour "}" (+30) over "{" (+20); the mask must
    still open the object first (unmasked, "}" comes straight away)."""
    prompt = chat_prompts(engine)[0]
    close, open_ = engine.tokenize("}", special=False)[0], engine.tokenize("{", special=False)[0]
    sp = SamplingParams(temperature=0, logit_bias={close: 30.0, open_: 20.0})
    g = compile_constraint(Constraint.json_object(), vocab_for(engine))
    tokens, finished, _ = run(engine, [prompt], [sp], 50, grammar=g)[0]
    assert finished and tokens == [open_, close] and json.loads(text_of(engine, tokens)) == {}
    assert run(engine, [prompt], [sp], 1)[0][0] == [close]


def test_banned_eos_still_ends_when_the_mask_allows_only_eos(engine):
    """logit_bias -100 on every EOS while the mask allows nothing else: the chain's bias is finite, so the masked row
    keeps one finite logit and the sequence ends (an all -inf row would leave the native sampler nothing)."""
    eos = engine.info.eos_token_ids
    g = compile_constraint(Constraint.regex("ab"), vocab_for(engine))
    p = engine.tokenize("x")
    sp = SamplingParams(temperature=0, logit_bias={t: -100.0 for t in eos})
    seq = Sequence(id=1, tokens=list(p), sampling=sp)
    engine.add_sequence(seq)
    m = g.matcher()
    try:
        for _ in range(5):
            f = Feed(seq, seq.tokens[seq.n_cached:], True, mask=m.bitmask().copy())
            t = engine.step([f])[0]
            assert allowed(f.mask, t) and m.accept(t)
            if t in eos:
                break
            seq.tokens.append(t)
    finally:
        engine.remove_sequence(seq)
    assert t in eos and text_of(engine, seq.tokens[len(p):]) == "ab"


def test_an_empty_mask_fails_that_sequence_alone(engine):
    a = Sequence(id=1, tokens=engine.tokenize(PROMPTS[0]), sampling=SamplingParams(temperature=1.0, seed=1))
    b = Sequence(id=2, tokens=engine.tokenize(PROMPTS[1]), sampling=SamplingParams(temperature=0))
    engine.add_sequence(a)
    engine.add_sequence(b)
    try:
        empty = np.zeros(vocab_for(engine).words, dtype=np.int32)
        out = engine.step([Feed(a, list(a.tokens), True, mask=empty), Feed(b, list(b.tokens), True)])
    finally:
        engine.remove_sequence(a)
        engine.remove_sequence(b)
    assert isinstance(out[0], EngineError) and "allows no token" in str(out[0])
    assert out[1] == run(engine, [b.tokens], [SamplingParams(temperature=0)], 1)[0][0][0]


# -- (b) logprobs vs bare llama-cpp-python --------------------------------------------------------------------------
def check_entry(lp: float, top: list, want: np.ndarray, tok: int, n: int) -> None:
    """``(lp, top)`` from the engine against the float64 log-softmax ``want`` of the reference row."""
    assert abs(lp - want[tok]) < TOL
    assert len(top) == n
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    for t, v in top:
        assert abs(v - want[t]) < TOL
    np.testing.assert_allclose([v for _, v in top], np.sort(want)[::-1][:n], atol=TOL)


def test_greedy_logprobs_match_bare_logits(engine, bare):
    prompt = engine.tokenize(PROMPTS[0])
    tokens, _, steps = run(engine, [prompt], [SamplingParams(temperature=0)], 12, logprobs=5)[0]
    ref = bare_logits(bare, prompt, *([t] for t in tokens))
    assert len(steps) == len(tokens) == 12
    for i, (tok, (_, (lp, top))) in enumerate(zip(tokens, steps, strict=True)):
        want = log_softmax(ref[len(prompt) - 1 + i])
        check_entry(lp, top, want, tok, 5)
        assert top[0] == (tok, lp)  # greedy: the sampled token is the most likely one
        assert want[tok] >= want.max() - TOL
    # logprobs=0: the sampled token's logprob and no alternatives
    tokens0, _, steps0 = run(engine, [prompt], [SamplingParams(temperature=0)], 3, logprobs=0)[0]
    assert tokens0 == tokens[:3] and all(top == [] for _, (_, top) in steps0)


@pytest.mark.parametrize("last_n", [64, 4])
def test_penalised_logprobs_match_penalise_on_bare_logits(gguf_path, bare, last_n):
    """Presence, frequency and repetition penalties and a logit bias: the logprobs are those of
    ``octo.logits.penalise`` over the last ``penalty_last_n`` tokens (prompt included) of the raw logits, and greedy
    picks that row's argmax, i.e. the native chain penalised the same window."""
    e = LlamaCppEngine(EngineConfig(max_batch=1, options={"penalty_last_n": str(last_n)}))
    e.load(gguf_path, "tiny")
    try:
        prompt = e.tokenize("the the the cat sat on the mat, the cat, the mat, the end of the")
        sp = SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3,
                            logit_bias={prompt[2]: 2.5, 100: -1.5})
        tokens, _, steps = run(e, [prompt], [sp], 16, logprobs=4)[0]
    finally:
        e.unload()
    ref = bare_logits(bare, prompt, *([t] for t in tokens))
    seq = list(prompt)
    moved = 0.0
    for tok, (_, (lp, top)) in zip(tokens, steps, strict=True):
        row = ref[len(seq) - 1].copy()
        want = log_softmax(penalise(row, seq, repetition=1.3, presence=0.8, frequency=0.6, last_n=last_n,
                                    bias=sp.logit_bias))
        check_entry(lp, top, want, tok, 4)
        assert want[tok] >= want.max() - TOL
        moved = max(moved, float(np.abs(want - log_softmax(ref[len(seq) - 1])).max()))
        seq.append(tok)
    assert moved > 0.5  # the penalties really changed the numbers


# -- (c) prompt logprobs ---------------------------------------------------------------------------------------------
def test_prompt_logprobs_match_bare_logits_and_keep_the_sampling_index(engine, bare):
    """A prompt fed in two chunks with prompt logprobs, next to a decoding sequence: one entry per position whose
    next token is known (the last prompt position has none), the raw logits' values; both sequences sample what
    they sample without prompt logprobs."""
    prompt = engine.tokenize(PROMPTS[0] + " " + PROMPTS[3] + " " + PROMPTS[4])
    other = engine.tokenize(PROMPTS[1])
    greedy = SamplingParams(temperature=0)
    want_first = run(engine, [prompt], [greedy], 1)[0][0][0]
    want_other = run(engine, [other], [greedy], 3)[0][0]
    a = Sequence(id=1, tokens=list(prompt), sampling=greedy)
    b = Sequence(id=2, tokens=list(other), sampling=greedy)
    engine.add_sequence(a)
    engine.add_sequence(b)
    try:
        got_other = [engine.step([Feed(b, list(b.tokens), True)])[0]]
        b.tokens.append(got_other[-1])
        cut = 9
        f1 = Feed(a, prompt[:cut], False, prompt_logprobs=3)
        r = engine.step([f1, Feed(b, [got_other[-1]], True)])
        assert r[0] is None
        got_other.append(r[1])
        b.tokens.append(r[1])
        f2 = Feed(a, prompt[cut:], True, prompt_logprobs=3)
        r = engine.step([Feed(b, [got_other[-1]], True), f2])
        got_other.append(r[0])
        first = r[1]
    finally:
        engine.remove_sequence(a)
        engine.remove_sequence(b)
    assert first == want_first and got_other == want_other
    assert len(f1.prompt_out) == cut and len(f2.prompt_out) == len(prompt) - cut - 1
    ref = bare_logits(bare, prompt[:cut], prompt[cut:])
    for p, (lp, top) in enumerate(f1.prompt_out + f2.prompt_out):
        want = log_softmax(ref[p])
        check_entry(lp, top, want, prompt[p + 1], 3)


def test_prompt_logprobs_of_a_decode_feed_are_empty(engine):
    s = Sequence(id=1, tokens=engine.tokenize(PROMPTS[2]), sampling=SamplingParams(temperature=0))
    engine.add_sequence(s)
    try:
        t = engine.step([Feed(s, list(s.tokens), True)])[0]
        s.tokens.append(t)
        f = Feed(s, [t], True, prompt_logprobs=2)
        assert isinstance(engine.step([f])[0], int) and f.prompt_out == []
    finally:
        engine.remove_sequence(s)


# -- (d) a mask and logprobs together ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "temperature-1"])
def test_masked_logprobs_are_those_of_the_unmasked_distribution(engine, bare, grammar, mode):
    """The mask limits what is sampled, not the reported distribution: the logprobs are the model's before the mask
    (top alternatives may be tokens the mask forbids); greedy picks the most likely allowed token."""
    prompt = chat_prompts(engine)[2]
    sp = SamplingParams(temperature=0) if mode == "greedy" else SamplingParams(temperature=1.0, seed=7)
    tokens, finished, steps = run(engine, [prompt], [sp], 600, grammar=grammar, logprobs=3)[0]
    assert finished
    jsonschema.validate(json.loads(text_of(engine, tokens)), SCHEMA)
    ref = bare_logits(bare, prompt, *([t] for t in tokens))
    forbidden_on_top = 0
    for i, (tok, (mask, (lp, top))) in enumerate(zip(tokens, steps, strict=False)):
        want = log_softmax(ref[len(prompt) - 1 + i])
        check_entry(lp, top, want, tok, 3)
        ok = np.unpackbits(mask.view(np.uint8), bitorder="little", count=want.shape[0]).astype(bool)
        assert ok[tok]
        if mode == "greedy":
            assert want[tok] >= want[ok].max() - TOL
        forbidden_on_top += not ok[top[0][0]]
    assert forbidden_on_top > 0  # the model wanted something else at some step: the mask decided


# -- chat template, special tokens --------------------------------------------------------------------------------
def test_chat_template_source_and_special_tokens(engine):
    assert engine.chat_template() == engine.metadata["tokenizer.chat_template"]
    special = engine.special_tokens()
    assert special == {"<|endoftext|>": 4093, "<|im_start|>": 4094, "<|im_end|>": 4095}
    for text, tok in special.items():
        assert engine.tokenize(text) == [tok] and engine.token_bytes(tok) == b""
    vocab = vocab_for(engine)
    assert vocab.token_for("<|im_start|>") == (4094, True)


def test_render_chat_passes_tools_to_the_template(engine):
    transformers = pytest.importorskip("transformers")
    from octo.synth import build_hf

    src = ("{% if tools %}{% for t in tools %}<tool>{{ t.function.name }}:{{ t.function | tojson }}</tool>\n"
           "{% endfor %}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    saved = engine.template
    engine.template = ChatTemplate(src, saved.bos_token, saved.eos_token)
    try:
        ours = engine.render_chat(messages, tools=tools)
        plain = engine.render_chat(messages)
    finally:
        engine.template = saved
    hf = transformers.AutoTokenizer.from_pretrained(str(build_hf("tiny")))
    assert ours == hf.apply_chat_template(messages, tools=tools, chat_template=src, tokenize=False,
                                          add_generation_prompt=True)
    assert "<tool>get_weather:" in ours and "Zürich" in ours and "<tool>" not in plain


# -- greedy picks read from the logits row --------------------------------------------------------------------------
def test_the_greedy_argmax_is_llama_cpps_own_pick(engine):
    """A greedy chain without penalties picks argmax(logits + bias) from llama.cpp's row itself (SamplerChain.argmax);
    for every bias and mask here it is the token llama.cpp's own chain (logit bias, then greedy) gives on the same
    row, and the row is left as it was."""
    from octo.engines.llamacpp.logits import logits_row
    from octo.engines.llamacpp.sampling import SamplerChain

    seq = Sequence(id=0, tokens=engine.tokenize(PROMPTS[0]), sampling=SamplingParams(temperature=0.0))
    engine.add_sequence(seq)
    try:
        engine.step([Feed(seq, list(seq.tokens), True)])
        idx = len(seq.tokens) - 1  # the feed's last batch position: its logits stay until the next decode
        row = logits_row(engine.lib, engine.ctx, idx, engine.n_vocab)
        raw = row.copy()
        order = np.argsort(-raw, kind="stable")
        top, second, low = int(order[0]), int(order[1]), int(order[-1])
        gap = float(raw[top] - raw[second])
        cases = [{}, {top: -100.0}, {low: 1000.0}, {second: gap / 2}, {second: gap + 0.5, top: 0.25},
                 {top: -5.0, second: -5.0, 7: 3.0}, {str(second): gap + 1.0}]
        for bias in cases:
            chain = SamplerChain(engine.n_vocab, SamplingParams(temperature=0.0, logit_bias=bias))
            try:
                assert chain.argmax is not None
                fast = chain.sample(engine.ctx, idx)
                assert np.array_equal(row, raw)  # the bias went back out of llama.cpp's buffer
                assert fast == engine.lib.llama_sampler_sample(chain.ptr, engine.ctx, idx), bias
            finally:
                chain.close()
        # within a mask (the constrained path sets forbidden logits to -inf in the row first)
        row[order[:50]] = -np.inf
        chain = SamplerChain(engine.n_vocab, SamplingParams(temperature=0.0, logit_bias={low: 2.0}))
        try:
            assert chain.sample(engine.ctx, idx) == engine.lib.llama_sampler_sample(chain.ptr, engine.ctx, idx)
        finally:
            chain.close()
        # a NaN logit: llama.cpp's greedy decides (numpy's argmax would pick the NaN)
        row[int(order[60])] = np.nan
        chain = SamplerChain(engine.n_vocab, SamplingParams(temperature=0.0))
        try:
            assert chain.sample(engine.ctx, idx) == engine.lib.llama_sampler_sample(chain.ptr, engine.ctx, idx)
            assert chain.sample(engine.ctx, idx) != int(order[60])
        finally:
            chain.close()
        # penalties, duplicate bias entries and sampling at a temperature keep the native chain
        for p in (SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=0.0, logit_bias={5: 1.0, "5": 1.0})):
            chain = SamplerChain(engine.n_vocab, p)
            assert chain.argmax is None
            chain.close()
    finally:
        engine.remove_sequence(seq)
