"""Continuous batching on CPU: the folder's decoder run with plain onnxruntime, KV tensors owned by octo.

onnxruntime-genai's CPU models use the ``GroupQueryAttention`` contrib op with a shared past/present buffer
(``past_present_share_buffer``): each past/present KV tensor is a preallocated ``[batch, kv_heads, n_ctx,
head_size]`` buffer, and the op reads row ``b``'s past from its first ``seqlens[b]`` positions (from the
attention mask) and writes the new keys/values right after them, in place. So rows of one batch may be at
different lengths, and a row is just a slice of the buffer. This module keeps one buffer per layer for
``max_batch`` rows and:

* gives each sequence a row; active rows are kept packed at the front (a leaving row is filled with the last
  row's KV), so a batched run over rows ``[0, k)`` is a zero-copy view;
* runs every one-token feed (decode, or a one-token prompt chunk) of a step in ONE batched forward pass over
  rows ``[0, k)``; a longer prompt chunk runs alone on its row's view (batch 1), as onnxruntime-genai prefills;
* saves and restores a row's first ``n`` positions for the prefix cache (a real KV copy, any shared prefix).

Sampling is octo's (:mod:`.sampler`), so this backend applies ``Feed.mask`` (a masked or logprobs row leaves the
batch's shared argmax), reports ``Feed.logprobs``, and for ``Feed.prompt_logprobs`` keeps the logits of every
position of the chunk (the decoder outputs them all; otherwise only the last is read).

Sequences join and leave between any two steps: continuous batching, with a sequence's compute stopping the
step after it leaves. Inputs are bound with ``IOBinding`` (past and present are the same ``OrtValue``).
"""

from __future__ import annotations

import numpy as np

from octo.engine import Feed, KVHandle, Sequence
from octo.errors import ConfigError, EngineError

from .folder import DecoderSpec
from .sampler import SAMPLING_PARAMS, RowSampler, prompt_entries

_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class SessionRunner:
    def __init__(self, path: str, spec: DecoderSpec, max_batch: int, n_ctx: int, threads: int,
                 inter_threads: int = 0) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.spec = spec
        self.max_batch = max_batch
        self.n_ctx = n_ctx
        if not spec.share_buffer:
            raise ConfigError("This model does not use onnxruntime-genai's shared past/present KV buffer "
                              "(search.past_present_share_buffer), which the session backend needs.")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = inter_threads
        for key, value in (spec.session_options.get("config_entries") or {}).items():
            so.add_session_config_entry(str(key), str(value))
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.sess.get_inputs()}
        outputs = {o.name for o in self.sess.get_outputs()}
        self.ids_name = spec.inputs.get("input_ids", "input_ids")
        self.mask_name = spec.inputs.get("attention_mask", "attention_mask")
        self.pos_name = spec.inputs.get("position_ids", "position_ids")
        self.logits_name = spec.outputs.get("logits", "logits")
        try:
            past = [spec.past_names(i) for i in range(spec.num_layers)]
            present = [spec.present_names(i) for i in range(spec.num_layers)]
        except (KeyError, TypeError) as e:
            raise ConfigError(f"genai_config.json names no past/present KV inputs ({e}).") from None
        known = {self.ids_name, self.mask_name, self.pos_name, *(n for pair in past for n in pair)}
        missing = [n for n in (self.ids_name, self.mask_name, past[0][0]) if n not in inputs]
        extra = sorted(set(inputs) - known)
        if missing or extra or self.logits_name not in outputs or present[0][0] not in outputs:
            raise ConfigError(
                "This ONNX decoder does not have the inputs the onnx engine drives (input_ids, attention_mask, "
                f"[position_ids], past/present KV per layer): missing {missing or 'none'}, unexpected "
                f"{extra or 'none'}. Paged-attention (continuous-batching GPU) builds and multimodal models "
                "need onnxruntime-genai's own engine.")
        self.has_pos = self.pos_name in inputs
        self.ids_dtype = np.int64 if inputs[self.ids_name].type == "tensor(int64)" else np.int32
        self.mask_dtype = np.int64 if inputs[self.mask_name].type == "tensor(int64)" else np.int32
        self.pos_dtype = np.int64 if self.has_pos and inputs[self.pos_name].type == "tensor(int64)" else np.int32
        kv_type = inputs[past[0][0]].type
        if kv_type not in _NP_TYPES:
            raise ConfigError(f"Unsupported KV cache type {kv_type} (expected float or float16).")
        self.kv_dtype = _NP_TYPES[kv_type]
        shape = (max_batch, spec.num_kv_heads, n_ctx, spec.head_size)
        # np.zeros maps pages lazily: memory grows with the positions actually written
        self.keys = [np.zeros(shape, self.kv_dtype) for _ in range(spec.num_layers)]
        self.values = [np.zeros(shape, self.kv_dtype) for _ in range(spec.num_layers)]
        self.past, self.present = past, present
        self.bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * self.keys[0].itemsize
        self._bindings: dict[tuple[int, int], object] = {}
        self._views: dict[tuple[int, int], list] = {}

    # -- forward passes ------------------------------------------------------------------------------
    def run(self, row0: int, n_rows: int, tokens: np.ndarray, lengths: np.ndarray,
            every: bool = False) -> np.ndarray:
        """Append ``tokens`` ([n_rows, S]) to rows ``[row0, row0 + n_rows)`` whose KV holds ``lengths``
        positions each; returns the logits of the last position of each row ([n_rows, vocab]), or with ``every``
        those of every position ([n_rows, S, vocab])."""
        n_new = tokens.shape[1]
        total = lengths + n_new
        if int(total.max()) > self.n_ctx:
            raise EngineError(f"A sequence would exceed the context of {self.n_ctx} tokens.")
        io = self._binding(row0, n_rows)
        width = int(total.max())
        mask = (np.arange(width)[None, :] < total[:, None]).astype(self.mask_dtype)
        ids = np.ascontiguousarray(tokens, dtype=self.ids_dtype)  # locals: alive until the run is done
        io.bind_cpu_input(self.ids_name, ids)
        io.bind_cpu_input(self.mask_name, mask)
        if self.has_pos:
            pos = (lengths[:, None] + np.arange(n_new)[None, :]).astype(self.pos_dtype)
            io.bind_cpu_input(self.pos_name, pos)
        io.bind_output(self.logits_name)  # unallocated again: its shape changes between runs
        self.sess.run_with_iobinding(io)
        logits = io.get_outputs()[0].numpy()  # logits were bound first (see _binding): output 0
        return logits if every else logits[:, -1, :]

    def _binding(self, row0: int, n_rows: int):
        key = (row0, n_rows)
        io = self._bindings.get(key)
        if io is None:
            ort = self._ort
            io = self.sess.io_binding()
            io.bind_output(self.logits_name)  # first, so that it is get_outputs()[0]
            views = []
            for layer in range(self.spec.num_layers):
                for buf, pname, oname in ((self.keys[layer], self.past[layer][0], self.present[layer][0]),
                                          (self.values[layer], self.past[layer][1], self.present[layer][1])):
                    view = buf[row0:row0 + n_rows]
                    ov = ort.OrtValue.ortvalue_from_numpy(view)
                    io.bind_ortvalue_input(pname, ov)
                    io.bind_ortvalue_output(oname, ov)
                    views.append((view, ov))
            self._bindings[key] = io
            self._views[key] = views  # keep the arrays and OrtValues alive with the binding
        return io

    # -- rows ------------------------------------------------------------------------------------------
    def copy_row(self, src: int, dst: int, n: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst, :, :n] = buf[src, :, :n]

    def swap_rows(self, a: int, b: int, n: int) -> None:
        for buf in (*self.keys, *self.values):
            tmp = buf[a, :, :n].copy()
            buf[a, :, :n] = buf[b, :, :n]
            buf[b, :, :n] = tmp

    def save(self, row: int, n: int) -> np.ndarray:
        """The first ``n`` KV positions of ``row``: [layers, 2, kv_heads, n, head_size]."""
        out = np.empty((self.spec.num_layers, 2, self.spec.num_kv_heads, n, self.spec.head_size), self.kv_dtype)
        for layer in range(self.spec.num_layers):
            out[layer, 0] = self.keys[layer][row, :, :n]
            out[layer, 1] = self.values[layer][row, :, :n]
        return out

    def restore(self, row: int, data: np.ndarray, n: int) -> None:
        for layer in range(self.spec.num_layers):
            self.keys[layer][row, :, :n] = data[layer, 0, :, :n]
            self.values[layer][row, :, :n] = data[layer, 1, :, :n]

    def close(self) -> None:
        self._bindings.clear()
        self._views.clear()
        self.keys = self.values = []
        self.sess = None



class _Row:
    __slots__ = ("row", "sampler")

    def __init__(self, row: int, sampler: RowSampler) -> None:
        self.row = row
        self.sampler = sampler


class SessionBackend:
    """Sequences on KV rows of a :class:`SessionRunner`: continuous batching and real prefix reuse."""

    batching = "continuous"
    scheme = "continuous:session"
    sampling_params = SAMPLING_PARAMS
    supports_masks = supports_logprobs = supports_prompt_logprobs = True  # octo samples every row itself

    def __init__(self, runner: SessionRunner, n_vocab: int, penalty_last_n: int) -> None:
        self.runner = runner
        self.n_vocab = n_vocab
        self.penalty_last_n = penalty_last_n
        self.rows: list[Sequence] = []  # rows[i] is on KV row i; active rows are packed at the front

    def describe(self) -> str:
        import onnxruntime as ort

        return f"onnxruntime {ort.__version__} InferenceSession, KV rows owned by octo"

    def add(self, seq: Sequence) -> None:
        if len(self.rows) >= self.runner.max_batch:
            raise EngineError(f"All {self.runner.max_batch} KV rows are in use.")
        seq.slot = _Row(len(self.rows), RowSampler(seq.sampling, self.n_vocab, self.penalty_last_n))
        seq.n_cached = 0
        self.rows.append(seq)

    def remove(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot is None:
            return
        seq.slot = None
        r, last = slot.row, len(self.rows) - 1
        if self.rows[r] is not seq:
            raise EngineError(f"Sequence {seq.id} is not on its KV row.")
        if r != last:  # keep rows packed: the last row moves into the hole
            moved = self.rows[last]
            self.runner.copy_row(last, r, moved.n_cached)
            self.rows[r] = moved
            moved.slot.row = r
        self.rows.pop()

    def step(self, feeds: list[Feed]) -> list[int | BaseException | None]:
        out: list[int | BaseException | None] = [None] * len(feeds)
        for f in feeds:
            if f.seq.slot is None:
                raise EngineError(f"Sequence {f.seq.id} was not added to the engine.")
        single = [i for i, f in enumerate(feeds) if len(f.tokens) == 1]
        self._pack([feeds[i].seq for i in single])
        for i, f in enumerate(feeds):  # prompt chunks: one batch-1 pass each, on the row's own view
            if len(f.tokens) > 1:
                seq, first = f.seq, f.seq.n_cached
                every = f.prompt_logprobs >= 0
                logits = self.runner.run(seq.slot.row, 1, np.asarray([f.tokens]), np.asarray([first]), every)
                seq.n_cached += len(f.tokens)
                if every:
                    f.prompt_out = prompt_entries(f, first, logits[0])
                    logits = logits[:, -1, :]
                if f.sample:
                    out[i] = _sample(f, logits[0])
        if single:  # every one-token feed in one batched pass over rows [0, k)
            order = sorted(single, key=lambda i: feeds[i].seq.slot.row)
            toks = np.asarray([feeds[i].tokens for i in order])
            lengths = np.asarray([feeds[i].seq.n_cached for i in order])
            logits = self.runner.run(0, len(order), toks, lengths)
            greedy = [j for j, i in enumerate(order) if feeds[i].sample and feeds[i].seq.slot.sampler.fast(feeds[i])]
            if greedy:
                best = logits[greedy].argmax(axis=-1)
                for j, tok in zip(greedy, best.tolist(), strict=True):
                    out[order[j]] = int(tok)
            for j, i in enumerate(order):
                f = feeds[i]
                if f.prompt_logprobs >= 0:
                    f.prompt_out = prompt_entries(f, f.seq.n_cached, logits[j:j + 1])
                f.seq.n_cached += 1
                if f.sample and out[i] is None:
                    out[i] = _sample(f, logits[j])
        return out

    def _pack(self, seqs: list[Sequence]) -> None:
        """Move the rows of ``seqs`` to ``[0, len(seqs))`` (swapping KV with rows not in this pass)."""
        k = len(seqs)
        wanted = {id(s) for s in seqs}
        holes = [r for r in range(k) if id(self.rows[r]) not in wanted]
        strays = [s.slot.row for s in seqs if s.slot.row >= k]
        for a, b in zip(holes, strays, strict=True):
            sa, sb = self.rows[a], self.rows[b]
            self.runner.swap_rows(a, b, max(sa.n_cached, sb.n_cached))
            self.rows[a], self.rows[b] = sb, sa
            sa.slot.row, sb.slot.row = b, a

    # -- prefix cache: real KV copies ------------------------------------------------------------
    def save(self, seq: Sequence) -> KVHandle | None:
        if seq.slot is None or seq.n_cached <= 0:
            return None
        n = seq.n_cached
        data = self.runner.save(seq.slot.row, n)
        return KVHandle(tuple(seq.tokens[:n]), int(data.nbytes), data)

    def restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        if handle.data is None:
            raise ValueError("the KV handle was freed")
        n = min(n_tokens, len(handle.tokens), len(seq.tokens) - 1)
        if n <= 0 or tuple(seq.tokens[:n]) != handle.tokens[:n]:
            raise ValueError("the cached prefix does not match the sequence")
        self.runner.restore(seq.slot.row, handle.data, n)
        seq.n_cached = n

    def free(self, handle: KVHandle) -> None:
        handle.data = None

    def close(self) -> None:
        self.rows.clear()
        self.runner.close()


def _sample(f: Feed, logits: np.ndarray) -> int | BaseException:
    """``f``'s token from its logits row; a sampling failure (a mask that leaves nothing) fails that sequence only."""
    try:
        return f.seq.slot.sampler.sample_feed(f, logits)
    except EngineError as e:
        return e
