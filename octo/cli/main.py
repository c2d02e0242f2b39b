"""The ``octo`` command line (click). Every ``serve`` flag can also be set with an ``OCTO_*`` variable."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
from typing import Any

import click

from octo import __version__
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


class Commands(click.Group):
    """The built-in commands at once; the others (``models``, ``pull``, ``bench``, plugins' ``register_commands``)
    once a command that is not built in is asked for, or the list of commands: ``octo serve`` imports none of them
    (the catalog, pydantic, every plugin) before it starts its engine worker."""

    extended = False

    def extend(self) -> None:
        if not self.extended:
            self.extended = True
            _add_optional_commands()
            _add_bench()
            from octo.plugins import get_plugin_manager

            try:
                get_plugin_manager().hook.register_commands(cli=self)
            except Exception as exc:  # noqa: BLE001
                click.echo(f"octo: a plugin's register_commands failed: {exc}", err=True)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and not self.extended:
            self.extend()
            command = super().get_command(ctx, name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.extend()
        return super().list_commands(ctx)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="octo")
def cli() -> None:
    """octo: an OpenAI-compatible local inference gateway that serves with the fastest engine here."""


def _env(name: str) -> dict:
    return {"envvar": f"OCTO_{name}", "show_envvar": True}


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
    from octo.runtime.registry import parse_keep_alive

    try:
        return parse_keep_alive(value, "--keep-alive")
    except OctoError as err:
        raise click.BadParameter(err.message) from None


@cli.command()
@click.argument("model", nargs=-1, envvar="OCTO_MODEL")
@click.option("--models-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="YAML list of models to load at start (name or path; engine, options, max_batch, pinned, "
                   "keep_alive).", **_env("MODELS_FILE"))
@click.option("--models-dir", "models_dirs", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A folder whose models (files and model folders, at any depth) requests may load on demand, by "
                   "path or by their path inside it (repeatable; the variable takes folders separated by ':').",
              **_env("MODELS_DIR"))
@click.option("--allow-any-path", is_flag=True,
              help="Let requests load any model file or folder this process can read (default: only catalog "
                   "models already downloaded, the models named here and files under --models-dir).",
              **_env("ALLOW_ANY_PATH"))
@click.option("--max-loaded", default=None, type=click.IntRange(0),
              help="Models loaded at once; the least recently used idle one unloads to make room (0: no limit). "
                   "Default: 3, or the number of models named here if more.", **_env("MAX_LOADED"))
@click.option("--memory-budget", default=None, type=click.FloatRange(0),
              help="GB the loaded models may take (weights + KV + prefix-cache share, estimated); 0: no limit. "
                   "Default: a model loads on demand only if its estimate fits in the host's available memory.",
              **_env("MEMORY_BUDGET"))
@click.option("--keep-alive", default="5m", show_default=True, callback=_keep_alive,
              help="How long a model loaded on demand stays loaded when idle (seconds or 10m, 1h; -1: forever).",
              **_env("KEEP_ALIVE"))
@click.option("--max-keep-alive", default=None, callback=_keep_alive,
              help="The longest keep_alive a request may ask for (-1 and longer ones are held to it); default: "
                   "--keep-alive.", **_env("MAX_KEEP_ALIVE"))
@click.option("--engine", default=None, help="Engine for the models named here (skips the auto-benchmark).",
              **_env("ENGINE"))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.", **_env("HOST"))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 = any free port).", **_env("PORT"))
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Engine option, e.g. -o n_threads=2 -o n_ctx=4096 (repeatable).", **_env("OPTIONS"))
@click.option("--lora", "lora", multiple=True, metavar="NAME=PATH", callback=_lora,
              help="LoRA adapter for the models named here (repeatable): a request picks it with model 'MODEL:NAME' "
                   "(listed in /v1/models). llama.cpp: a GGUF LoRA file; MLX: an mlx-lm adapter folder.",
              **_env("LORA"))
@click.option("--draft", default=None, metavar="GGUF",
              help="Speculative decoding (llama.cpp) for the models named here: a draft model with the same vocabulary "
                   "proposes tokens the model verifies in one pass (same output; -o n_draft=4, -o draft_max_batch=4).",
              **_env("DRAFT"))
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for a batch slot; more get 503.", **_env("MAX_QUEUE"))
@click.option("--queue-timeout", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a request may wait in the queue before 504.", **_env("QUEUE_TIMEOUT"))
@click.option("--worker-timeout", default=10.0, show_default=True, type=click.FloatRange(1, 300),
              help="Seconds an engine worker may be silent (no heartbeat: stopped, deadlocked, or in a C call holding "
                   "the GIL) before it is killed and restarted, its requests ending with engine_hung; while it "
                   "starts or loads, at least 30 s.", **_env("WORKER_TIMEOUT"))
@click.option("--load-timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a model load may take, and a request may wait for the load it triggered (then its "
                   "--queue-timeout starts).", **_env("LOAD_TIMEOUT"))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences decoded together (continuous batching).", **_env("MAX_BATCH"))
@click.option("--cache-size", default=512.0, show_default=True, type=click.FloatRange(0),
              help="Prefix-cache budget in MB.", **_env("CACHE_SIZE"))
@click.option("--no-cache", is_flag=True, help="Disable the prefix cache.", **_env("NO_CACHE"))
@click.option("--max-body-mb", default=32.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest request body in MB (413 above).", **_env("MAX_BODY_MB"))
@click.option("--max-audio-mb", default=25.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest audio upload in MB (413 above).", **_env("MAX_AUDIO_MB"))
@click.option("--max-audio-seconds", default=1800.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Longest audio accepted, in seconds.", **_env("MAX_AUDIO_SECONDS"))
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/*.",
              **_env("API_KEY"))
@click.option("--insecure-no-auth", is_flag=True,
              help="Allow binding a non-loopback address without --api-key.", **_env("INSECURE_NO_AUTH"))
@click.option("--allowed-hosts", default="", metavar="NAMES",
              help="On a loopback bind, Host names served besides local ones (localhost, *.localhost, this host's "
                   "name, loopback addresses): comma-separated, *.example for subdomains, * for any.",
              **_env("ALLOWED_HOSTS"))
@click.option("--cors-origins", default="", callback=_cors_origins, metavar="ORIGINS",
              help="Let web pages from these origins call the API from a browser (CORS): comma-separated, e.g. "
                   "http://localhost:3000,https://app.example.com, or * for any; default: none.",
              **_env("CORS_ORIGINS"))
@click.option("--plugins-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Load plugin modules (*.py) from this folder.", **_env("PLUGINS_DIR"))
@click.option("--bench-seconds", default=3.0, show_default=True, type=click.FloatRange(0.2),
              help="Start-up benchmark time budget per candidate engine.", **_env("BENCH_SECONDS"))
@click.option("--rebench", is_flag=True, help="Ignore cached start-up benchmark results.", **_env("REBENCH"))
@click.option("--loop", "loop_name", default="auto", show_default=True,
              type=click.Choice(["auto", "uvloop", "asyncio"]),
              help="Event loop: uvloop (faster HTTP handling), asyncio, or auto (uvloop when installed).",
              **_env("LOOP"))
@click.option("--share-cores", default="os", show_default=True, type=click.Choice(["os", "turns"]),
              help="How models in workers share the cores: os (their threads run at once, the OS scheduler shares "
                   "them; measured best here) or turns (one model computes at a time, fair turns: "
                   "octo.runtime.arbiter).",
              **_env("SHARE_CORES"))
@click.option("--isolation", default=None, type=click.Choice(["process", "thread"]),
              help="Run each loaded model in its own worker process (a native crash costs only its requests) or in "
                   "this process; default: each engine's own (process for native engines, thread for echo).",
              **_env("ISOLATION"))
@click.option("--preempt", default="swap", show_default=True, type=click.Choice(["swap", "recompute"]),
              help="KV pressure (a KV pool shared by the sequences is full): the youngest sequence gives its KV back "
                   "and resumes later; swap keeps its KV in host memory meanwhile, recompute feeds its tokens again.",
              **_env("PREEMPT"))
@click.option("--step-stretch", default=2.0, show_default=True, type=float,
              help="While sequences decode, other requests' prompt chunks fill a step only until it takes this many "
                   "times a decode-only step (2: running streams keep at least half their speed while a long prompt "
                   "is read); 0: no limit (whole -o prefill chunks, the most prompt throughput).",
              **_env("STEP_STRETCH"))
@click.option("--prefix-dedup/--no-prefix-dedup", default=True, show_default=True,
              help="A prefix several running requests share (an agent's system prompt and tools, n > 1 choices) is "
                   "computed once and shared: the others wait for it instead of computing it again.",
              **_env("PREFIX_DEDUP"))
@click.option("--tool-format", default="auto", show_default=True,
              type=click.Choice(["auto", "hermes", "llama3", "mistral", "phi4", "gemma"]),
              help="How models write tool calls: auto detects the family from each model's chat template (as "
                   "llama.cpp does); a family name overrides it for every model.", **_env("TOOL_FORMAT"))
@click.option("--prefix-cache-dir", default=None, type=click.Path(file_okay=False),
              help="Keep the prefix cache's long prompts (256 tokens or more) on disk in this folder too, so that long "
                   "shared prefixes (system prompts, tool catalogs, conversations) survive a restart. Off by default.",
              **_env("PREFIX_CACHE_DIR"))
@click.option("--prefix-cache-disk-mb", default=4096.0, show_default=True, type=float,
              help="Disk budget of --prefix-cache-dir, MB (least recently used entries go first).",
              **_env("PREFIX_CACHE_DISK_MB"))
@click.option("--reasoning-format", default="parsed", show_default=True, type=click.Choice(["parsed", "none"]),
              help="Chat answers of models whose template reasons: parsed puts the <think> text in reasoning_content "
                   "(streamed as deltas, as vLLM and llama-server do), none leaves it in content.",
              **_env("REASONING_FORMAT"))
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM/SIGINT: seconds running and queued requests get to finish (new ones get 503) before "
                   "what remains is cancelled.", **_env("SHUTDOWN_TIMEOUT"))
@click.option("--responses-ttl", default="30d", show_default=True, callback=lambda c, p, v: _duration(v, p),
              help="Stored responses (Responses API, store: true) expire this long after they were made, as OpenAI's "
                   "do: seconds or a duration such as 12h, 7d (0: never).", **_env("RESPONSES_TTL"))
@click.option("--responses-max-mb", default=1024.0, show_default=True, type=click.FloatRange(0),
              help="Size cap of the stored responses, MB: over it the oldest are pruned first (0: no cap).",
              **_env("RESPONSES_MAX_MB"))
@click.option("--cluster", default=None, metavar="ray[://ADDRESS]",
              help="Serve every model as a Ray Serve deployment: 'ray' starts a local Ray head, 'ray://HEAD:10001' "
                   "joins a cluster (pip install 'octo[ray]'). octo stays the HTTP front door.", **_env("CLUSTER"))
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1),
              help="With --cluster: replicas per model (a models-file entry may set its own).", **_env("REPLICAS"))
@click.option("--autoscaling", default=None, metavar="MIN:MAX[:TARGET]",
              help="With --cluster: autoscale each model between MIN and MAX replicas, aiming at TARGET ongoing "
                   "requests per replica (default 2).", **_env("AUTOSCALING"))
@click.option("--replica-cpus", default=1.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: CPUs Ray reserves for each replica.", **_env("REPLICA_CPUS"))
@click.option("--replica-gpus", default=0.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: GPUs Ray reserves for each replica.", **_env("REPLICA_GPUS"))
@click.option("--replica-memory", default=0.0, show_default=True, type=click.FloatRange(0),
              help="With --cluster: memory (GB) Ray reserves for each replica (0: none).", **_env("REPLICA_MEMORY"))
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), **_env("LOG_LEVEL"))
def serve(model, models_file, models_dirs, allow_any_path, max_loaded, memory_budget, keep_alive, max_keep_alive,
          engine, host, port, options, lora, draft,
          max_queue, queue_timeout, max_batch, cache_size, no_cache, max_body_mb, max_audio_mb, max_audio_seconds,
          api_key, insecure_no_auth, allowed_hosts, cors_origins, plugins_dir, bench_seconds, rebench, share_cores,
          isolation, loop_name, preempt, step_stretch, prefix_dedup, tool_format, prefix_cache_dir,
          prefix_cache_disk_mb, reasoning_format, shutdown_timeout, responses_ttl, responses_max_mb, cluster, replicas,
          autoscaling, replica_cpus, replica_gpus, replica_memory, log_level, worker_timeout, load_timeout):
    """Serve MODEL... (catalog name[:variant], Hugging Face id, or local path) with the OpenAI API.

    Every model named here (and in --models-file) loads at start; a request for another servable model loads it on
    demand. With no model the server starts empty. --engine and -o apply to the models named here."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # first of all, an engine worker: its start and imports overlap the gateway's (aiohttp, the server, ...)
    _prespawn(cluster, isolation, engine, worker_timeout, log_level, plugins_dir)
    loop_factory = _loop_factory(loop_name)
    if not _is_loopback(host) and not api_key and not insecure_no_auth:
        raise click.UsageError(f"refusing to serve on {host} without --api-key (anyone on the network could use "
                               "it); pass --api-key KEY, or --insecure-no-auth to accept that")
    if isinstance(model, str):  # OCTO_MODEL may hold several, separated by spaces
        model = tuple(model.split())
    config = ServerConfig(model=model[0] if model else "", engine=engine, host=host, port=port,
                          options=serve_options(options), keep_alive=keep_alive, max_loaded=max_loaded,
                          memory_budget_gb=memory_budget,
                          max_keep_alive=keep_alive if _defaulted("max_keep_alive") else max_keep_alive,
                          allowed_hosts=_allowed_hosts(allowed_hosts),
                          models_dirs=tuple(os.path.realpath(d) for d in models_dirs), allow_any_path=allow_any_path,
                          max_queue=max_queue, queue_timeout=queue_timeout, max_batch=max_batch,
                          cache_size_mb=cache_size, no_cache=no_cache, max_body_mb=max_body_mb,
                          api_key=api_key, max_audio_mb=max_audio_mb, max_audio_seconds=max_audio_seconds,
                          plugins_dir=plugins_dir, bench_seconds=bench_seconds, rebench=rebench,
                          cors_origins=cors_origins,
                          isolation=isolation, share_cores=share_cores, preempt=preempt,
                          step_stretch=step_stretch, prefix_dedup=prefix_dedup,
                          tool_format=None if tool_format == "auto" else tool_format, reasoning_format=reasoning_format,
                          prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_mb=prefix_cache_disk_mb,
                          shutdown_timeout=shutdown_timeout, responses_ttl=responses_ttl,
                          responses_max_mb=responses_max_mb)
    config.worker_timeout, config.load_timeout = worker_timeout, load_timeout
    if cluster or replicas != 1 or autoscaling:
        _cluster_settings(config, cluster, replicas, autoscaling, replica_cpus, replica_gpus, replica_memory)
    # The event loop and the engine thread share the GIL. Python's default switch interval (5 ms) is kept: a
    # shorter one (1 ms) measured 5-10% fewer requests/s in bench/overhead.py, and native engines release the GIL.
    from octo.runtime.registry import ModelSpec, load_models_file

    try:
        opts = dict(config.options)
        if draft:
            if not os.path.isfile(os.path.expanduser(draft)):
                raise click.BadParameter(f"nothing at {draft}", param_hint="--draft")
            opts["draft"] = os.path.expanduser(draft)
        specs = [ModelSpec(m, config.engine, opts, lora=dict(lora)) for m in model]
        specs += load_models_file(models_file) if models_file else []
    except OctoError as err:
        raise click.ClickException(err.message) from None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(config, specs))


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
    from octo.runtime.prespawn import prespawn
    from octo.runtime.supervision import beat_interval

    prespawn(beat_interval(worker_timeout), log_level, plugins_dir, (engine,) if engine else ())


def _duration(value: str, param: click.Parameter) -> float:
    from octo.serving.response_store import parse_duration

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


def _url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _loop_label(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _start_registry(config: ServerConfig, specs: list, pm: Any) -> Any:
    """The registry with the models named at start-up loaded (and the Ray cluster joined, with --cluster)."""
    from octo.plugins import engine_registry
    from octo.runtime.registry import Registry

    registry = Registry(config, engine_registry(pm), say=lambda m: click.echo(m, err=True))
    # each model a Ray Serve deployment (octo.cluster.deploy); without --cluster ray is never imported
    if config.cluster:
        import importlib.util

        from octo.cluster.deploy import Cluster

        if importlib.util.find_spec("ray") is None:
            raise click.ClickException("--cluster needs Ray: pip install 'octo[ray]'")
        registry.cluster = Cluster(config, say=registry.say)
        try:
            await registry.cluster.start()
        except Exception as exc:  # noqa: BLE001 - a cluster that cannot be reached: say why and stop
            raise click.ClickException(f"--cluster {config.cluster}: {type(exc).__name__}: {exc}") from None
    try:  # engine workers are children of this event loop's thread: they die with it, never before
        await registry.start(specs)
    except BaseException as exc:
        await registry.close()
        if isinstance(exc, OctoError):
            raise click.ClickException(exc.message) from None
        raise
    return registry


async def _serve(config: ServerConfig, specs: list) -> None:
    from octo.plugins import load_plugins

    registry = loading = starting = None
    socks: list = []
    try:
        pm = load_plugins(config.plugins_dir)
        if not config.cluster:  # the models' loads start first; the server's own imports run while they load
            starting = asyncio.get_running_loop().create_task(_start_registry(config, specs, pm))
            await _until_loading(starting)
        from octo.server import listen

        try:  # the port before anything slow: in use is an error now, not after the load, and nothing started
            socks = listen.open_sockets(config.host, config.port)  # meanwhile (a Ray head's services) takes it
        except OSError as exc:
            raise click.ClickException(f"cannot serve: {exc.strerror or exc}") from None
        if starting is None:
            starting = asyncio.get_running_loop().create_task(_start_registry(config, specs, pm))
        from aiohttp import web

        from octo.server.app import create_app, error_response
        from octo.server.hostcheck import HostGuard

        names = [] if config.api_key else [s.model for s in specs]  # behind a key, /health says the status only
        guard = HostGuard(config.host, config.allowed_hosts, config.cors_origins)
        loading = await listen.loading_responder(socks, error_response, names, guard)  # 503 until serving
        registry = await starting
        app = create_app(config, registry, plugin_manager=pm)
        await loading.cleanup()  # closes its duplicates of the sockets; the API takes them over, backlog and all
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()  # (activates the loaded models)
        for sock in socks:
            await web.SockSite(runner, sock).start()
    except BaseException:  # whatever failed, nothing stays running: the process ends instead of hanging
        if loading is not None:
            await loading.cleanup()
        if registry is None and starting is not None:
            registry = await _cancelled(starting)
        if registry is not None:
            await registry.close()
        from octo.runtime.prespawn import discard_all

        discard_all()
        for sock in socks:
            sock.close()
        raise
    from octo.runtime.process import SPARE

    await SPARE.enable(config.worker_timeout, config.plugins_dir)
    port = socks[0].getsockname()[1]
    # Everything loaded so far (libraries, model, app) lives as long as the server: move it out of the cyclic
    # GC's sight, so full collections stay short (bench/overhead.py: p99 at concurrency 64 went from 45 to 14 ms).
    gc.collect()
    gc.freeze()
    # A request allocates a few hundred objects: with the default threshold (700) a young-generation collection ran
    # about every other request; fewer, larger ones cost less CPU a request (bench/overhead.py, CPU per request)
    gc.set_threshold(20_000, 50, 100)
    loop = asyncio.get_running_loop()
    served = ", ".join(f"'{s.name}' with {s.handle.engine_name} ("
                       + (f"worker pid {s.handle.worker.pid})" if s.handle.isolation == "process" else
                          f"{s.handle.cluster_info()['replicas']} Ray Serve replica(s))"
                          if s.handle.isolation == "cluster" else "in-process)")
                       for s in registry.loaded()) or "no model yet (loaded on demand)"
    base = f"http://{_url_host(config.host)}:{port}"
    click.echo(f"octo: serving {served} at {base}/v1 "
               f"(max batch {config.max_batch}, queue {config.max_queue}, {_loop_label(loop)} loop); "
               f"dashboard at {base}/", err=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await _drain(app, config.shutdown_timeout)
    finally:
        click.echo("octo: shutting down", err=True)
        await runner.cleanup()


async def _until_loading(starting: asyncio.Task, limit: float = 5.0) -> None:
    """Wait until the first model's load is handed to its engine (or the start ends, or has no model to load), at
    most ``limit`` seconds."""
    from octo.runtime.prespawn import LOADS

    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not starting.done() and LOADS[0] == 0 and loop.time() < deadline:
        await asyncio.sleep(0.005)


async def _cancelled(task: asyncio.Task) -> Any:
    """``task``'s result if it finished, else None once it is cancelled (its own clean-up done)."""
    if not task.done():
        task.cancel()
    try:
        return await task
    except BaseException:  # noqa: BLE001 - cancelled, or the failure already being raised
        return None


async def _drain(app, timeout: float) -> None:
    """Graceful shutdown: new requests get 503 (``AppState.draining``) while running and queued ones finish, up to
    ``timeout`` seconds; then the models stop, which ends what remains (a 503, or an error event and [DONE] on a
    stream) and the handlers get a moment to write that out."""
    from octo.server.state import STATE

    state = app[STATE]
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    if state.inflight:
        click.echo(f"octo: draining {state.inflight} request(s) (up to {timeout:g} s; new requests get 503)", err=True)
    while state.inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.inflight:
        click.echo(f"octo: {state.inflight} request(s) still running after {timeout:g} s; cancelling them", err=True)
    await state.registry.close()
    deadline = loop.time() + 5.0
    while state.inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, **_env("HOST"))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), **_env("PORT"))
@click.option("--api-key", default=None, **_env("API_KEY"))
@click.option("--all", "show_all", is_flag=True, help="Also list servable models that are not loaded.")
@click.option("--json", "as_json", is_flag=True)
def ps(host, port, api_key, show_all, as_json):
    """List the models a running `octo serve` has loaded (like `ollama ps`)."""
    import urllib.error
    import urllib.request

    base = f"http://{_url_host(host)}:{port}"
    req = urllib.request.Request(f"{base}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())["data"]
    except urllib.error.HTTPError as exc:  # it answered: say what it said (401, 503 while it starts, ...)
        try:
            why = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError, OSError):
            why = str(exc)
        raise click.ClickException(f"octo at {base} answered {exc.code}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise click.ClickException(f"no octo server answered at {base}: {exc}") from None
    rows = [m for m in data if show_all or m["state"] not in ("available", "failed")]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    import time as _time

    table = []
    for m in rows:
        mem = (m.get("memory") or {}).get("measured_bytes") or (m.get("memory") or {}).get("estimated_bytes")
        exp = m.get("expires_at")
        table.append({"name": m["id"], "engine": m.get("engine"), "state": m["state"],
                      "where": (f"pid {m['worker']['pid']}" if m.get("worker") else m.get("isolation")),
                      "memory": f"{mem / 2**20:.0f} MB" if mem else None,
                      "until": "forever" if exp is None and m["state"] == "ready" else
                      (f"{max(0, exp - _time.time()):.0f} s" if exp else None),
                      "in_flight": m.get("requests_in_flight")})
    if not table:
        click.echo("no model loaded")
        return
    print_table(table, ["name", "engine", "state", "where", "memory", "until", "in_flight"])


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, "") if r.get(c) is not None else "-")) for r in rows))
              for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        click.echo("  ".join(str(r.get(c) if r.get(c) is not None else "-").ljust(widths[c]) for c in columns))


@cli.command()
@click.argument("model", required=False)
@click.option("--engine", default=None, help="With MODEL: only this engine.")
@click.option("--bench-seconds", default=3.0, show_default=True, type=click.FloatRange(0.2))
@click.option("--rebench", is_flag=True, help="Ignore cached benchmark results.")
@click.option("--isolation", default=None, type=click.Choice(["process", "thread"]),
              help="Measure each candidate in its own worker process, or in this process.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (what GET /v1/engines returns).")
def engines(model, engine, bench_seconds, rebench, isolation, as_json):
    """List engines (available here or why not, tasks, formats); with MODEL, run the engine selection too.

    `octo engines MODEL` shows what `octo serve MODEL` would choose and why, without serving.
    """
    from octo.plugins import engine_registry
    from octo.runtime.loader import engine_rows, open_model

    out: dict = {"object": "list"}
    if model:
        config = ServerConfig(model=model, engine=engine, bench_seconds=bench_seconds, rebench=rebench,
                              isolation=isolation)

        async def run():
            opened = await open_model(config, say=lambda m: click.echo(m, err=True))
            await opened[0].close()
            return opened

        try:
            handle, rows = asyncio.run(run())
        except OctoError as err:
            raise click.ClickException(err.message) from None
        out.update(active=handle.engine_name, model=handle.name, selection=handle.selection)
    else:
        rows = engine_rows(engine_registry())
    out["data"] = rows
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    table = []
    for r in rows:
        b = r.get("benchmark") or {}
        table.append({**r, "tasks": ",".join(r["tasks"]) or None, "formats": ",".join(r["formats"]) or None,
                      "score": b.get("score"), "decode_tok_s": b.get("decode_tok_s"),
                      "reason": b.get("error") or r.get("reason")})
    print_table(table, ["name", "available", "active", "version", "tasks", "formats", "batching", "score",
                         "decode_tok_s", "reason"])
    if model:
        click.echo(f"selection: {out['selection']['reason']}")
    else:
        click.echo("These are the engines installed here. Which one a running server uses for each model: "
                   "`octo ps` (or GET /v1/engines on the server); what `octo serve MODEL` would choose: "
                   "`octo engines MODEL`.")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def plugins(as_json):
    """List loaded plugins and the hooks each implements."""
    from octo.plugins import plugin_table

    rows = plugin_table()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        r["hooks"] = ",".join(r["hooks"]) or None
    print_table(rows, ["name", "hooks", "error"])


def _add_optional_commands() -> None:
    try:
        from octo.cli.models import models, pull
    except ImportError:
        return
    cli.add_command(models)
    cli.add_command(pull)


def _add_bench() -> None:
    from octo.cli.bench import bench

    cli.add_command(bench)


def main() -> None:
    cli(prog_name="octo")


if __name__ == "__main__":
    sys.exit(main())
