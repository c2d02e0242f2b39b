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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octo.chat_template import ChatTemplate
from octo.errors import ConfigError, InvalidRequest
from octo.tokenbytes import TokenizerText


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


class TextCodec(TokenizerText):
    """Tokenizer, token bytes and chat template of one folder."""

    def __init__(self, folder: Path, n_vocab: int) -> None:
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"'{folder}' has no tokenizer.json (the onnx engine needs a Hugging Face fast "
                              "tokenizer file).")
        super().__init__(Tokenizer.from_file(str(path)), n_vocab)
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

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self.template is None:
            raise InvalidRequest("This model has no chat template; use /v1/completions.", param="messages")
        return self.template.render(messages, add_generation_prompt, tools=tools, documents=None)



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
