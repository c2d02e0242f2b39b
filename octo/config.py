"""Server configuration: one dataclass filled from CLI flags / OCTO_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    model: str = "demo"
    engine: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    options: dict[str, str] = field(default_factory=dict)
    max_queue: int = 64
    queue_timeout: float = 60.0
    max_batch: int = 8
    default_max_tokens: int | None = None  # a completion's length when a request sets none (the catalog's max_tokens)
    cache_size_mb: float = 512.0
    no_cache: bool = False
    max_body_mb: float = 32.0
    api_key: str | None = None
    max_audio_mb: float = 25.0
    max_audio_seconds: float = 1800.0
    max_image_mb: float = 20.0  # --max-image-mb: the largest image a request may send (octo.serving.media)
    max_images: int = 16  # --max-images: images in one request
    max_image_pixels: int = 32 * 2**20  # --max-image-pixels: pixels of one image (a decompression bomb: refused)
    allow_image_urls: tuple[str, ...] = ()  # --allow-image-urls: hosts remote image URLs are fetched from (octo.server.
    #                                         imagefetch); (): none, a remote URL is a 400 naming the flag
    image_url_timeout: float = 10.0  # --image-url-timeout: seconds one request's image fetch may take
    bench_seconds: float = 3.0
    rebench: bool = False
    bench_when_idle: bool = False  # serve at once; measure candidate engines without a cached result while idle
    plugins_dir: str | None = None
    cors_origins: tuple[str, ...] = ()  # browser origins allowed by CORS ("*": any); (): no CORS headers
    keep_alive: float | None = 300.0  # idle seconds before a model loaded on demand unloads (None: never)
    max_loaded: int | None = None  # models loaded at once (0: no limit; None: the default, octo.runtime.memguard)
    memory_budget_gb: float | None = None  # estimated memory of the loaded models (0: no limit; None: what fits in
    #                                        MemAvailable, octo.runtime.memguard)
    max_keep_alive: float | None = None  # longest keep_alive a request may ask for (None: unlimited)
    allowed_hosts: tuple[str, ...] = ()  # --allowed-hosts: Host names served on a loopback bind besides local ones
    models_dirs: tuple[str, ...] = ()  # --models-dir: folders whose models requests may load
    allow_any_path: bool = False  # --allow-any-path: requests may load any local path
    allow_pull_hf: bool = False  # --allow-pull-hf: POST /api/pull may pull Hugging Face ids (else catalog names only)
    max_pull_gb: float = 16.0  # --max-pull-gb: the most one such pull may download (0: no cap)
    evict_startup_models: bool = False  # --evict-startup-models: loads on demand may unload models named at start
    share_cores: str = "os"  # "os": the OS shares the cores; "turns": models in workers compute in turns (arbiter)
    isolation: str | None = None  # "process" | "thread"; None: each engine's default (Engine.isolation)
    preempt: str = "swap"  # KV pressure: a preempted sequence's KV waits in host memory ("swap") or is recomputed
    step_stretch: float = 2.0  # prompt chunks may stretch a step to this many decode-only steps (0: no limit)
    prefix_dedup: bool = True  # a prefix several running requests share is computed once (octo.scheduler.sharing)
    tool_format: str | None = None  # tool-call family for every model (None: detected from each chat template)
    reasoning_format: str = "parsed"  # chat: <think> text as reasoning_content ("parsed") or left in content ("none")
    prefix_cache_dir: str | None = None  # the prefix cache's disk tier (octo.scheduler.disk_cache); None: memory only
    prefix_cache_disk_mb: float = 4096.0  # its budget
    shutdown_timeout: float = 30.0  # SIGTERM: seconds running and queued requests get to finish
    responses_ttl: float = 30 * 86400.0  # stored responses expire this long after they were made (0: never)
    responses_max_mb: float = 1024.0  # the responses store's cap, oldest pruned first (0: no cap)
    # "ray" or "ray://HOST:10001": each model is a Ray Serve deployment (octo.cluster.deploy)
    cluster: str | None = None
    replicas: int = 1  # with cluster: replicas per model (the models file may set its own)
    autoscaling: dict | None = None  # with cluster: Ray Serve autoscaling_config (min/max replicas, target)
    replica_resources: dict = field(default_factory=dict)  # with cluster: num_cpus, num_gpus, memory_gb per replica
    worker_timeout: float = 10.0  # a serving worker silent this long is killed and restarted (octo.runtime.supervision)
    load_timeout: float = 300.0  # a load (and a request's wait for it) may take this long (Ollama's default too)
    stream_keepalive: float = 5.0  # seconds between keep-alives of a stream before its first token (0: none)
