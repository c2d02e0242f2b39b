"""``octo serve``: its flags (each can also be set with an ``OCTO_*`` variable), checked and turned into a
``ServerConfig`` and the models to load; the engine worker started before anything else (``octo.runtime.prespawn``);
then ``octo.cli.startup`` runs the server."""

from __future__ import annotations

import logging
import os

import click

from octo.cli.common import envvar, take_port
from octo.config import ServerConfig
from octo.errors import OctoError


def serve_options(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got '{pair}'", param_hint="-o/--option")
        out[key.strip()] = value.strip()
    return out


def _lora(ctx, param, pairs) -> dict[str, str]:
    """``--lora NAME=PATH`` (repeatable): LoRA adapters of the models named on the command line."""
    out = {}
    for pair in pairs or ():
        name, sep, path = pair.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or ":" in name or "/" in name:
            raise click.BadParameter(f"expected NAME=PATH (a name without ':' or '/'), got '{pair}'")
        if not os.path.exists(os.path.expanduser(path)):
            raise click.BadParameter(f"LoRA adapter '{name}': nothing at {path}")
        out[name] = path
    return out


def _is_loopback(host: str) -> bool:
    if host in ("127.0.0.1", "localhost", "::1"):  # the usual ones without importing the server (aiohttp)
        return True
    from octo.server.hostcheck import is_loopback

    return is_loopback(host)


def _cors_origins(ctx, param, value):
    """``--cors-origins``: comma-separated origins (scheme://host[:port]) or ``*``, as a tuple of lower-case origins
    (the form browsers send in ``Origin``); empty: no CORS."""
    from urllib.parse import urlsplit

    out: list[str] = []
    for item in (value or "").split(","):
        origin = item.strip().rstrip("/").lower()
        if not origin:
            continue
        parts = urlsplit(origin)
        if origin not in ("*", "null") and not (parts.scheme and parts.netloc and not parts.path
                                                and not parts.query and not parts.fragment):
            raise click.BadParameter(f"expected an origin like http://localhost:3000 (or *), got '{item.strip()}'")
        out.append(origin)
    return tuple(dict.fromkeys(out))


def _defaulted(param: str) -> bool:
    """Whether the current command's ``param`` was left at its default (not given as a flag or variable)."""
    source = click.get_current_context().get_parameter_source(param)
    return source is None or source.name in ("DEFAULT", "DEFAULT_MAP")


def _keep_alive(ctx, param, value):
    if value is None:
        return None
    from octo.runtime.specs import parse_keep_alive

    try:
        return parse_keep_alive(value, "--keep-alive")
    except OctoError as err:
        raise click.BadParameter(err.message) from None


@click.command()
@click.argument("model", nargs=-1, envvar="OCTO_MODEL")
@click.option("--models-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="YAML list of models to load at start (name or path; engine, options, max_batch, pinned, "
                   "keep_alive).", **envvar("MODELS_FILE"))
@click.option("--models-dir", "models_dirs", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A folder whose models (files and model folders, at any depth) requests may load on demand, by "
                   "path or by their path inside it (repeatable; the variable takes folders separated by ':').",
              **envvar("MODELS_DIR"))
@click.option("--allow-any-path", is_flag=True,
              help="Let requests load any model file or folder this process can read (default: only catalog "
                   "models already downloaded, the models named here and files under --models-dir).",
              **envvar("ALLOW_ANY_PATH"))
@click.option("--allow-pull-hf", is_flag=True,
              help="Let Ollama's POST /api/pull download Hugging Face ids (org/name[:VARIANT]) with this server's "
                   "HF_TOKEN, within --max-pull-gb (default: catalog models only).", **envvar("ALLOW_PULL_HF"))
@click.option("--max-pull-gb", default=16.0, show_default=True, type=click.FloatRange(0),
              help="With --allow-pull-hf: the most one pull of a Hugging Face id may download, checked against the "
                   "hub's file sizes before downloading and counted while downloading (0: no cap).",
              **envvar("MAX_PULL_GB"))
@click.option("--evict-startup-models", is_flag=True,
              help="Let models loaded on demand unload the models named at start (and in --models-file) to make "
                   "room (default: those stay loaded).", **envvar("EVICT_STARTUP_MODELS"))
@click.option("--max-loaded", default=None, type=click.IntRange(0),
              help="Models loaded at once; the least recently used idle one unloads to make room (0: no limit). "
                   "Default: 3, or the number of models named here if more.", **envvar("MAX_LOADED"))
@click.option("--memory-budget", default=None, type=click.FloatRange(0),
              help="GB the loaded models may take (weights + KV + prefix-cache share, estimated); 0: no limit. "
                   "Default: a model loads on demand only if its estimate fits in the host's available memory.",
              **envvar("MEMORY_BUDGET"))
@click.option("--keep-alive", default="5m", show_default=True, callback=_keep_alive,
              help="How long a model loaded on demand stays loaded when idle (seconds or 10m, 1h; -1: forever).",
              **envvar("KEEP_ALIVE"))
@click.option("--max-keep-alive", default=None, callback=_keep_alive,
              help="The longest keep_alive a request may ask for (-1 and longer ones are held to it); default: "
                   "--keep-alive.", **envvar("MAX_KEEP_ALIVE"))
@click.option("--engine", default=None, help="Engine for the models named here (skips the auto-benchmark).",
              **envvar("ENGINE"))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.", **envvar("HOST"))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 = any free port).", **envvar("PORT"))
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Engine option, e.g. -o n_threads=2 -o n_ctx=4096 (repeatable).", **envvar("OPTIONS"))
@click.option("--lora", "lora", multiple=True, metavar="NAME=PATH", callback=_lora,
              help="LoRA adapter for the models named here (repeatable): a request picks it with model 'MODEL:NAME' "
                   "(listed in /v1/models). llama.cpp: a GGUF LoRA file; MLX: an mlx-lm adapter folder.",
              **envvar("LORA"))
@click.option("--mmproj", default=None, metavar="GGUF",
              help="The projector of a vision-language GGUF for the models named here (llama.cpp): images in prompts "
                   "(default: the one mmproj*.gguf beside the model's file; none: text only).", **envvar("MMPROJ"))
@click.option("--draft", default=None, metavar="GGUF",
              help="Speculative decoding (llama.cpp) for the models named here: a draft model with the same vocabulary "
                   "proposes tokens the model verifies in one pass (same output; -o n_draft=4, -o draft_max_batch=4).",
              **envvar("DRAFT"))
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for a batch slot; more get 503.", **envvar("MAX_QUEUE"))
@click.option("--queue-timeout", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a request may wait in the queue before 504.", **envvar("QUEUE_TIMEOUT"))
@click.option("--worker-timeout", default=10.0, show_default=True, type=click.FloatRange(1, 300),
              help="Seconds an engine worker may be silent (no heartbeat: stopped, deadlocked, or in a C call holding "
                   "the GIL) before it is killed and restarted, its requests ending with engine_hung; while it "
                   "starts or loads, at least 30 s.", **envvar("WORKER_TIMEOUT"))
@click.option("--load-timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a model load may take, and a request may wait for the load it triggered (then its "
                   "--queue-timeout starts).", **envvar("LOAD_TIMEOUT"))
@click.option("--stream-keepalive", default=5.0, show_default=True, type=click.FloatRange(0),
              help="Seconds between keep-alives of a streamed response while it waits for its model's load, the "
                   "queue or its prompt's prefill (Anthropic ping events, Responses response.in_progress, SSE "
                   "comments on chat and completions, empty chunks on Ollama's API); its headers go out after this "
                   "long at the latest, so a later error ends the stream with the API's error event (0: no "
                   "keep-alives, headers once the request is admitted).", **envvar("STREAM_KEEPALIVE"))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences decoded together (continuous batching).", **envvar("MAX_BATCH"))
@click.option("--cache-size", default=512.0, show_default=True, type=click.FloatRange(0),
              help="Prefix-cache budget in MB.", **envvar("CACHE_SIZE"))
@click.option("--no-cache", is_flag=True, help="Disable the prefix cache.", **envvar("NO_CACHE"))
@click.option("--max-body-mb", default=32.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest request body in MB (413 above).", **envvar("MAX_BODY_MB"))
@click.option("--max-audio-mb", default=25.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest audio upload in MB (413 above).", **envvar("MAX_AUDIO_MB"))
@click.option("--max-audio-seconds", default=1800.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Longest audio accepted, in seconds.", **envvar("MAX_AUDIO_SECONDS"))
@click.option("--max-image-mb", default=20.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest image a request may send, in MB (a 400 naming the image above).", **envvar("MAX_IMAGE_MB"))
@click.option("--max-images", default=16, show_default=True, type=click.IntRange(1),
              help="Images one request may send.", **envvar("MAX_IMAGES"))
@click.option("--max-image-pixels", default=32 * 2**20, show_default=True, type=click.IntRange(1),
              help="Pixels of one image, read from its header before it is decoded (a decompression bomb is a 400).",
              **envvar("MAX_IMAGE_PIXELS"))
@click.option("--allow-image-urls", default="", metavar="HOSTS",
              help="Fetch requests' remote http(s) image URLs from these hosts: comma-separated, *.example.com for "
                   "subdomains, * for any; loopback, private, link-local and reserved addresses are never fetched "
                   "(default: none, a remote image URL is a 400).", **envvar("ALLOW_IMAGE_URLS"))
@click.option("--image-url-timeout", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds the fetch of a request's image URLs may take.", **envvar("IMAGE_URL_TIMEOUT"))
@click.option("--api-key", default=None,
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route of every API (OpenAI, "
                   "Anthropic, Ollama, octo's own) but /health and the dashboard's page.", **envvar("API_KEY"))
@click.option("--insecure-no-auth", is_flag=True,
              help="Allow binding a non-loopback address without --api-key.", **envvar("INSECURE_NO_AUTH"))
@click.option("--allowed-hosts", default="", metavar="NAMES",
              help="On a loopback bind, Host names served besides local ones (localhost, *.localhost, this host's "
                   "name, loopback addresses): comma-separated, *.example for subdomains, * for any.",
              **envvar("ALLOWED_HOSTS"))
@click.option("--cors-origins", default="", callback=_cors_origins, metavar="ORIGINS",
              help="Let web pages from these origins call the API from a browser (CORS): comma-separated, e.g. "
                   "http://localhost:3000,https://app.example.com, or * for any; default: none (Ollama's routes, "
                   "/api/..., also answer the local origins Ollama answers by default).",
              **envvar("CORS_ORIGINS"))
@click.option("--plugins-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Load plugin modules (*.py) from this folder.", **envvar("PLUGINS_DIR"))
@click.option("--bench-seconds", default=3.0, show_default=True, type=click.FloatRange(0.2),
              help="Start-up benchmark time budget per candidate engine.", **envvar("BENCH_SECONDS"))
@click.option("--rebench", is_flag=True, help="Ignore cached start-up benchmark results: measure every candidate "
              "engine again before serving (even with --bench-when-idle).", **envvar("REBENCH"))
@click.option("--bench-when-idle", is_flag=True,
              help="Serve at once with the best engine this host has measured (or the first candidate) and measure "
                   "the candidate engines not measured here yet while the model is idle; the fastest then takes "
                   "over. Default: measure them before serving.", **envvar("BENCH_WHEN_IDLE"))
@click.option("--loop", "loop_name", default="auto", show_default=True,
              type=click.Choice(["auto", "uvloop", "asyncio"]),
              help="Event loop: uvloop (faster HTTP handling), asyncio, or auto (uvloop when installed).",
              **envvar("LOOP"))
@click.option("--share-cores", default="os", show_default=True, type=click.Choice(["os", "turns"]),
              help="How models in workers share the cores: os (their threads run at once, the OS scheduler shares "
                   "them; measured best here) or turns (one model computes at a time, fair turns: "
                   "octo.runtime.arbiter).",
              **envvar("SHARE_CORES"))
@click.option("--isolation", default=None, type=click.Choice(["process", "thread"]),
              help="Run each loaded model in its own worker process (a native crash costs only its requests) or in "
                   "this process; default: each engine's own (process for native engines, thread for echo).",
              **envvar("ISOLATION"))
@click.option("--preempt", default="swap", show_default=True, type=click.Choice(["swap", "recompute"]),
              help="KV pressure (a KV pool shared by the sequences is full): the youngest sequence gives its KV back "
                   "and resumes later; swap keeps its KV in host memory meanwhile, recompute feeds its tokens again.",
              **envvar("PREEMPT"))
@click.option("--step-stretch", default=2.0, show_default=True, type=float,
              help="While sequences decode, other requests' prompt chunks fill a step only until it takes this many "
                   "times a decode-only step (2: running streams keep at least half their speed while a long prompt "
                   "is read); 0: no limit (whole -o prefill chunks, the most prompt throughput).",
              **envvar("STEP_STRETCH"))
@click.option("--prefix-dedup/--no-prefix-dedup", default=True, show_default=True,
              help="A prefix several running requests share (an agent's system prompt and tools, n > 1 choices) is "
                   "computed once and shared: the others wait for it instead of computing it again.",
              **envvar("PREFIX_DEDUP"))
@click.option("--tool-format", default="auto", show_default=True,
              type=click.Choice(["auto", "hermes", "llama3", "mistral", "phi4", "gemma"]),
              help="How models write tool calls: auto detects the family from each model's chat template (as "
                   "llama.cpp does); a family name overrides it for every model.", **envvar("TOOL_FORMAT"))
@click.option("--prefix-cache-dir", default=None, type=click.Path(file_okay=False),
              help="Keep the prefix cache's long prompts (256 tokens or more) on disk in this folder too, so that long "
                   "shared prefixes (system prompts, tool catalogs, conversations) survive a restart. Off by default.",
              **envvar("PREFIX_CACHE_DIR"))
@click.option("--prefix-cache-disk-mb", default=4096.0, show_default=True, type=float,
              help="Disk budget of --prefix-cache-dir, MB (least recently used entries go first).",
              **envvar("PREFIX_CACHE_DISK_MB"))
@click.option("--reasoning-format", default="parsed", show_default=True, type=click.Choice(["parsed", "none"]),
              help="Chat answers of models whose template reasons: parsed puts the <think> text in reasoning_content "
                   "(streamed as deltas, as vLLM and llama-server do), none leaves it in content.",
              **envvar("REASONING_FORMAT"))
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM/SIGINT: seconds running and queued requests get to finish (new ones get 503) before "
                   "what remains is cancelled.", **envvar("SHUTDOWN_TIMEOUT"))
@click.option("--responses-ttl", default="30d", show_default=True, callback=lambda c, p, v: _duration(v, p),
              help="Stored responses (Responses API, store: true) expire this long after they were made, as OpenAI's "
                   "do: seconds or a duration such as 12h, 7d (0: never).", **envvar("RESPONSES_TTL"))
@click.option("--responses-max-mb", default=1024.0, show_default=True, type=click.FloatRange(0),
              help="Size cap of the stored responses, MB: over it the oldest are pruned first (0: no cap).",
              **envvar("RESPONSES_MAX_MB"))
@click.option("--cluster", default=None, metavar="ray[://ADDRESS]",
              help="Serve every model as a Ray Serve deployment: 'ray' starts a local Ray head, 'ray://HEAD:10001' "
                   "joins a cluster (pip install 'octo[ray]'). octo stays the HTTP front door.", **envvar("CLUSTER"))
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1),
              help="With --cluster: replicas per model (a models-file entry may set its own).", **envvar("REPLICAS"))
@click.option("--autoscaling", default=None, metavar="MIN:MAX[:TARGET]",
              help="With --cluster: autoscale each model between MIN and MAX replicas, aiming at TARGET ongoing "
                   "requests per replica (default 2).", **envvar("AUTOSCALING"))
@click.option("--replica-cpus", default=1.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: CPUs Ray reserves for each replica.", **envvar("REPLICA_CPUS"))
@click.option("--replica-gpus", default=0.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: GPUs Ray reserves for each replica.", **envvar("REPLICA_GPUS"))
@click.option("--replica-memory", default=0.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: memory (GB) Ray reserves for each replica (0: none).", **envvar("REPLICA_MEMORY"))
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="What the server and its engine workers log to stderr: info says what loads and why and each "
                   "refused request; debug adds details (timings, the engines' own messages); warning and error keep "
                   "only problems.",
              **envvar("LOG_LEVEL"))
def serve(model, models_file, models_dirs, allow_any_path, allow_pull_hf, max_pull_gb, evict_startup_models, max_loaded,
          memory_budget, keep_alive, max_keep_alive, engine, host, port, options, lora, draft, stream_keepalive,
          max_queue, queue_timeout, max_batch, cache_size, no_cache, max_body_mb, max_audio_mb, max_audio_seconds,
          api_key, insecure_no_auth, allowed_hosts, cors_origins, plugins_dir, bench_seconds, rebench, bench_when_idle,
          share_cores, isolation, loop_name, preempt, step_stretch, prefix_dedup, tool_format, prefix_cache_dir,
          prefix_cache_disk_mb, reasoning_format, shutdown_timeout, responses_ttl, responses_max_mb, cluster, replicas,
          autoscaling, replica_cpus, replica_gpus, replica_memory, log_level, worker_timeout, load_timeout,
          max_image_mb, max_images, max_image_pixels, allow_image_urls, image_url_timeout, mmproj):
    """Serve MODEL... (catalog name[:variant], Hugging Face id, or local path) with the OpenAI API.

    Every model named here (and in --models-file) loads at start; a request for another servable model loads it on
    demand. With no model the server starts empty. --engine and -o apply to the models named here."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(host) and not api_key and not insecure_no_auth:
        raise click.UsageError(f"refusing to serve on {host} without --api-key (anyone on the network could use "
                               "it); pass --api-key KEY, or --insecure-no-auth to accept that")
    socks = take_port(host, port)  # first the port (in use: an error now), then an engine worker, whose start and
    _prespawn(cluster, isolation, engine, worker_timeout, log_level, plugins_dir)  # imports overlap the gateway's
    loop_factory = _loop_factory(loop_name)
    if isinstance(model, str):  # OCTO_MODEL may hold several, separated by spaces
        model = tuple(model.split())
    config = ServerConfig(model=model[0] if model else "", engine=engine, host=host, port=port,
                          options=serve_options(options), keep_alive=keep_alive, max_loaded=max_loaded,
                          max_keep_alive=keep_alive if _defaulted("max_keep_alive") else max_keep_alive,
                          memory_budget_gb=memory_budget, allowed_hosts=_allowed_hosts(allowed_hosts),
                          models_dirs=_spellings(models_dirs), allow_any_path=allow_any_path, max_pull_gb=max_pull_gb,
                          allow_pull_hf=allow_pull_hf, evict_startup_models=evict_startup_models,
                          max_queue=max_queue, queue_timeout=queue_timeout, max_batch=max_batch,
                          cache_size_mb=cache_size, no_cache=no_cache, max_body_mb=max_body_mb,
                          api_key=api_key, max_audio_mb=max_audio_mb, max_audio_seconds=max_audio_seconds,
                          plugins_dir=plugins_dir, bench_seconds=bench_seconds, rebench=rebench,
                          bench_when_idle=bench_when_idle, cors_origins=cors_origins,
                          isolation=isolation, share_cores=share_cores, preempt=preempt,
                          step_stretch=step_stretch, prefix_dedup=prefix_dedup,
                          tool_format=None if tool_format == "auto" else tool_format, reasoning_format=reasoning_format,
                          prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_mb=prefix_cache_disk_mb,
                          shutdown_timeout=shutdown_timeout, responses_ttl=responses_ttl,
                          responses_max_mb=responses_max_mb)
    config.worker_timeout, config.load_timeout, config.stream_keepalive = worker_timeout, load_timeout, stream_keepalive
    if cluster or replicas != 1 or autoscaling:
        _cluster_settings(config, cluster, replicas, autoscaling, replica_cpus, replica_gpus, replica_memory)
    config.max_image_mb, config.max_images, config.max_image_pixels = max_image_mb, max_images, max_image_pixels
    config.allow_image_urls, config.image_url_timeout = _allowed_hosts(allow_image_urls), image_url_timeout
    # The event loop and the engine thread share the GIL. Python's default switch interval (5 ms) is kept: a
    # shorter one (1 ms) measured 5-10% fewer requests/s in bench/overhead.py, and native engines release the GIL.
    specs = _model_specs(config, model, models_file, lora, draft=draft, mmproj=mmproj)
    import asyncio  # (after the worker's spawn, as everything the server needs: octo.runtime.prespawn)

    from octo.cli.startup import run

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(config, specs, socks))


def _spellings(dirs: tuple[str, ...]) -> tuple[str, ...]:
    """Each --models-dir as its real path and as given (absolute): a request may spell a model's path either way."""
    return tuple(dict.fromkeys(p for d in dirs for p in (os.path.realpath(d), os.path.abspath(d))))


def _model_specs(config: ServerConfig, model: tuple[str, ...], models_file: str | None, lora: tuple, *,
                 draft: str | None, mmproj: str | None) -> list:
    """The models to load at start: those named (with -o, --lora, --draft and --mmproj) and the models file's."""
    from octo.runtime.specs import ModelSpec, load_models_file

    try:
        opts = dict(config.options)
        for flag, value in (("draft", draft), ("mmproj", mmproj)):
            if value and not (flag == "mmproj" and value.lower() == "none"):
                if not os.path.isfile(os.path.expanduser(value)):
                    raise click.BadParameter(f"nothing at {value}", param_hint=f"--{flag}")
                value = os.path.expanduser(value)
            if value:
                opts[flag] = value
        specs = [ModelSpec(m, config.engine, opts, lora=dict(lora)) for m in model]
        return specs + (load_models_file(models_file) if models_file else [])
    except OctoError as err:
        raise click.ClickException(err.message) from None


def _allowed_hosts(value: str) -> tuple[str, ...]:
    if not value:  # the default, without importing the server (aiohttp) before the engine worker starts
        return ()
    from octo.server.hostcheck import parse_allowed_hosts

    return parse_allowed_hosts(value)


def _prespawn(cluster: str | None, isolation: str | None, engine: str | None, worker_timeout: float,
              log_level: str, plugins_dir: str | None) -> None:
    """Start an engine worker now, before the gateway's own imports (octo.runtime.prespawn): its interpreter, imports
    and engine plugins overlap them, and the first model that loads in a worker takes it (or it stays as the spare
    for loads on demand). Not with --cluster (Ray runs the engines), --isolation thread, the in-process echo engine,
    or OCTO_SPARE_WORKER=0."""
    if cluster or isolation == "thread" or engine == "echo" or os.environ.get("OCTO_SPARE_WORKER", "1") == "0":
        return
    from octo.runtime.prespawn import beat_interval, prespawn

    prespawn(beat_interval(worker_timeout), log_level, plugins_dir, (engine,) if engine else ())


def _duration(value: str, param: click.Parameter) -> float:
    from octo.options import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _cluster_settings(config: ServerConfig, cluster, replicas, autoscaling, cpus, gpus, memory) -> None:
    """--cluster and the replica flags into ``config`` (checked here; ray itself is imported only when serving)."""
    from octo.runtime.specs import parse_autoscaling, parse_cluster

    if not cluster:
        raise click.UsageError("--replicas and --autoscaling need --cluster ray[://ADDRESS]")
    try:
        parse_cluster(cluster)
        config.autoscaling = parse_autoscaling(autoscaling)
    except OctoError as err:
        raise click.UsageError(err.message) from None
    config.cluster, config.replicas = cluster, replicas
    config.replica_resources = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {}),
                                **({"memory_gb": memory} if memory else {})}


def _loop_factory(name: str):
    """``new_event_loop`` of the chosen loop implementation (None: asyncio's default)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise click.UsageError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop
