"""The onnx engine: onnxruntime-genai model folders (``genai_config.json`` + ``model.onnx``) on CPU.

Two ways to run a folder behind the shared scheduler (``-o backend=``):

* ``session`` (default when the folder allows): octo runs the folder's decoder with plain onnxruntime and owns
  the KV tensors (:mod:`.session`). Continuous batching: sequences join and leave between any two steps, all
  one-token feeds of a step share one forward pass, a cancelled sequence stops costing compute at the next step,
  and the prefix cache restores real KV copies for any shared prefix.
* ``generator``: onnxruntime-genai's own ``og.Generator``, one per batch window (:mod:`.generator`). On CPU the
  library cannot add a sequence to a running Generator (its continuous-batching ``og.Engine`` needs a paged
  attention build, which the model builder makes for CUDA/WebGPU only), so the scheduler admits a new group only
  when the previous one has finished.
* ``engine``: onnxruntime-genai's continuous-batching ``og.Engine`` (:mod:`.ogengine`), chosen automatically for
  paged-attention folders (``engine.dynamic_batching`` in ``genai_config.json``); on a CPU folder the library
  runs it as a fixed batch.

``onnxruntime`` / ``onnxruntime_genai`` are imported lazily: the package imports without them.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, ClassVar

from octo.engine import Detection, Engine, EngineConfig, Feed, KVHandle, ModelInfo, Sequence, Task
from octo.errors import ConfigError
from octo.plugins import installed_version

from .folder import DecoderSpec, TextCodec, read_config
from .options import OPTIONS, parse_options
from .sampler import SAMPLING_PARAMS

log = logging.getLogger("octo.engines.onnx")
# the distributions that install each module (CPU, CUDA, DirectML, OpenVINO builds)
ORT_DISTS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn")
GENAI_DISTS = ("onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml")
DEFAULT_N_CTX = 4096


class OnnxEngine(Engine):
    name: ClassVar[str] = "onnx"
    aliases: ClassVar[tuple[str, ...]] = ("onnxruntime", "onnxruntime-genai", "ort")
    tasks: ClassVar[frozenset[Task]] = frozenset({Task.CHAT, Task.COMPLETION})
    formats: ClassVar[frozenset[str]] = frozenset({"onnx"})
    option_names: ClassVar[frozenset[str] | None] = frozenset(OPTIONS)
    batching: ClassVar[str] = "continuous"  # the session backend; a generator-backend instance says "window"
    sampling_params: ClassVar[frozenset[str]] = SAMPLING_PARAMS
    # the session and generator backends sample in octo (masks, logprobs, prompt logprobs); an instance on the
    # og.Engine backend, which samples inside the library, sets all three False at load
    supports_masks: ClassVar[bool] = True
    supports_logprobs: ClassVar[bool] = True
    supports_prompt_logprobs: ClassVar[bool] = True
    prefill_chunk: ClassVar[int] = 256

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        self.opts = parse_options(self.config.options)
        if self.config.max_batch < 1:
            raise ConfigError("max_batch must be >= 1", param="max_batch")
        self.prefill_chunk = self.opts.get("prefill_chunk", type(self).prefill_chunk)
        self.backend: Any = None
        self.codec: TextCodec | None = None

    # -- discovery ---------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Detection:
        # not imported here: detect() runs in the gateway (onnxruntime is 26 MB of it); a library that is installed
        # but does not load fails the load, in the worker
        if importlib.util.find_spec("onnxruntime") is None:
            return Detection(False, "onnxruntime is not installed; pip install 'octo[onnx]'")
        ort = installed_version("onnxruntime", *ORT_DISTS) or "(version unknown)"
        genai = " (onnxruntime-genai not installed: session backend only)"
        if importlib.util.find_spec("onnxruntime_genai") is not None:
            genai = f", onnxruntime-genai {installed_version('onnxruntime_genai', *GENAI_DISTS) or '(version unknown)'}"
        return Detection(True, f"onnxruntime {ort}{genai} (CPU)")

    @classmethod
    def prepare(cls) -> None:
        try:
            import onnxruntime  # noqa: F401 - the native library, ahead of the load
        except Exception:  # noqa: BLE001 - the load reports a library that does not load
            pass

    @classmethod
    def version(cls) -> str:
        ort = installed_version("onnxruntime", *ORT_DISTS) or "0"
        genai = installed_version("onnxruntime_genai", *GENAI_DISTS)
        return f"{ort}+genai{genai}" if genai else ort

    @classmethod
    def artifact_format(cls, path: str) -> str | None:
        p = Path(path)
        if p.is_file() and p.name == "genai_config.json":
            p = p.parent
        return "onnx" if (p / "genai_config.json").is_file() else None

    # -- life cycle --------------------------------------------------------------------------------
    def load(self, artifact: str, name: str) -> ModelInfo:
        folder = Path(artifact)
        if folder.is_file():
            folder = folder.parent
        spec, _ = read_config(folder)
        threads = self.opts.get("threads", int(spec.session_options.get("intra_op_num_threads") or 0))
        penalty_last_n = self.opts.get("penalty_last_n", 64)
        choice = self.opts.get("backend", "auto")
        if choice == "auto":
            from .ogengine import has_dynamic_batching

            if has_dynamic_batching(folder):  # a paged-attention build: only og.Engine can drive it
                choice = "engine"
            else:
                choice = "session" if spec.share_buffer else "generator"
        # the session backend's KV buffers are mapped lazily (memory grows with the positions written), so it takes
        # the model's whole context, as llama.cpp and MLX do; onnxruntime-genai's own backends allocate theirs
        n_ctx = self.opts.get("n_ctx", spec.context_length if choice == "session" else
                              min(spec.context_length, DEFAULT_N_CTX))
        if n_ctx > spec.context_length:
            raise ConfigError(f"n_ctx {n_ctx} exceeds the model's context length {spec.context_length}.",
                              param="n_ctx")
        self.codec = TextCodec(folder, spec.vocab_size)
        kv = self._open_backend(choice, folder, spec, n_ctx, threads, penalty_last_n)
        self.batching = self.backend.batching
        self.sampling_params = self.backend.sampling_params
        self.supports_masks = self.backend.supports_masks
        self.supports_logprobs = self.backend.supports_logprobs
        self.supports_prompt_logprobs = self.backend.supports_prompt_logprobs
        self.info = ModelInfo(
            name=name,
            n_ctx=n_ctx,
            eos_token_ids=spec.eos_token_ids,
            n_vocab=spec.vocab_size,
            extra={
                "batching": self.backend.scheme,
                "backend": self.backend.describe(),
                "model_type": spec.model_type,
                "precision": _precision(folder),
                "threads": threads or "onnxruntime default",
                "n_ctx": n_ctx,
                "context_length": spec.context_length,
                "max_batch": self.config.max_batch,
                "prefill_chunk": self.prefill_chunk,
                "chat_template": self.codec.template_source,
                "execution_provider": "cpu" + (f" (folder built for {', '.join(spec.providers)})"
                                               if spec.providers else ""),
                **kv,
            },
        )
        return self.info

    def _open_backend(self, choice: str, folder: Path, spec: DecoderSpec, n_ctx: int, threads: int,
                      penalty_last_n: int) -> dict[str, Any]:
        """``self.backend`` for ``choice`` ("session", "engine" or "generator"); what /v1/engines says of its KV."""
        if choice == "session":
            from .session import SessionBackend, SessionRunner

            runner = SessionRunner(str(folder / spec.filename), spec, self.config.max_batch, n_ctx, threads)
            self.backend = SessionBackend(runner, spec.vocab_size, penalty_last_n)
            kv = {"kv_dtype": runner.kv_dtype.__name__, "kv_bytes_per_token": runner.bytes_per_token,
                  "prefix_cache": "KV copies of any shared prefix (session rows)"}
        elif choice == "engine":
            from .ogengine import EngineBackend

            self.backend = EngineBackend(folder, spec, self.config.max_batch, n_ctx, threads)
            kv = {"prefix_cache": "none claimed (the library's KV is not octo's to copy; kv_save returns None)"}
        else:
            from .generator import GeneratorBackend

            self.backend = GeneratorBackend(folder, spec, self.config.max_batch, n_ctx, threads, penalty_last_n)
            kv = {"prefix_cache": "none (og.Generator KV cannot be copied; kv_save returns None)"}
        return kv

    def unload(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self.info = None

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.codec.tokenize(text, special)

    def token_bytes(self, token: int) -> bytes:
        return self.codec.token_bytes(token)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        return self.codec.render_chat(messages, add_generation_prompt, tools)

    def chat_template(self) -> str | None:
        return self.codec.template.source if self.codec is not None and self.codec.template is not None else None

    def special_tokens(self) -> dict[str, int]:
        return self.codec.special_tokens() if self.codec is not None else {}

    # -- generation --------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        self.backend.add(seq)

    def step(self, feeds: list[Feed]) -> list[int | BaseException | None]:
        return self.backend.step(feeds)

    def remove_sequence(self, seq: Sequence) -> None:
        self.backend.remove(seq)

    def kv_save(self, seq: Sequence) -> KVHandle | None:
        return self.backend.save(seq)

    def kv_restore(self, seq: Sequence, handle: KVHandle, n_tokens: int) -> None:
        self.backend.restore(seq, handle, n_tokens)

    def kv_free(self, handle: KVHandle) -> None:
        if self.backend is not None:
            self.backend.free(handle)
        else:
            handle.data = None


def _precision(folder: Path) -> str:
    """int4 / int8 (MatMulNBits), else the float type of the weights, from the decoder graph's op names."""
    import json

    meta = folder / ".complete"
    if meta.is_file():
        try:
            return json.loads(meta.read_text())["precision"]
        except (ValueError, KeyError):
            pass
    try:
        head = (folder / "model.onnx").read_bytes()[:4_000_000]
    except OSError:
        return "unknown"
    if b"MatMulNBits" in head:
        return "int4" if b"_Q4" in head else "int8/int4"
    return "float"
