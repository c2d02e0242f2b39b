"""Shapes of the synthetic models: one architecture description shared by every engine format."""

from __future__ import annotations

from dataclasses import dataclass

# Size of the locally trained tokenizer (learned byte-level BPE + 3 special tokens); see octo.synth.tokenizer.
TOKENIZER_VOCAB = 4096


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # "qwen2" or "llama"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    # layers from ``quiet_from`` on write ``quiet_scale`` x their attention and MLP outputs (o_proj, down_proj): they
    # barely change the residual stream, so a draft made of the first layers (same names, same weights) agrees with
    # the whole model (speculative decoding's constructed best case); None: every layer as usual
    quiet_from: int | None = None
    quiet_scale: float = 0.02
    # a shape changed since its builds were first cached gets a new revision: its builds go to a folder of their own
    # (``cache_name``), so an older build of the same name is never served for it
    revision: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"unknown architecture {self.arch!r} (expected 'qwen2' or 'llama')")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: heads do not divide hidden_size / KV heads")
        if self.vocab_size < TOKENIZER_VOCAB:
            raise ValueError(f"{self.name}: vocab_size {self.vocab_size} < tokenizer size {TOKENIZER_VOCAB}")

    @property
    def cache_name(self) -> str:
        """The name its builds are cached under (octo.synth.hf.default_dir)."""
        return f"{self.name}-r{self.revision}" if self.revision else self.name

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_bias(self) -> bool:
        """Qwen2 has biases on the q/k/v projections; Llama has none."""
        return self.arch == "qwen2"

    def num_parameters(self) -> int:
        h, f, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2 + ((h + 2 * kv) if self.attention_bias else 0)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return emb + self.num_hidden_layers * layer + h


SHAPES: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("tiny", "qwen2", 64, 128, 2, 4, 2, TOKENIZER_VOCAB, 2048, 1e6, 1e-6, True),
        # a context real models have (32768 positions, Qwen2.5's), so that long conversations (a chat client's tool
        # definitions alone can take 18k of its tokens) fit; revision 1: the earlier demo had 4096
        ModelSpec("demo", "qwen2", 256, 704, 4, 4, 2, TOKENIZER_VOCAB, 32768, 1e6, 1e-6, True, revision=1),
        ModelSpec("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, 32768, 1e6, 1e-6, True),
        # Llama 3.2 uses "llama3" RoPE scaling; the synthetic one uses plain RoPE so every engine agrees.
        ModelSpec("llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, 131072, 500000.0, 1e-5, True),
    )
}


def get_spec(name: str | ModelSpec) -> ModelSpec:
    if isinstance(name, ModelSpec):
        return name
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown synthetic model shape {name!r}; known shapes: {', '.join(SHAPES)}"
        ) from None
