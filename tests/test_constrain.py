"""The constraint layer (octo.text.constrain) on llguidance, proven with random walks.

A random "model" samples uniformly among the tokens each mask allows (fixed seeds, many runs); every finished output
must parse and validate (jsonschema) against its schema, and every tool-call output must parse into calls of the
offered functions whose arguments validate. Vocabularies: the trained synthetic 4k tokenizer, the same padded to
the 151,936 rows of the synthetic qwen2.5-0.5b shape, a dense generated 151,936-token vocabulary (timings), and the
tiny GGUF through the llama.cpp engine.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="llguidance is not installed (pip install llguidance): no constraints")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")

os.environ.setdefault("OCTO_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "octo-test"))

from octo.errors import InvalidRequest  # noqa: E402
from octo.text.constrain import (  # noqa: E402
    Constraint,
    Vocab,
    apply_bitmask,
    build_vocab,
    compile_constraint,
    fill_masks,
    vocab_for,
)
from octo.text.grammars import _closed  # noqa: E402
from octo.text.toolcalls import FORMATS, parse_tool_calls  # noqa: E402

EOS, EOS2 = 4095, 4093  # <|im_end|>, <|endoftext|> of the synthetic tokenizer
BIG = 151_936

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": ["number", "null"], "maximum": 1e6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", 3]},
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "where": {"$ref": "#/$defs/place"},
        "either": {"anyOf": [{"type": "integer", "minimum": 5, "maximum": 9}, {"const": "none"}]},
    },
    "required": ["name", "age", "score", "ok", "kind", "day", "code", "tags", "where", "either"],
    "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["tz"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: {}
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


# -- vocabularies ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def table() -> list[bytes]:
    from octo.synth.tokenizer import load_tokenizer
    from octo.tokenbytes import token_byte_table

    return token_byte_table(load_tokenizer(), 4096, "bytelevel")


@pytest.fixture(scope="module")
def small(table) -> Vocab:
    return build_vocab(table, 4096, [EOS, EOS2])


@pytest.fixture(scope="module")
def padded(table) -> Vocab:
    """The synthetic qwen2.5-0.5b shape: the 4k tokenizer in a 151,936-row output layer (rows past it: b"")."""
    return build_vocab(lambda i: table[i] if i < len(table) else b"", BIG, [EOS, EOS2])


def dense_tokens(n: int = BIG, seed: int = 0) -> list[bytes]:
    """A dense n-token vocabulary: the trained tokens plus generated words (with leading spaces and capitals), CJK
    characters and pairs, punctuation runs and whitespace runs; last 3 rows are special (b"")."""
    from octo.synth.tokenizer import _WORDS, _pseudo_words, load_tokenizer
    from octo.tokenbytes import token_byte_table

    out = token_byte_table(load_tokenizer(), 4096, "bytelevel")[:4093]
    seen, rng = set(out), random.Random(seed)

    def add(b: bytes) -> None:
        if b and b not in seen and len(out) < n - 3:
            seen.add(b)
            out.append(b)

    for k in range(1, 33):
        add(b" " * k)
        add(b"\n" + b" " * k)
    for w in _WORDS:
        for v in (w, " " + w, w.capitalize(), " " + w.capitalize()):
            add(v.encode())
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 12000)]
    for c in cjk:
        add(c.encode())
    for _ in range(3000):
        add((rng.choice(cjk) + rng.choice(cjk)).encode())
    punct = list("()[]{}<>:;.,!?\"'=+-*/\\_#@$%&|^~`")
    for _ in range(6000):
        add("".join(rng.choice(punct) for _ in range(rng.randint(2, 4))).encode())
    while len(out) < n - 3:
        for w in _pseudo_words(rng, 5000):
            r = rng.random()
            add((w if r < 0.3 else " " + w if r < 0.8 else " " + w.capitalize() if r < 0.95 else w.upper()).encode())
    return out + [b"", b"", b""]


@pytest.fixture(scope="module")
def dense_table() -> list[bytes]:
    return dense_tokens()


@pytest.fixture(scope="module")
def dense(dense_table) -> Vocab:
    t = time.perf_counter()
    vocab = build_vocab(dense_table, BIG, [BIG - 1])
    print(f"\n[timing] Vocab build, dense {BIG:,}-token vocabulary: {time.perf_counter() - t:.2f} s")
    return vocab


@pytest.fixture(scope="module")
def gguf_engine():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")
    from octo.engines.llamacpp import LlamaCppEngine

    from octo.engine import EngineConfig
    from octo.synth.gguf import build_gguf

    engine = LlamaCppEngine(EngineConfig(max_batch=2))
    engine.load(str(build_gguf("tiny", ftype="q8_0")), "tiny")
    yield engine
    engine.unload()


@pytest.fixture(params=["small", "padded", "gguf"])
def any_vocab(request, table):
    """(vocab, bytes of each token) for the three vocabularies random walks run on."""
    if request.param == "gguf":
        engine = request.getfixturevalue("gguf_engine")
        return vocab_for(engine), [engine.token_bytes(i) for i in range(engine.info.n_vocab)]
    vocab = request.getfixturevalue(request.param)
    return vocab, [table[i] if i < len(table) else b"" for i in range(vocab.n_vocab)]


# -- the random "model" -------------------------------------------------------------------------------------------
def walk(grammar, tokens: list[bytes], rng: np.random.Generator, max_tokens: int = 700, stop_p: float = 0.3,
         prefix: list[int] = ()):
    """Sample uniformly among allowed tokens until done (or EOS, or a random stop where the output may end).
    Returns (text, matcher, finished). Checks on every step that only EOS among special tokens is ever allowed."""
    m = grammar.matcher()
    vocab = grammar.vocab
    assert m.accept_tokens(list(prefix)) == len(prefix), m.error
    out = list(prefix)
    finished = False
    for _ in range(max_tokens):
        if m.is_done():
            finished = True
            break
        allowed = m.allowed_tokens()
        assert len(allowed), "a live matcher must allow something"
        empty = [t for t in allowed if not tokens[t]]
        assert set(empty) <= set(vocab.eos_ids), f"special/padding tokens allowed: {empty[:5]}"
        if m.accepting() and rng.random() < stop_p:
            finished = True
            break
        t = int(rng.choice(allowed))
        assert m.accept(t), m.error
        if t in vocab.eos_ids:
            assert m.is_done()
            finished = True
            break
        out.append(t)
    assert m.error is None
    text = b"".join(tokens[t] for t in out)
    return text.decode("utf-8") if finished else text.decode("utf-8", "replace"), m, finished


# -- JSON --------------------------------------------------------------------------------------------------------
def test_json_schema_random_walks_validate(any_vocab):
    vocab, tokens = any_vocab
    grammar = compile_constraint(Constraint.json_schema(SCHEMA, strict=True), vocab)
    rng = np.random.default_rng(1234)
    runs = 12 if vocab.n_vocab > 10_000 else 30
    done = 0
    for _ in range(runs):
        text, m, finished = walk(grammar, tokens, rng)
        if finished:
            assert m.accepting()
            jsonschema.validate(json.loads(text), SCHEMA)
            done += 1
    assert done >= runs * 2 // 3, f"only {done}/{runs} walks finished"


def test_json_object_and_non_strict_schema(small, table):
    rng = np.random.default_rng(7)
    grammar = compile_constraint(Constraint.json_object(), small)
    for _ in range(20):
        text, _, finished = walk(grammar, table, rng, stop_p=0.5)
        if finished:
            assert isinstance(json.loads(text), dict)
    # non-strict: optional properties optional; an object that lists its properties gets no others unless it says
    # so (llama.cpp's and xgrammar's rule: an open object lets a model write keys forever)
    loose = {"type": "object", "properties": {"a": {"type": "integer"}, "c": {"type": "string"}}, "required": ["a"]}
    m = compile_constraint(Constraint.json_schema(loose), small).matcher()
    text = '{"a": 1, "b": [true]}'
    assert m.accept_tokens(small.ll.tokenize_str(text)) < len(small.ll.tokenize_str(text))
    m = compile_constraint(Constraint.json_schema(loose), small).matcher()
    assert m.accept_tokens(small.ll.tokenize_str('{"a": 1}')) == len(small.ll.tokenize_str('{"a": 1}'))
    assert m.accepting() and m.is_done()
    opened = {**loose, "additionalProperties": True}
    m = compile_constraint(Constraint.json_schema(opened), small).matcher()
    assert m.accept_tokens(small.ll.tokenize_str(text)) == len(small.ll.tokenize_str(text))
    assert m.accepting() and m.is_done()
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    nested = {"type": "object", "properties": {"properties": inner}}
    closed = _closed(nested)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property named "properties" is not a schema key


def test_dense_vocab_walks_and_timing(dense, dense_table):
    grammar = compile_constraint(Constraint.json_schema(SCHEMA, strict=True), dense)
    rng = np.random.default_rng(99)
    times: list[float] = []
    for _ in range(6):
        m = grammar.matcher()
        out: list[int] = []
        row = dense.new_bitmask()[0]
        while not m.is_done() and len(out) < 500:
            t0 = time.perf_counter()
            m.fill(row)
            times.append(time.perf_counter() - t0)
            if m.accepting():
                break
            tok = int(rng.choice(m.allowed_tokens()))
            assert m.accept(tok)
            out.append(tok)
        if m.accepting():
            jsonschema.validate(json.loads(b"".join(dense_table[t] for t in out)), SCHEMA)
    logits = np.random.default_rng(0).standard_normal(BIG).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        grammar.matcher().apply(logits.copy())
    apply_ms = (time.perf_counter() - t0) / 20 * 1e3
    ms = np.array(times) * 1e3
    print(f"\n[timing] mask per token on {BIG:,} tokens: median {np.median(ms):.3f} ms, mean {ms.mean():.3f} ms, "
          f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms over {len(ms)} steps; "
          f"matcher copy + mask + apply to logits {apply_ms:.3f} ms")
    assert np.median(ms) < 5.0  # loose: catches a lost optimisation (slices), not a slow CI host


# -- other constraints ---------------------------------------------------------------------------------------------
def test_regex_lark_gbnf(small, table):
    rng = np.random.default_rng(3)
    cases = [
        (Constraint.regex(r"[a-c]{2,5}-[0-9]+"), lambda s: re.fullmatch(r"[a-c]{2,5}-[0-9]+", s)),
        (Constraint.lark('start: "yes" | "no" | "n=" /[0-9]{1,3}/'), lambda s: re.fullmatch(r"yes|no|n=[0-9]{1,3}", s)),
        (Constraint.gbnf('root ::= "(" [a-z]+ ")"'), lambda s: re.fullmatch(r"\([a-z]+\)", s)),
    ]
    for constraint, ok in cases:
        grammar = compile_constraint(constraint, small)
        for _ in range(15):
            text, _, finished = walk(grammar, table, rng, stop_p=0.4)
            if finished:
                assert ok(text), (constraint.kind, text)


def test_special_tokens_only_eos(small, padded, table):
    grammar = compile_constraint(Constraint.regex(r"(.|\n)*"), small)
    allowed = set(grammar.matcher().allowed_tokens().tolist())
    assert {EOS, EOS2} <= allowed  # the empty output is complete: both EOS ids
    assert 4094 not in allowed  # <|im_start|>
    m = compile_constraint(Constraint.regex(r"(.|\n)*"), padded).matcher()
    assert m.allowed_tokens().max() < 4096  # padding rows never
    m = compile_constraint(Constraint.regex(r"ab"), small).matcher()
    assert EOS not in set(m.allowed_tokens().tolist())
    ab = small.ll.tokenize_str("ab")
    assert m.accept_tokens(ab) == len(ab)
    assert m.accepting() and m.is_done()
    assert m.accept(EOS2)  # the second EOS id is accepted like the first


def test_forbidden_token_leaves_state(small):
    m = compile_constraint(Constraint.regex(r"[0-9]+"), small).matcher()
    letter = small.ll.tokenize_str("x")[0]
    digit = small.ll.tokenize_str("7")[0]
    assert not m.accept(letter)  # without a computed mask (validated)
    m.mask()
    assert not m.accept(letter)  # with the mask computed
    assert not m.accept(EOS)  # nothing yet: not complete
    assert m.error is None and m.accept(digit) and m.accepting()


def test_rollback_and_forced_tokens(small):
    grammar = compile_constraint(Constraint.lark('start: "The answer is " /[0-9]+/ "."'), small)
    m = grammar.matcher()
    assert m.forced_bytes() == b"The answer is "
    forced = m.forced_tokens()
    assert forced and small.ll.decode_bytes(forced) == b"The answer is "[:len(small.ll.decode_bytes(forced))]
    assert m.accept_tokens(forced) == len(forced)
    before = m.mask().copy()
    assert m.accept(small.ll.tokenize_str("4")[0]) and m.accept(small.ll.tokenize_str("2")[0])
    m.rollback(2)
    assert (m.mask() == before).all() and m.n_tokens == len(forced)
    with pytest.raises(ValueError):
        m.rollback(m.n_tokens + 1)
    twin = m.copy()
    assert twin.accept(small.ll.tokenize_str("1")[0]) and not m.accepting()


def test_grammar_and_vocab_caches(small, table):
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    g1, g2 = compile_constraint(c, small), compile_constraint(c, small)
    assert g1 is g2
    m1, m2 = g1.matcher(), g1.matcher()
    assert m1.accept(small.ll.tokenize_str("{")[0])
    assert m2.n_tokens == 0 and m2.accept_tokens(small.ll.tokenize_str("{}")) == len(small.ll.tokenize_str("{}"))
    assert build_vocab(table, 4096, [EOS, EOS2]) is small

    class Engine:  # the parts of the engine contract vocab_for reads
        def __init__(self, info):
            self.info = info

        def token_bytes(self, i):
            return table[i]

    from octo.engine import ModelInfo

    engine = Engine(ModelInfo("x", 512, frozenset({EOS, EOS2}), 4096))
    assert vocab_for(engine) is vocab_for(engine) is small


# -- masks on logits ---------------------------------------------------------------------------------------------
def test_apply_bitmask_matches_reference():
    rng = np.random.default_rng(5)
    n = 1000
    words = rng.integers(-(2**31), 2**31 - 1, size=(3, (n + 31) // 32), dtype=np.int64).astype(np.int32)
    words[:, -1] &= (1 << (n % 32)) - 1  # bits past the vocabulary are 0, as llguidance leaves them
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little", axis=1)[:, :n].astype(bool)
    for dtype in (np.float32, np.float64):
        logits = rng.standard_normal((3, n + 40)).astype(dtype)  # wider than the vocabulary: extra columns go
        expect = np.where(np.pad(allowed, ((0, 0), (0, 40))), logits, -np.inf)
        got = logits.copy()
        apply_bitmask(got, words)
        np.testing.assert_array_equal(got, expect)
        row = logits[1, :n].copy()
        apply_bitmask(row, words[1])
        np.testing.assert_array_equal(row, expect[1, :n])


def test_fill_masks_batch(small):
    g1 = compile_constraint(Constraint.regex(r"[0-9]+"), small)
    g2 = compile_constraint(Constraint.json_object(), small)
    ms = [g1.matcher(), None, g2.matcher()]
    serial = fill_masks(ms, parallel=False)
    parallel = fill_masks(ms, parallel=True)
    np.testing.assert_array_equal(serial, parallel)
    assert (serial[1] == -1).all()
    np.testing.assert_array_equal(serial[0], ms[0].bitmask())
    logits = np.zeros((3, 4096), dtype=np.float32)
    apply_bitmask(logits, serial)
    assert np.isfinite(logits[1]).all()
    assert set(np.flatnonzero(np.isfinite(logits[0]))) == set(ms[0].allowed_tokens().tolist())


# -- tool calls ----------------------------------------------------------------------------------------------------
def _check_calls(text: str, fmt: str, names: set[str], parallel: bool) -> list[dict]:
    parsed = parse_tool_calls(text, fmt, [t["function"]["name"] for t in TOOLS])
    assert parsed.content == "", (fmt, text)
    assert parsed.tool_calls, (fmt, text)
    if not parallel:
        assert len(parsed.tool_calls) == 1
    for call in parsed.tool_calls:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])
    return parsed.tool_calls


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tool_call_grammars_give_valid_calls(fmt, small, table):
    rng = np.random.default_rng(11)
    all_names = {t["function"]["name"] for t in TOOLS}
    for choice, names in (("required", all_names), ({"type": "function", "function": {"name": "get_weather"}},
                                                    {"get_weather"})):
        for parallel in (True, False):
            grammar = compile_constraint(Constraint.tool_calls(TOOLS, choice, parallel, fmt), small)
            seen = 0
            for _ in range(8):
                text, _, finished = walk(grammar, table, rng, stop_p=0.5)
                if finished:
                    seen += len(_check_calls(text, fmt, names, parallel))
            assert seen >= 4


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tool_choice_auto(fmt, small, table):
    """Free text is allowed; once the call's opening text is there, the call must be valid."""
    rng = np.random.default_rng(5)
    grammar = compile_constraint(Constraint.tool_calls(TOOLS, "auto", True, fmt), small)
    fmt_ = FORMATS[fmt]
    if fmt in ("llama3", "mistral", "phi4"):  # no marker token in this vocabulary: a bare call at the start
        opening = "{" if fmt == "llama3" else "["
    else:
        opening = "Let me check. " + fmt_.begin + fmt_.call_open
    prefix = small.ll.tokenize_str(opening)
    for _ in range(6):
        text, _, finished = walk(grammar, table, rng, stop_p=0.7, prefix=prefix)
        if finished and fmt in ("llama3", "mistral", "phi4"):
            _check_calls(text, fmt, {t["function"]["name"] for t in TOOLS}, True)
        elif finished:
            parsed = parse_tool_calls(text, fmt, PARAMS)
            assert parsed.tool_calls and parsed.content.startswith("Let me check.")
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
    for _ in range(5):  # plain text answers stay possible
        walk(grammar, table, rng, stop_p=0.3)


def test_tool_markers_as_special_tokens(table):
    """With the marker a named special token (as in Mistral's vocabulary), the grammar emits that token."""
    vocab = build_vocab(table + [b"", b""], 4098, [EOS], {"[TOOL_CALLS]": 4096, "<|tool_call|>": 4097})
    text_of = list(table) + [b"[TOOL_CALLS]", b"<|tool_call|>"]  # as an engine keeping the markers decodes them
    rng = np.random.default_rng(2)
    for fmt, marker in (("mistral", 4096), ("phi4", 4097)):
        grammar = compile_constraint(Constraint.tool_calls(TOOLS, "required", True, fmt), vocab)
        assert grammar.matcher().allowed_tokens().tolist() == [marker]
        for _ in range(4):
            text, _, finished = walk(grammar, text_of, rng, stop_p=0.5)
            if finished:
                assert text.startswith(text_of[marker].decode())
                _check_calls(text, fmt, {t["function"]["name"] for t in TOOLS}, True)


# -- errors ------------------------------------------------------------------------------------------------------
def _error(constraint, vocab) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        compile_constraint(constraint, vocab)
    return info.value


def test_unsupported_keywords_are_relaxed_and_broken_schemas_refused(small, caplog):
    """Keywords llguidance does not implement are relaxed with a warning (not enforced: a looser, still valid
    constraint), unless strict mode asks for exactly the schema; schemas that cannot compile are a 400."""
    p = "response_format.json_schema.schema"
    for schema, words in (
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "string", "format": "color"}, "format"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, "propertyNames"),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="octo.text.grammars"):
            grammar = compile_constraint(Constraint.json_schema(schema), small)
        assert grammar is not None and words in caplog.text and p in caplog.text, caplog.text
    for schema, words in (
        ({"type": "string", "pattern": "^(?=a)a+$"}, "look-around"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "strin"}, "strin"),
    ):
        err = _error(Constraint.json_schema(schema), small)
        assert err.param == p and words in err.message and err.status == 400, err.message
    strict = {"type": "object", "properties": {"a": {"type": "string", "format": "color"}}, "required": ["a"],
              "additionalProperties": False}
    err = _error(Constraint.json_schema(strict, strict=True), small)
    assert err.param == p and "format" in err.message


def test_only_the_forced_tools_schemas_are_compiled(small, caplog):
    """A forced tool compiles its own schema only: another tool's unsupported (or broken) schema is not a 400."""
    good = {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    broken = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    zod = {"type": "function", "function": {"name": "env", "parameters": {
        "type": "object", "properties": {"vars": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                                                  "additionalProperties": {"type": "string"}}}}}}
    named = {"type": "function", "function": {"name": "read"}}
    assert compile_constraint(Constraint.tool_calls([good, broken, zod], named), small) is not None
    err = _error(Constraint.tool_calls([good, broken], "required"), small)
    assert err.param == "tools[1].function.parameters" and "strin" in err.message
    with caplog.at_level("WARNING", logger="octo.text.grammars"):
        compile_constraint(Constraint.tool_calls([good, zod], {"type": "function", "function": {"name": "env"}}),
                           small)
    assert "tools[1].function.parameters" in caplog.text and "propertyNames" in caplog.text


def test_strict_mode_rules(small):
    p = "response_format.json_schema.schema"
    no_additional = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    err = _error(Constraint.json_schema(no_additional, strict=True), small)
    assert err.param == p and "additionalProperties" in err.message
    nested = {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                    "y": {"type": "integer"}},
                                                     "required": ["x"], "additionalProperties": False}},
              "required": ["o"], "additionalProperties": False}
    err = _error(Constraint.json_schema(nested, strict=True), small)
    assert "Missing 'y'" in err.message and "'properties', 'o'" in err.message
    err = _error(Constraint.json_schema({"type": "array", "items": {"type": "string"}}, strict=True), small)
    assert "root" in err.message
    compile_constraint(Constraint.json_schema(no_additional, strict=False), small)  # fine without strict


def test_response_format_mapping(small):
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}).kind == "json_object"
    c = Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                                 "schema": SCHEMA}})
    assert (c.kind, c.strict, c.param) == ("json_schema", True, "response_format.json_schema.schema")
    c = Constraint.from_response_format({"type": "json_schema", "name": "x", "schema": SCHEMA}, param="text.format")
    assert c.param == "text.format.schema"  # the Responses API's flat form
    with pytest.raises(InvalidRequest) as info:
        Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest) as info:
        Constraint.from_response_format({"type": "yaml"})
    assert info.value.param == "response_format.type"



def test_bad_tools_and_grammars(small):
    bad_params = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                          "properties": {"a": {
                                                                                              "$ref": "#/x"}}}}}]
    assert _error(Constraint.tool_calls(bad_params), small).param == "tools[1].function.parameters"
    strict_tool = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}]
    assert _error(Constraint.tool_calls(strict_tool), small).param == "tools[0].function.parameters"
    named = {"type": "function", "function": {"name": "nope"}}
    assert _error(Constraint.tool_calls(TOOLS, named), small).param == "tool_choice"
    assert _error(Constraint.tool_calls(TOOLS, "sometimes"), small).param == "tool_choice"
    assert _error(Constraint.tool_calls([TOOLS[1], TOOLS[1]]), small).param == "tools[1].function.name"
    assert _error(Constraint.tool_calls([{"type": "function", "function": {"name": "a b"}}]), small).param == \
        "tools[0].function.name"
    assert _error(Constraint.tool_calls([]), small).param == "tools"
    not_object = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    assert _error(Constraint.tool_calls(not_object), small).param == "tools[0].function.parameters"
    assert Constraint.tool_calls(TOOLS, "none") is None
    assert _error(Constraint.regex("a(b"), small).param == "regex"
    assert _error(Constraint.lark("start: undefined_rule"), small).param == "grammar"
    assert _error(Constraint.gbnf("root ::= ("), small).param == "grammar"
