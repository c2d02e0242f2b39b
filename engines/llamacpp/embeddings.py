"""Embeddings with a pooling GGUF: as many inputs as fit one ``llama_decode`` per call, one sequence id each, and the
pooled vector of each sequence, L2-normalised."""

from __future__ import annotations

from typing import Any

from octo.engine import Embeddings
from octo.errors import ContextLengthExceeded, EngineError, InvalidRequest

from .native import LogTap


def embed_texts(engine: Any, texts: list[str]) -> Embeddings:
    """Embeddings of ``texts`` on a loaded embedding model (``engine.is_embedding``)."""
    import numpy as np

    L = engine.lib
    inputs = [engine.tokenize(t, special=False) for t in texts]
    limit = min(engine.n_ctx_seq, engine.n_batch)
    for i, toks in enumerate(inputs):
        if not toks:
            raise InvalidRequest(f"Input {i} is empty.", param="input")
        if len(toks) > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens; input {i} has {len(toks)} tokens.",
                param="input",
            )
    n_embd = engine.info.embedding_dim
    vectors: list[list[float]] = [[] for _ in texts]
    b, start = engine.batch, 0
    while start < len(inputs):  # pack as many inputs as fit one llama_decode call
        group, n = [], 0
        while (
            start + len(group) < len(inputs)
            and len(group) < engine.config.max_batch
            and n + len(inputs[start + len(group)]) <= b.capacity
        ):
            n += len(inputs[start + len(group)])
            group.append(start + len(group))
        n = 0
        for sid, i in enumerate(group):
            k = len(inputs[i])
            b.token[n : n + k] = inputs[i]
            b.pos[n : n + k] = range(k)
            b.seq[n : n + k] = sid
            b.logits[n : n + k] = 1
            n += k
        b.struct.n_tokens = n
        if engine.mem:
            L.llama_memory_clear(engine.mem, True)
        rc = L.llama_decode(engine.ctx, b.struct)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} while embedding: {LogTap.tail()}")
        for sid, i in enumerate(group):
            ptr = L.llama_get_embeddings_seq(engine.ctx, sid)
            if not ptr:
                raise EngineError("llama.cpp returned no pooled embedding")
            v = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
            norm = float(np.linalg.norm(v))
            vectors[i] = (v / norm if norm > 0 else v).tolist()
        start += len(group)
    return Embeddings(vectors=vectors, n_tokens=sum(len(t) for t in inputs))
