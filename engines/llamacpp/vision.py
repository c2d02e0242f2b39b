"""Images on the llama.cpp engine, through libmtmd (``llama_cpp.mtmd_cpp``): the projector (``mmproj``) of a
vision-language GGUF, the prompt's tokens cut at its images, their encodes, and their embeddings in the batch.

The projector is the ``mmproj`` option (what ``--mmproj`` passes) or, by default, the one ``mmproj*.gguf`` file beside
the model's GGUF (the layout of llama.cpp's ``-hf`` downloads, LM Studio's folders and octo's catalog); ``mmproj=none``
serves the model as text only. A projector that does not load fails the model's load, saying so (libmtmd's own
warm-up encode runs at load).

Positions: the scheduler counts a sequence's tokens (``n_cached``), and llama.cpp's KV holds a position per cell. They
are the same number except after an image of a model with M-RoPE (the Qwen2-VL family: Qwen2-VL, Qwen2.5-VL): its
nx x ny tokens take the 2D positions of their grid (each section of llama.cpp's four: temporal, row, column), all at
one temporal position, and advance the sequence's position by ``mtmd_input_chunk_get_n_pos`` (max(nx, ny)), not by
their count, as llama-server's ``server_tokens::pos_next`` counts. :func:`position` maps a token count to the KV
position every llama.cpp call takes (a text batch's ``pos``, ``llama_memory_seq_rm``, ``llama_memory_seq_cp``), and
:func:`floor` brings a cut that would fall inside such an image (a restored or shared prefix) back to the image's
start: its cells share one position, so llama.cpp can keep all of them or none (llama-server's ``keep_first`` refuses
the same cut).

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

from octo.engine import Feed, MediaChunk, MediaInput, Sequence, media_token_ids
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


def position(seq: Sequence, n: int) -> int:
    """The KV position of ``seq``'s token ``n`` (a text token's, or an image's first): ``n``, less what the M-RoPE
    images before it save; inside such an image, the temporal position all its cells share."""
    shift = 0
    for c in seq.media:
        if c.end <= n:
            shift += getattr(c.data, "n_pos", c.n_tokens) - c.n_tokens
        elif c.pos < n and getattr(c.data, "grid", False):
            return c.pos + shift
        else:
            break
    return n + shift


def floor(seq: Sequence, n: int) -> int:
    """``n``, or the start of the M-RoPE image it falls inside (whose cells llama.cpp keeps or drops together)."""
    for c in seq.media:
        if c.pos < n < c.end and getattr(c.data, "grid", False):
            return c.pos
    return n


class _Chunk:
    """An owned copy of a libmtmd input chunk (freed with this object): ``n_pos`` positions it advances the sequence
    by; ``grid``: its tokens take 2D (M-RoPE) positions."""

    __slots__ = ("ptr", "_free", "n_pos", "grid")

    def __init__(self, ptr: Any, free: Any, n_pos: int, grid: bool) -> None:
        self.ptr, self._free, self.n_pos, self.grid = ptr, free, n_pos, grid

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
        if not M.mtmd_support_vision(self.ctx):
            self.close()
            raise ConfigError(f"the projector {path.name} takes no images, which octo's llama.cpp engine does not "
                              "serve yet; -o mmproj=none serves the model as text only", param="mmproj")
        self.mrope = bool(M.mtmd_decode_use_mrope(self.ctx))  # 4 positions per image row (.position)
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        self.n_embd = L.llama_model_n_embd_inp(engine.model)
        self.n_ubatch = L.llama_n_ubatch(engine.ctx)
        self.lock = threading.Lock()  # one encode at a time: libmtmd keeps the last output in its context

    def describe(self) -> dict[str, Any]:
        return {"mmproj": str(self.path), "mmproj_bytes": self.path.stat().st_size, "media": ["image"],
                "image_attention": "non-causal" if self.non_causal else "causal",
                "image_positions": "M-RoPE (2D)" if self.mrope else "sequential"}

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
            owned = _Chunk(M.mtmd_input_chunk_copy(chunk), M.mtmd_input_chunk_free, M.mtmd_input_chunk_get_n_pos(chunk),
                           self.mrope)
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
        off = start - m.pos
        rows = np.ascontiguousarray(m.embedding[off:off + k], dtype=np.float32)
        p0 = position(seq, start)
        pos = self._positions(m, p0 - off if not self.mrope else p0)[:, off:off + k]
        sid = seq.slot.seq_id
        if eng.adapters is not None:
            eng.adapters.apply(ctx, seq.sampling.adapter)
        if self.non_causal:
            L.llama_set_causal_attn(ctx, False)
        try:  # a causal image larger than a batch goes in batches (a non-causal one fits a micro-batch: .tokenize)
            for i in range(0, k, eng.n_batch):
                rc = L.llama_decode(ctx, _EmbdBatch(L, rows[i:i + eng.n_batch], pos[:, i:i + eng.n_batch], sid,
                                                    f.sample and i + eng.n_batch >= k).struct)
                if rc != 0:
                    break
        finally:
            if self.non_causal:
                L.llama_set_causal_attn(ctx, True)
        if rc != 0:
            eng.cells.seq_rm(sid, start)  # (the batches before it)
            if rc == 1:
                raise KVCacheFull(f"llama.cpp's KV cache is full ({eng.kv_cells} cells; an image of {k} positions)")
            raise EngineError(f"llama_decode of an image failed with code {rc}: {LogTap.tail()}")
        seq.n_cached += k
        eng.cells.book.append(sid, k)
        if eng.kv_unified:
            eng.cells.count_runs([f])
        if not f.sample:
            return None
        last = (k - 1) % eng.n_batch  # the logits row of the last batch
        if f.mask is None and f.logprobs < 0:
            return seq.slot.chain.sample(ctx, last)
        return lg.sample(L, ctx, eng.n_vocab, f, last, eng.penalty_last_n)

    def _positions(self, m: MediaChunk, p0: int) -> Any:
        """The positions of all of ``m``'s rows from ``p0`` (its first): one row (sequential), or the four sections of
        M-RoPE (temporal, row, column, unused), as libmtmd's ``mtmd_helper_image_get_decoder_pos`` places them."""
        np, M = self.np, self.M
        if not self.mrope:
            return np.arange(p0, p0 + m.n_tokens, dtype=np.int32)[None, :]
        out = np.zeros((m.n_tokens, 4), dtype=np.uint32)  # mtmd_decoder_pos {t, x, y, z} per row
        image = M.mtmd_input_chunk_get_tokens_image(m.data.ptr)
        M.mtmd_helper_image_get_decoder_pos(image, p0, out.ctypes.data_as(ctypes.POINTER(M.mtmd_decoder_pos)))
        return np.ascontiguousarray(out[:, [0, 2, 1, 3]].T, dtype=np.int32)  # llama_batch: t, y, x, z sections


class _EmbdBatch:
    """A ``llama_batch`` of embedding rows of one sequence, ``pos`` a section per row of positions (1, or 4 for
    M-RoPE: llama.cpp reads them section-major), logits for the last row when ``sample``. Holds its arrays."""

    def __init__(self, L: Any, rows: Any, pos: Any, seq_id: int, sample: bool) -> None:
        import numpy as np

        k = len(rows)
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.rows, self.pos = rows, np.ascontiguousarray(pos.reshape(-1))
        self.n_seq = np.ones(k, dtype=np.int32)
        self.sids = np.full(k, seq_id, dtype=np.int32)
        self.logits = np.zeros(k, dtype=np.int8)
        self.logits[-1] = sample
        self.seq_ptrs = (i32 * k)(*[ctypes.cast(self.sids.ctypes.data + 4 * j, i32) for j in range(k)])
        b = self.struct = L.llama_batch()
        b.n_tokens = k
        b.token = ctypes.POINTER(L.llama_token)()
        b.embd = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos, b.n_seq_id = self.pos.ctypes.data_as(i32), self.n_seq.ctypes.data_as(i32)
        b.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(i32))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
