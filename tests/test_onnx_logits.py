"""The onnx engine's output constraints (``Feed.mask``), logprobs and prompt logprobs, driven directly (no server),
on every backend that claims them: masks from real ``octo.text.constrain`` matchers always give valid JSON, whatever the
(random) weights, greedy and sampled; logprobs checked against an independent onnxruntime run of the model file over
the whole sequence (no KV rows, no IOBinding), with penalties against ``octo.logits.penalise``. Also the chat
template with ``tools``, ``chat_template()`` and ``special_tokens()``.

Uses the tiny synthetic onnxruntime-genai folders (see tests/test_onnx.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'octo[onnx]')")
for _mod in ("torch", "transformers", "onnx_ir"):  # the model builder's imports
    pytest.importorskip(_mod, reason=f"{_mod} is needed by onnxruntime-genai's model builder")
pytest.importorskip("llguidance", reason="llguidance is not installed: no constraints")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from octo.engines.onnx import OnnxEngine  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import EngineError  # noqa: E402
from octo.logits import log_softmax, penalise  # noqa: E402
from octo.text.constrain import Constraint, compile_constraint, vocab_for  # noqa: E402

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

PROMPTS = [
    "The old lighthouse stood at the edge of the harbor, and",
    "Numbers can be written in many ways:",
    "def add(a, b):",
    "She opened the letter carefully, read it twice, and then laughed out loud.",
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
TOL = 2e-3  # float32 logits of two different onnxruntime runs (incremental with KV rows vs one full pass)


@pytest.fixture(scope="module")
def fp32_dir() -> str:
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="fp32"))


@pytest.fixture(scope="module")
def int4_dir() -> str:
    from octo.synth.onnx import build_onnx

    return str(build_onnx("tiny", precision="int4"))


def make_engine(folder: str, max_batch: int = 4, **options: str) -> OnnxEngine:
    e = OnnxEngine(EngineConfig(max_batch=max_batch, options=dict(options)))
    e.load(folder, "tiny")
    return e


@pytest.fixture(scope="module", params=["session", "generator"])
def engine(request, fp32_dir):
    e = make_engine(fp32_dir, backend=request.param)
    yield e
    e.unload()


class Reference:
    """The model file run by a plain onnxruntime session over a whole sequence at once (empty past)."""

    def __init__(self, folder: str) -> None:
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(Path(folder) / "model.onnx"), providers=["CPUExecutionProvider"])
        dec = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]
        self.past = [i.name for i in self.sess.get_inputs() if i.name.startswith("past")]
        self.empty = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Raw logits after every position of ``tokens``: [len, vocab]."""
        ids = np.asarray([tokens], np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for name in self.past:
            feeds[name] = self.empty
        return self.sess.run(["logits"], feeds)[0][0]


@pytest.fixture(scope="module")
def reference(fp32_dir) -> Reference:
    return Reference(fp32_dir)


def run(engine, prompts: list[list[int]], n: int, sampling=GREEDY, chunk: int = 256, grammar=None,
        logprobs: int = -1, prompt_logprobs: int = -1):
    """Drive ``engine`` as the scheduler does (prompt chunks, then one token per step; a window backend gets whole
    prompts), with a matcher of ``grammar`` per sequence (its bitmask on every sampling feed, the sampled token
    accepted, the sequence done when the matcher is). Returns the sequences, and per sequence its generated tokens,
    its ``Feed.logprob`` per generated token, its prompt entries (absolute position -> (logprob, top)) and whether
    it finished by its constraint."""
    seqs = [Sequence(i, list(p), sampling) for i, p in enumerate(prompts)]
    matchers = [grammar.matcher() if grammar else None for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list] = [[] for _ in prompts]
    plps: list[dict] = [{} for _ in prompts]
    done = [False] * len(prompts)
    eos = engine.info.eos_token_ids
    for s in seqs:
        engine.add_sequence(s)
    active = list(seqs)
    for _ in range(10_000):
        if not active:
            break
        feeds = []
        for s in active:
            left = len(s.tokens) - s.n_cached
            take = min(left, chunk) if engine.batching == "continuous" else left
            f = Feed(s, s.tokens[s.n_cached:s.n_cached + take], take == left, logprobs=logprobs if take == left else -1,
                     prompt_logprobs=prompt_logprobs if s.n_cached < len(prompts[s.id]) else -1)
            if f.sample and matchers[s.id] is not None:
                f.mask = matchers[s.id].bitmask()
            feeds.append(f)
        for f, tok in zip(feeds, engine.step(feeds), strict=True):
            i = f.seq.id
            first = f.seq.n_cached - len(f.tokens)
            for j, entry in enumerate(f.prompt_out or []):
                plps[i].setdefault(first + j, entry)
            if tok is None:
                continue
            assert not isinstance(tok, BaseException), tok
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
    assert not active
    return seqs, outs, lps, plps, done


def json_grammar(engine):
    return compile_constraint(Constraint.json_schema(SCHEMA, strict=True), vocab_for(engine))


# -- masks ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=11),
                                      SamplingParams(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.2,
                                                     seed=5)], ids=["greedy", "t1", "filters"])
def test_json_schema_masks_always_validate(engine, sampling):
    assert engine.supports_masks
    grammar = json_grammar(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    _, outs, _, _, done = run(engine, prompts, 400, sampling, chunk=7, grammar=grammar)
    texts = []
    for out, finished in zip(outs, done, strict=True):
        assert finished, "the constraint did not complete within 400 tokens"
        eos = engine.info.eos_token_ids
        text = b"".join(engine.token_bytes(t) for t in out if t not in eos).decode()
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.append(text)
    if not sampling.greedy:
        assert len(set(texts)) > 1  # the draws differ between sequences: the mask did not force one output


def test_mask_with_every_token_banned_fails_that_sequence_only(fp32_dir):
    engine = make_engine(fp32_dir)
    mask = compile_constraint(Constraint.regex("[ab]+"), vocab_for(engine)).matcher().bitmask()
    allowed = {i for i in range(engine.info.n_vocab) if (mask[i >> 5] >> (i & 31)) & 1}
    assert 2 <= len(allowed) < 100
    bad = Sequence(1, engine.tokenize(PROMPTS[0]), SamplingParams(temperature=0.0, logit_bias=dict.fromkeys(allowed,
                                                                                                         -100)))
    good = Sequence(2, engine.tokenize(PROMPTS[1]), GREEDY)
    engine.add_sequence(bad)
    engine.add_sequence(good)
    out = engine.step([Feed(bad, list(bad.tokens), True, mask=mask), Feed(good, list(good.tokens), True, mask=mask)])
    assert isinstance(out[0], EngineError) and "logit_bias" in str(out[0]) and out[1] in allowed
    engine.unload()


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


def test_greedy_logprobs_equal_a_full_onnxruntime_pass(engine, reference):
    assert engine.supports_logprobs
    prompts = [engine.tokenize(p) for p in PROMPTS[:3]]
    seqs, outs, lps, _, _ = run(engine, prompts, 10, GREEDY, chunk=5, logprobs=4)
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
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                        logit_bias={boosted: 1.5})
    seqs, outs, lps, _, _ = run(engine, [prompt], 12, sp, logprobs=3)
    raw = reference.logits(seqs[0].tokens)
    for k, (tok, entry) in enumerate(zip(outs[0], lps[0], strict=True)):
        pos = len(prompt) - 1 + k
        row = penalise(raw[pos].copy(), seqs[0].tokens[:pos + 1], repetition=1.3, presence=0.4, frequency=0.3,
                       last_n=64, bias={boosted: 1.5})
        ref = log_softmax(row)
        assert tok == int(np.argmax(ref))
        check_entry(entry, ref, tok, 3)
    # temperature, top_k: logprobs stay those of the processed row before them; n = 0 gives no alternatives
    sp = SamplingParams(temperature=1.7, top_k=20, seed=3)
    seqs, outs, lps, _, _ = run(engine, [prompt], 12, sp, logprobs=0)
    raw = reference.logits(seqs[0].tokens)
    for k, (tok, (lp, top)) in enumerate(zip(outs[0], lps[0], strict=True)):
        ref = log_softmax(raw[len(prompt) - 1 + k])
        assert top == [] and abs(lp - ref[tok]) < TOL


def test_logprobs_under_a_mask_are_unmasked(engine, reference):
    """The mask decides what is sampled, not the logprobs: they are the model's, before the constraint."""
    grammar = json_grammar(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS[:2]]
    seqs, outs, lps, _, done = run(engine, prompts, 400, GREEDY, grammar=grammar, logprobs=2)
    assert all(done)
    for seq, prompt, out, entries in zip(seqs, prompts, outs, lps, strict=True):
        raw = reference.logits(seq.tokens)
        for k, (tok, entry) in enumerate(zip(out, entries, strict=True)):
            check_entry(entry, log_softmax(raw[len(prompt) - 1 + k]), tok, 2)
        # somewhere the constraint overrode the model's favourite token
        assert any(entry[1][0][0] != tok for tok, entry in zip(out, entries, strict=True))


def test_prompt_logprobs(engine, reference):
    assert engine.supports_prompt_logprobs
    prompts = [engine.tokenize(p) for p in PROMPTS]
    _, _, _, plps, _ = run(engine, prompts, 3, GREEDY, chunk=5, logprobs=1, prompt_logprobs=2)
    for prompt, entries in zip(prompts, plps, strict=True):
        assert sorted(entries) == list(range(len(prompt) - 1))  # every prompt position but the last, once
        raw = reference.logits(prompt)
        for p, entry in entries.items():
            check_entry(entry, log_softmax(raw[p]), prompt[p + 1], 2)


# -- backends ------------------------------------------------------------------------------------------------------
def test_flags_per_backend(int4_dir):
    assert OnnxEngine.supports_masks and OnnxEngine.supports_logprobs and OnnxEngine.supports_prompt_logprobs
    e = make_engine(int4_dir, backend="engine")
    assert not (e.supports_masks or e.supports_logprobs or e.supports_prompt_logprobs)
    e.unload()
    e = make_engine(int4_dir)
    assert e.supports_masks and e.supports_logprobs and e.supports_prompt_logprobs
    e.unload()


def test_int4_session_and_generator_agree(int4_dir):
    """Masks and logprobs on the int4 folder: the two octo-sampling backends give the same tokens and numbers."""
    results = []
    for backend in ("session", "generator"):
        e = make_engine(int4_dir, backend=backend)
        prompts = [e.tokenize(p) for p in PROMPTS[:3]]
        _, outs, lps, plps, done = run(e, prompts, 400, SamplingParams(temperature=1.0, seed=2),
                                       grammar=json_grammar(e), logprobs=2, prompt_logprobs=1)
        assert all(done)
        results.append((outs, lps, plps))
        e.unload()
    (o1, l1, p1), (o2, l2, p2) = results
    assert o1 == o2
    for a, b in zip(l1, l2, strict=True):
        np.testing.assert_allclose([x[0] for x in a], [x[0] for x in b], atol=TOL)
    for a, b in zip(p1, p2, strict=True):
        assert sorted(a) == sorted(b)
        np.testing.assert_allclose([a[k][0] for k in sorted(a)], [b[k][0] for k in sorted(b)], atol=TOL)


# -- chat template, special tokens ---------------------------------------------------------------------------------
TOOL_TEMPLATE = (
    "{%- if tools is not none %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% else %}(no tools)\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {
                                                "type": "string"}}, "required": ["city"]}}}]


def test_render_chat_with_tools_equals_transformers(fp32_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(fp32_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    e = make_engine(str(folder))
    assert e.chat_template() == TOOL_TEMPLATE
    hf = AutoTokenizer.from_pretrained(fp32_dir)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for tools in (TOOLS, None):
        want = hf.apply_chat_template(msgs, tools=tools, chat_template=TOOL_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
        assert e.render_chat(msgs, tools=tools) == want
    assert '"get_weather"' in e.render_chat(msgs, tools=TOOLS) and "(no tools)" in e.render_chat(msgs)
    e.unload()


def test_chat_template_and_special_tokens(int4_dir):
    e = make_engine(int4_dir)
    assert e.chat_template() == (Path(int4_dir) / "chat_template.jinja").read_text()
    special = e.special_tokens()
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(special)
    for text, tok in special.items():
        assert e.tokenize(text) == [tok] and e.token_bytes(tok) == b""
    assert vocab_for(e).token_for("<|im_start|>") == (special["<|im_start|>"], True)
    e.unload()
