"""The MLX engine's output constraints (``Feed.mask``), logprobs and prompt logprobs, driven directly (no server):
masks from real ``octo.text.constrain`` matchers always give valid JSON, whatever the (random) weights, greedy and
sampled,
alone and in the decode batch; logprobs checked against an independent float64 numpy forward pass of the synthetic
qwen2 weights (no KV cache, no MLX), with penalties against ``octo.logits.penalise``. Also the chat template with
``tools``, ``chat_template()`` and ``special_tokens()``.

Uses the tiny synthetic MLX folder (see tests/test_mlx.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'octo[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")
pytest.importorskip("llguidance", reason="llguidance is not installed: no constraints")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from octo.engines.mlx import MLXEngine  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.logits import log_softmax, penalise  # noqa: E402
from octo.text.constrain import Constraint, compile_constraint, vocab_for  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and",
    "Numbers can be written in many ways:",
    "def add(a, b):",
    "She opened the letter carefully,",
]
GREEDY = SamplingParams(temperature=0.0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
TOL = 1e-3  # MLX float32 against numpy float64


@pytest.fixture(scope="module")
def folder() -> str:
    from octo.synth.mlx import build_mlx

    return str(build_mlx("tiny"))


@pytest.fixture(scope="module")
def engine(folder):
    e = MLXEngine(EngineConfig(max_batch=8))
    e.load(folder, "tiny")
    yield e
    e.unload()


class NumpyQwen2:
    """The synthetic qwen2 model in float64 numpy: a whole sequence at once, nothing shared with MLX."""

    def __init__(self, folder: str) -> None:
        from safetensors.numpy import load_file

        self.cfg = json.loads((Path(folder) / "config.json").read_text())
        assert self.cfg["model_type"] == "qwen2" and self.cfg["tie_word_embeddings"]
        self.w = {}
        for path in Path(folder).glob("*.safetensors"):
            self.w.update({k: v.astype(np.float64) for k, v in load_file(str(path)).items()})

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Raw logits after every position of ``tokens``: [len, vocab]."""
        c, w = self.cfg, self.w
        n_heads, n_kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps, n = c["rms_norm_eps"], len(tokens)

        def rms(x, weight):
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

        def rope(x):  # [n, heads, hd], rotate-half (HF / mlx non-traditional)
            inv = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2) / hd))
            ang = np.arange(n)[:, None] * inv[None, :]
            cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

        x = w["model.embed_tokens.weight"][tokens]
        causal = np.triu(np.full((n, n), -np.inf), 1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])

            def proj(name, heads, h=h, p=p):
                y = h @ w[p + f"self_attn.{name}.weight"].T + w[p + f"self_attn.{name}.bias"]
                return y.reshape(n, heads, hd)

            q, k, v = rope(proj("q_proj", n_heads)), rope(proj("k_proj", n_kv)), proj("v_proj", n_kv)
            k, v = np.repeat(k, n_heads // n_kv, axis=1), np.repeat(v, n_heads // n_kv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, n_heads * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        return rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@pytest.fixture(scope="module")
def reference(folder) -> NumpyQwen2:
    return NumpyQwen2(folder)


def run(
    engine,
    prompts: list[list[int]],
    n: int,
    sampling=GREEDY,
    chunk: int = 512,
    grammar=None,
    logprobs: int = -1,
    prompt_logprobs: int = -1,
    join_at: list[int] | None = None,
):
    """Drive ``engine`` as the scheduler does (prompt chunks, then one token per step; sequence i added at step
    ``join_at[i]``), with a matcher of ``grammar`` per sequence (its bitmask on every sampling feed, the sampled token
    accepted, the sequence done when the matcher is). Returns the sequences, and per sequence its generated tokens,
    its ``Feed.logprob`` per generated token, its prompt entries (absolute position -> (logprob, top)) and whether
    it finished by its constraint."""
    join_at = join_at or [0] * len(prompts)
    seqs = [Sequence(i, list(p), sampling) for i, p in enumerate(prompts)]
    matchers = [grammar.matcher() if grammar else None for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list] = [[] for _ in prompts]
    plps: list[dict] = [{} for _ in prompts]
    done = [False] * len(prompts)
    eos = engine.info.eos_token_ids
    active: list[Sequence] = []
    finished: list[Sequence] = []
    for step in range(10_000):
        for s in seqs:
            if join_at[s.id] == step:
                engine.add_sequence(s)
                active.append(s)
        if len(finished) == len(seqs):
            break
        feeds = []
        for s in active:
            left = len(s.tokens) - s.n_cached
            take = min(left, chunk)
            f = Feed(
                s,
                s.tokens[s.n_cached : s.n_cached + take],
                take == left,
                logprobs=logprobs if take == left else -1,
                prompt_logprobs=prompt_logprobs if s.n_cached < len(prompts[s.id]) else -1,
            )
            if f.sample and matchers[s.id] is not None:
                f.mask = matchers[s.id].bitmask()
            feeds.append(f)
        for f, tok in zip(feeds, engine.step(feeds) if feeds else [], strict=True):
            i = f.seq.id
            first = f.seq.n_cached - len(f.tokens)
            for j, entry in enumerate(f.prompt_out or []):
                plps[i].setdefault(first + j, entry)
            if tok is None:
                continue
            m = matchers[i]
            if m is not None:
                assert m.accept(tok), f"sampled token {tok} is outside the mask"
            f.seq.tokens.append(tok)
            outs[i].append(tok)
            lps[i].append(f.logprob)
            if m is not None and (m.is_done() or tok in eos):
                done[i] = True
            if done[i] or len(outs[i]) >= n or (m is None and tok in eos):
                engine.remove_sequence(f.seq)
                active.remove(f.seq)
                finished.append(f.seq)
    assert len(finished) == len(seqs)
    return seqs, outs, lps, plps, done


def json_grammar(engine):
    return compile_constraint(Constraint.json_schema(SCHEMA, strict=True), vocab_for(engine))


# -- masks ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=5),
    ],
    ids=["greedy", "t1", "filters"],
)
def test_json_schema_masks_always_validate(engine, sampling):
    assert engine.supports_masks
    grammar = json_grammar(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    # two start together, the others join the running decode batch later; prompts prefilled 7 tokens per step
    _, outs, _, _, done = run(engine, prompts, 400, sampling, chunk=7, grammar=grammar, join_at=[0, 0, 3, 9])
    texts = []
    eos = engine.info.eos_token_ids
    for out, finished in zip(outs, done, strict=True):
        assert finished, "the constraint did not complete within 400 tokens"
        text = b"".join(engine.token_bytes(t) for t in out if t not in eos).decode()
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.append(text)
    if not sampling.greedy:
        assert len(set(texts)) > 1


def test_masked_plain_greedy_rows_leave_the_batched_argmax(engine):
    """A plain-greedy row with a mask next to an unconstrained one: the mask is applied, the other row is not."""
    grammar = compile_constraint(Constraint.regex("[0-9]{1,40}"), vocab_for(engine))
    prompts = [engine.tokenize(p) for p in PROMPTS[:2]]
    free = run(engine, prompts[1:], 12)[1][0]
    m = grammar.matcher()
    a, b = Sequence(1, list(prompts[0]), GREEDY), Sequence(2, list(prompts[1]), GREEDY)
    engine.add_sequence(a)
    engine.add_sequence(b)
    got = []
    feeds = [Feed(a, list(a.tokens), True, mask=m.bitmask()), Feed(b, list(b.tokens), True)]
    for _ in range(12):
        ta, tb = engine.step(feeds)
        assert m.accept(ta)
        a.tokens.append(ta)
        b.tokens.append(tb)
        got.append(tb)
        if m.is_done():
            break
        feeds = [Feed(a, [ta], True, mask=m.bitmask()), Feed(b, [tb], True)]
    assert len(engine.batch) == 2
    engine.remove_sequence(a)
    engine.remove_sequence(b)
    assert got == free[: len(got)]
    assert b"".join(engine.token_bytes(t) for t in a.tokens[len(prompts[0]) :]).decode().isdigit()


# -- logprobs ------------------------------------------------------------------------------------------------------
def check_entry(entry, ref_row: np.ndarray, tok: int, n: int) -> None:
    """``entry`` = (logprob of tok, top n) against the reference log-softmax row."""
    lp, top = entry
    assert abs(lp - ref_row[tok]) < TOL
    assert len(top) == n
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, np.sort(ref_row)[::-1][:n], atol=TOL)
    for t, v in top:
        assert abs(v - ref_row[t]) < TOL


def test_numpy_reference_matches_the_model(engine, reference):
    import mlx.core as mx

    tokens = engine.tokenize(PROMPTS[0])
    ours = np.array(engine.model(mx.array(tokens)[None])[0].astype(mx.float32))
    np.testing.assert_allclose(ours, reference.logits(tokens), atol=1e-3)


def test_greedy_logprobs_equal_the_numpy_forward(engine, reference):
    assert engine.supports_logprobs
    prompts = [engine.tokenize(p) for p in PROMPTS[:3]]
    seqs, outs, lps, _, _ = run(engine, prompts, 10, GREEDY, chunk=5, logprobs=4, join_at=[0, 0, 2])
    for seq, prompt, out, entries in zip(seqs, prompts, outs, lps, strict=True):
        raw = reference.logits(seq.tokens)
        assert len(entries) == len(out) == 10
        for k, (tok, entry) in enumerate(zip(out, entries, strict=True)):
            ref = log_softmax(raw[len(prompt) - 1 + k])
            assert tok == int(np.argmax(ref)) == entry[1][0][0]  # greedy: the argmax, the top entry
            check_entry(entry, ref, tok, 4)


def test_logprobs_with_penalties_bias_and_temperature(engine, reference):
    prompt = engine.tokenize(PROMPTS[0])
    boosted = engine.tokenize(" harbor")[0]
    sp = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={boosted: 1.5}
    )
    seqs, outs, lps, _, _ = run(engine, [prompt], 12, sp, logprobs=3)
    raw = reference.logits(seqs[0].tokens)
    for k, (tok, entry) in enumerate(zip(outs[0], lps[0], strict=True)):
        pos = len(prompt) - 1 + k
        row = penalise(
            raw[pos].copy(),
            seqs[0].tokens[: pos + 1],
            repetition=1.3,
            presence=0.4,
            frequency=0.3,
            last_n=engine.penalty_last_n,
            bias={boosted: 1.5},
        )
        ref = log_softmax(row)
        assert tok == int(np.argmax(ref))
        check_entry(entry, ref, tok, 3)
    sp = SamplingParams(temperature=1.7, top_k=20, seed=3)
    seqs, outs, lps, _, _ = run(engine, [prompt], 12, sp, logprobs=0)
    raw = reference.logits(seqs[0].tokens)
    for k, (tok, (lp, top)) in enumerate(zip(outs[0], lps[0], strict=True)):
        ref = log_softmax(raw[len(prompt) - 1 + k])
        assert top == [] and abs(lp - ref[tok]) < TOL


def test_logprobs_under_a_mask_are_unmasked(engine, reference):
    grammar = json_grammar(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS[:2]]
    seqs, outs, lps, _, done = run(engine, prompts, 400, GREEDY, grammar=grammar, logprobs=2)
    assert all(done)
    for seq, prompt, out, entries in zip(seqs, prompts, outs, lps, strict=True):
        raw = reference.logits(seq.tokens)
        for k, (tok, entry) in enumerate(zip(out, entries, strict=True)):
            check_entry(entry, log_softmax(raw[len(prompt) - 1 + k]), tok, 2)
        assert any(entry[1][0][0] != tok for tok, entry in zip(out, entries, strict=True))


def test_prompt_logprobs(engine, reference):
    assert engine.supports_prompt_logprobs
    prompts = [engine.tokenize(p) for p in PROMPTS]
    seqs, outs, lps, plps, _ = run(
        engine, prompts, 3, GREEDY, chunk=5, logprobs=1, prompt_logprobs=2, join_at=[0, 0, 1, 4]
    )
    for prompt, entries, out in zip(prompts, plps, outs, strict=True):
        assert sorted(entries) == list(range(len(prompt) - 1))  # every prompt position but the last, once
        raw = reference.logits(prompt)
        for p, entry in entries.items():
            check_entry(entry, log_softmax(raw[p]), prompt[p + 1], 2)
        assert out == run(engine, [prompt], 3)[1][0]  # the same tokens as without prompt logprobs


# -- chat template, special tokens ---------------------------------------------------------------------------------
TOOL_TEMPLATE = (
    "{%- if tools is not none %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% else %}(no tools)\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_render_chat_with_tools(folder, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    e = MLXEngine()
    e.load(str(copy), "tools")
    assert e.chat_template() == TOOL_TEMPLATE
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    text = e.render_chat(msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools{") and json.dumps(TOOLS[0]) in text  # (trim_blocks)
    assert e.render_chat(msgs).startswith("(no tools)\n<|im_start|>user\nWeather in Paris?")
    e.unload()


def test_chat_template_and_special_tokens(engine, folder):
    cfg = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    assert engine.chat_template() == cfg["chat_template"]
    special = engine.special_tokens()
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(special)
    for text, tok in special.items():
        assert engine.tokenize(text) == [tok] and engine.token_bytes(tok) == b""
    assert vocab_for(engine).token_for("<|im_end|>") == (special["<|im_end|>"], True)
