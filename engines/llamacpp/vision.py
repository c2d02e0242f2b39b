"""Images on the llama.cpp engine, through libmtmd (``llama_cpp.mtmd_cpp``): the projector (``mmproj``) of a
vision-language GGUF, the prompt's tokens cut at its images, their encodes, and their embeddings in the batch.

The projector is the ``mmproj`` option (what ``--mmproj`` passes) or, by default, the one ``mmproj*.gguf`` file beside
the model's GGUF (the layout of llama.cpp's ``-hf`` downloads, LM Studio's folders and octo's catalog); ``mmproj=none``
serves the model as text only. A projector that does not load fails the model's load, saying so (libmtmd's own
warm-up encode runs at load). A model whose projector positions images with M-RoPE (the Qwen2-VL family) is not served
with it yet: its image positions are not the token positions the scheduler counts.

``tokenize`` runs ``mtmd_tokenize_from_parts`` on the rendered prompt's text parts and images (RGB pixels from the
serving layer, each with its SHA-256 as libmtmd's bitmap id): text chunks give their tokens, an image chunk its
placeholder ids (``octo.engine.media_token_ids``) and a copy of the chunk (its preprocessed pixels) for the encode.
``encode`` runs ``mtmd_encode_chunk`` on the scheduler's encode thread (libmtmd's own context, never the serving
one) and copies the embeddings out. ``step`` decodes each image feed as a batch of embeddings of its own (llama.cpp's
batch holds tokens or embeddings, not both) with the attention the model wants (Gemma 3: non-causal inside the
image), then the text feeds as one batch through the engine's ordinary step.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

from octo.engine import Feed, MediaChunk, MediaInput, media_token_ids
from octo.errors import ConfigError, ContextLengthExceeded, EngineError, InvalidRequest, KVCacheFull

from . import logits as lg
from .native import LogTap, check_gguf

log = logging.getLogger("octo.engines.llamacpp")
_TEXT, _IMAGE = 0, 1  # MTMD_INPUT_CHUNK_TYPE_TEXT, _IMAGE


def find_projector(artifact: str, option: str | None) -> Path | None:
    """The projector to load: the ``mmproj`` option (a path; ``none``: no projector), else the only ``mmproj*.gguf``
    beside the model's file (None: none there; several: the option must choose)."""
    if option is not None:
        if option.strip().lower() in ("none", "off", "false", ""):
            return None
        return check_gguf(option)
    model = Path(artifact)
    found = sorted(p for p in model.parent.glob("mmproj*.gguf") if p.is_file() and p != model)
    if len(found) > 1:
        raise ConfigError(f"{len(found)} projectors beside {model.name} ({', '.join(p.name for p in found)}); "
                          "choose one with -o mmproj=PATH (--mmproj)", param="mmproj")
    return found[0] if found else None


def load(engine: Any) -> Vision | None:
    """The projector of the engine's model (None: none to load), loaded beside its llama_model."""
    path = find_projector(engine.artifact_path, engine.opts.get("mmproj"))
    if path is None:
        return None
    if engine.opts.get("draft"):
        raise ConfigError("speculative decoding (-o draft) cannot run with a projector: the draft model reads no "
                          "images (-o mmproj=none serves the model as text only)", param="draft")
    return Vision(engine, path)


class _Chunk:
    """An owned copy of a libmtmd input chunk (freed with this object)."""

    __slots__ = ("ptr", "_free")

    def __init__(self, ptr: Any, free: Any) -> None:
        self.ptr, self._free = ptr, free

    def __del__(self) -> None:
        if self.ptr:
            self._free(self.ptr)
            self.ptr = None


class Vision:
    """The engine's ``vision`` part: the libmtmd context of a model's projector."""

    def __init__(self, engine: Any, path: Path) -> None:
        import llama_cpp.mtmd_cpp as M
        import numpy as np

        self.M, self.np, self.engine, self.path = M, np, engine, path
        L = engine.lib
        LogTap.install_mtmd(M)
        params = M.mtmd_context_params_default()
        params.n_threads = engine.n_threads
        params.print_timings = False
        params.warmup = True  # an encode at load: a projector that cannot run fails the load, not a request
        LogTap.recent.clear()
        self.ctx = M.mtmd_init_from_file(str(path).encode(), engine.model, params)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not load the projector {path} for {engine.artifact_path} (not an "
                              f"mmproj GGUF of this model?): {LogTap.tail() or 'no details'}", param="mmproj")
        vision, mrope = M.mtmd_support_vision(self.ctx), M.mtmd_decode_use_mrope(self.ctx)
        if mrope or not vision:
            self.close()
            what = "positions images with M-RoPE (the Qwen2-VL family)" if vision else "takes no images"
            raise ConfigError(f"the projector {path.name} {what}, which octo's llama.cpp engine does not serve yet; "
                              "-o mmproj=none serves the model as text only", param="mmproj")
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        self.n_embd = L.llama_model_n_embd_inp(engine.model)
        self.n_ubatch = L.llama_n_ubatch(engine.ctx)
        self.lock = threading.Lock()  # one encode at a time: libmtmd keeps the last output in its context

    def describe(self) -> dict[str, Any]:
        return {"mmproj": str(self.path), "mmproj_bytes": self.path.stat().st_size, "media": ["image"],
                "image_attention": "non-causal" if self.non_causal else "causal"}

    def close(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None

    # -- the serving side ---------------------------------------------------------------------------------------------
    def tokenize(self, parts: list[str | MediaInput]) -> tuple[list[int], list[MediaChunk]]:
        M, eng = self.M, self.engine
        keep: list[Any] = []  # the ctypes objects the parts point to, alive until libmtmd has read them
        bitmaps: list[Any] = []
        ptrs = (ctypes.POINTER(M.mtmd_input_part) * len(parts))()
        try:
            for i, p in enumerate(parts):
                part = M.mtmd_input_part()
                if isinstance(p, MediaInput):
                    if p.kind != "image":
                        raise InvalidRequest(f"Model '{eng.info.name}' takes no {p.kind} input.", param="messages")
                    data = (ctypes.c_uint8 * len(p.data)).from_buffer_copy(p.data)
                    bmp = M.mtmd_bitmap_init(p.width, p.height, data)
                    if not bmp:
                        raise InvalidRequest(f"libmtmd refused a {p.width}x{p.height} image.", param="messages")
                    bitmaps.append(bmp)
                    M.mtmd_bitmap_set_id(bmp, p.digest.encode())
                    part.bitmap = bmp
                else:
                    raw = p.encode("utf-8")
                    text = M.mtmd_input_text(raw, len(raw), False, True)
                    keep += [raw, text]
                    part.text = ctypes.pointer(text)
                keep.append(part)
                ptrs[i] = ctypes.pointer(part)
            chunks = M.mtmd_input_chunks_init()
            try:
                rc = M.mtmd_tokenize_from_parts(self.ctx, chunks, ptrs, len(parts), True)
                if rc != 0:
                    raise InvalidRequest(f"The prompt's images could not be prepared for the model (libmtmd "
                                         f"tokenize: {rc}): {LogTap.tail(2)}", param="messages")
                return self._flatten(chunks)
            finally:
                M.mtmd_input_chunks_free(chunks)
        finally:
            for bmp in bitmaps:
                M.mtmd_bitmap_free(bmp)

    def _flatten(self, chunks: Any) -> tuple[list[int], list[MediaChunk]]:
        M, eng = self.M, self.engine
        tokens: list[int] = []
        media: list[MediaChunk] = []
        n_out = ctypes.c_size_t()
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == _TEXT:
                ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_out))
                tokens += ptr[:n_out.value] if n_out.value else []
                continue
            if kind != _IMAGE:  # (audio: no audio input is passed in yet)
                raise EngineError(f"libmtmd made a chunk of type {kind} from a prompt of text and images")
            n = M.mtmd_input_chunk_get_n_tokens(chunk)
            if self.non_causal and n > self.n_ubatch:
                raise InvalidRequest(f"An image takes {n} tokens, more than the {self.n_ubatch} of one micro-batch "
                                     "this model reads an image in (-o n_ubatch).", param="messages")
            digest = (M.mtmd_input_chunk_get_id(chunk) or b"").decode()
            owned = _Chunk(M.mtmd_input_chunk_copy(chunk), M.mtmd_input_chunk_free)
            media.append(MediaChunk("image", digest, len(tokens), n, data=owned))
            tokens += media_token_ids(digest, n)
        if eng.add_bos and len(tokens) > 1 and tokens[0] == tokens[1] == eng.bos:  # the template wrote BOS too
            tokens = tokens[1:]
            for m in media:
                m.pos -= 1
        return tokens, media

    # -- the encode thread ----------------------------------------------------------------------------------------
    def encode(self, chunk: MediaChunk) -> Any:
        """The chunk's embeddings (float32, one row per position), on the scheduler's encode thread."""
        M, np = self.M, self.np
        owned = chunk.data
        if not isinstance(owned, _Chunk) or not owned.ptr:
            raise EngineError("an image chunk without its prepared pixels reached the encoder")
        with self.lock:
            if M.mtmd_encode_chunk(self.ctx, owned.ptr) != 0:
                raise EngineError(f"llama.cpp could not encode an image: {LogTap.tail(2)}")
            out = M.mtmd_get_output_embd(self.ctx)
            rows = np.ctypeslib.as_array(out, shape=(chunk.n_tokens * self.n_embd,)).copy()
        return rows.reshape(chunk.n_tokens, self.n_embd)

    # -- the engine thread ------------------------------------------------------------------------------------------
    def step(self, feeds: list[Feed]) -> list[Any]:
        """A step with image feeds: each image's embeddings decoded on their own, then the text feeds as usual. A full
        KV pool takes back what the step consumed before it raises (the scheduler makes room and runs it again)."""
        eng = self.engine
        if eng.layout.policy is not None:  # a stream an image would outgrow: the pool first (.adapt)
            eng.layout.before_step(feeds, 0)
        out: list[Any] = [None] * len(feeds)
        text = [i for i, f in enumerate(feeds) if f.media is None]
        done: list[Feed] = []
        try:
            for i, f in enumerate(feeds):
                if f.media is not None:
                    out[i] = self._decode(f)
                    done.append(f)
            if text:
                for i, r in zip(text, eng.step([feeds[i] for i in text]), strict=True):
                    out[i] = r
        except KVCacheFull:
            for f in done:
                f.seq.n_cached -= len(f.tokens)
                eng.cells.seq_rm(f.seq.slot.seq_id, f.seq.n_cached)
            raise
        return out

    def _decode(self, f: Feed) -> Any:
        eng, np = self.engine, self.np
        L, ctx, seq, m = eng.lib, eng.ctx, f.seq, f.media
        k, start = len(f.tokens), seq.n_cached
        if start + k > eng.n_ctx_seq:
            raise ContextLengthExceeded(f"This model's maximum context length is {eng.n_ctx_seq} tokens; sequence "
                                        f"{seq.id} would reach {start + k}.", param="messages")
        rows = np.ascontiguousarray(m.embedding[start - m.pos:start - m.pos + k], dtype=np.float32)
        sid = seq.slot.seq_id
        pos = np.arange(start, start + k, dtype=np.int32)
        n_seq = np.ones(k, dtype=np.int32)
        sids = np.full(k, sid, dtype=np.int32)
        logits = np.zeros(k, dtype=np.int8)
        logits[-1] = f.sample
        i32 = ctypes.POINTER(ctypes.c_int32)
        seq_ptrs = (i32 * k)(*[ctypes.cast(sids.ctypes.data + 4 * j, i32) for j in range(k)])
        b = L.llama_batch()
        b.n_tokens = k
        b.token = ctypes.POINTER(L.llama_token)()
        b.embd = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos, b.n_seq_id = pos.ctypes.data_as(i32), n_seq.ctypes.data_as(i32)
        b.seq_id = ctypes.cast(seq_ptrs, ctypes.POINTER(i32))
        b.logits = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        if eng.adapters is not None:
            eng.adapters.apply(ctx, seq.sampling.adapter)
        if self.non_causal:
            L.llama_set_causal_attn(ctx, False)
        try:
            rc = L.llama_decode(ctx, b)
        finally:
            if self.non_causal:
                L.llama_set_causal_attn(ctx, True)
        if rc == 1:
            raise KVCacheFull(f"llama.cpp's KV cache is full ({eng.kv_cells} cells; an image of {k} positions)")
        if rc != 0:
            eng.cells.seq_rm(sid, start)
            raise EngineError(f"llama_decode of an image failed with code {rc}: {LogTap.tail()}")
        seq.n_cached += k
        eng.cells.book.append(sid, k)
        if eng.kv_unified:
            eng.cells.count_runs([f])
        if not f.sample:
            return None
        if f.mask is None and f.logprobs < 0:
            return seq.slot.chain.sample(ctx, k - 1)
        return lg.sample(L, ctx, eng.n_vocab, f, k - 1, eng.penalty_last_n)
