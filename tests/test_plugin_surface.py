"""The helpers the plugin surface gives every engine: typed options, the HF chat-template environment, token text."""

from __future__ import annotations

import pytest

from octo.chat_template import ChatTemplate
from octo.errors import ConfigError, InvalidRequest
from octo.options import Option, auto_bool, choice, parse_engine_options, positive_int, probability

SPEC = {"n_ctx": Option(positive_int, "context"), "mode": (choice("a", "b"), "a mode"), "p": probability,
        "auto": auto_bool}


def test_options_convert_and_name_the_key():
    assert parse_engine_options("x", SPEC, {"n_ctx": "8", "mode": "B", "p": "0.5", "auto": "yes"}) == {
        "n_ctx": 8, "mode": "b", "p": 0.5, "auto": "true"}
    with pytest.raises(ConfigError, match="Unknown option 'bogus' for engine x; known options: auto, mode, n_ctx, p"):
        parse_engine_options("x", SPEC, {"bogus": "1"})
    for key, value, words in [("n_ctx", "0", "positive integer"), ("n_ctx", "ten", "invalid literal"),
                              ("mode", "c", "expected one of a, b"), ("p", "2", "between 0 and 1")]:
        with pytest.raises(ConfigError, match=words) as err:
            parse_engine_options("x", SPEC, {key: value})
        assert err.value.param == key


def test_chat_template_is_transformers_environment():
    source = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
              "{{ bos_token }}{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"
              "{% if add_generation_prompt %}>{% endif %}{% if tools is defined %}{{ tools | length }}{% endif %}")
    t = ChatTemplate(source, "<s>", "</s>")
    assert t.render([{"role": "user", "content": "héllo"}]) == '<s>"héllo"!>'
    assert t.render([{"role": "user", "content": "x"}], False, tools=[{}, {}]) == '<s>"x"!2'
    with pytest.raises(InvalidRequest, match="no bad roles") as err:
        t.render([{"role": "bad", "content": "x"}])
    assert err.value.param == "messages"


def test_token_text_encodes_and_maps_bytes():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    from octo.tokenbytes import TokenizerText

    tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|x|>"])
    text = TokenizerText(tok, n_vocab=3)
    assert text.n_vocab == 4
    assert text.tokenize("ab<|x|>") == [2, 3]
    assert text.tokenize("ab", special=False) == [2]
    assert text.special_tokens() == {"<|x|>": 3}
    assert text.token_bytes(2) == b"ab" and text.token_bytes(3) == b"" and text.token_bytes(99) == b""
