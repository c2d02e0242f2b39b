"""An onnxruntime-genai model folder: ``genai_config.json``, the decoder ONNX file, tokenizer and chat template.

Text goes through the folder's ``tokenizer.json`` with the ``tokenizers`` library (the same file
onnxruntime-genai's own tokenizer reads; the tests check both encode alike): one copy parses special-token text,
a clone encodes it as plain text. Token bytes follow the tokenizer's decoder: byte-level BPE (GPT-2 byte map),
SentencePiece (``▁`` is a space, ``<0xNN>`` a byte), else the token's decoded text. The chat template is the
folder's ``chat_template.jinja`` (where onnxruntime-genai's model builder writes it) or ``tokenizer_config.json``'s
``chat_template``, rendered with jinja2 the way transformers renders it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from octo.errors import ConfigError, InvalidRequest
from octo.tokenbytes import decoder_kind, token_byte_table


@dataclass
class DecoderSpec:
    """The decoder section of ``genai_config.json``."""

    filename: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    model_type: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    share_buffer: bool = True
    session_options: dict[str, Any] = field(default_factory=dict)
    providers: list[str] = field(default_factory=list)

    def past_names(self, layer: int) -> tuple[str, str]:
        return self.inputs["past_key_names"] % layer, self.inputs["past_value_names"] % layer

    def present_names(self, layer: int) -> tuple[str, str]:
        return self.outputs["present_key_names"] % layer, self.outputs["present_value_names"] % layer


def read_config(folder: Path) -> tuple[DecoderSpec, dict]:
    path = folder / "genai_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        model = cfg["model"]
        dec = model["decoder"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"'{folder}' is not an onnxruntime-genai model folder ({path.name}: {e}).") from None
    eos = model.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    providers = [next(iter(p)) for p in (dec.get("session_options") or {}).get("provider_options") or [] if p]
    try:
        spec = DecoderSpec(
            filename=dec["filename"],
            num_layers=int(dec["num_hidden_layers"]),
            num_kv_heads=int(dec["num_key_value_heads"]),
            head_size=int(dec["head_size"]),
            context_length=int(model["context_length"]),
            vocab_size=int(model["vocab_size"]),
            eos_token_ids=frozenset(int(t) for t in eos_ids),
            pad_token_id=model.get("pad_token_id"),
            model_type=str(model.get("type", "?")),
            inputs=dict(dec.get("inputs") or {}),
            outputs=dict(dec.get("outputs") or {}),
            share_buffer=bool((cfg.get("search") or {}).get("past_present_share_buffer", False)),
            session_options=dict(dec.get("session_options") or {}),
            providers=providers,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: incomplete decoder section ({type(e).__name__}: {e}).") from None
    if not (folder / spec.filename).is_file():
        raise ConfigError(f"{path}: the decoder file '{spec.filename}' is missing.")
    return spec, cfg


class TextCodec:
    """Tokenizer, token bytes and chat template of one folder."""

    def __init__(self, folder: Path, n_vocab: int) -> None:
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"'{folder}' has no tokenizer.json (the onnx engine needs a Hugging Face fast "
                              "tokenizer file).")
        self._special = Tokenizer.from_file(str(path))
        self._plain = Tokenizer.from_file(str(path))
        self._plain.encode_special_tokens = True
        self.n_vocab = max(n_vocab, self._special.get_vocab_size(with_added_tokens=True))
        self.kind = decoder_kind(json.loads(path.read_text(encoding="utf-8")))
        self._bytes: list[bytes] | None = None
        self._lock = threading.Lock()
        tcfg = _read_json(folder / "tokenizer_config.json")
        source = None
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(tcfg.get("chat_template"), str):
            source = tcfg["chat_template"]
        elif isinstance(tcfg.get("chat_template"), list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in tcfg["chat_template"] if isinstance(t, dict)}
            source = named.get("default")
        self.template_source = "chat_template.jinja" if (folder / "chat_template.jinja").is_file() else (
            "tokenizer_config.json" if source else None)
        self.template = ChatTemplate(source, _token_text(tcfg.get("bos_token")),
                                     _token_text(tcfg.get("eos_token"))) if source else None

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        tok = self._special if special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token: int) -> bytes:
        table = self._bytes if self._bytes is not None else self._table()
        return table[token] if 0 <= token < len(table) else b""

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self.template is None:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="messages")
        return self.template.render(messages, add_generation_prompt, tools)

    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special added tokens (control tokens: their bytes are b"") by their text."""
        return {t.content: int(i) for i, t in self._special.get_added_tokens_decoder().items()
                if t.special and 0 <= int(i) < self.n_vocab}

    def _table(self) -> list[bytes]:
        with self._lock:
            if self._bytes is None:
                self._bytes = self._build_table()
        return self._bytes

    def _build_table(self) -> list[bytes]:
        return token_byte_table(self._special, self.n_vocab, self.kind)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class ChatTemplate:
    """transformers' chat-template environment: sandboxed, trim/lstrip blocks, loop controls, ``tojson``,
    ``raise_exception``, ``strftime_now`` and a pass-through ``{% generation %}`` tag."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template over ``messages``; ``tools`` is the template's ``tools`` variable (None when not given, as
        transformers' ``apply_chat_template`` passes it, so ``tools is not none`` tests work)."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise InvalidRequest(f"The model's chat template rejected the messages: {e}",
                                 param="messages") from None
