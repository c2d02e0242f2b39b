"""``octo serve`` from its settings to its end: the port is taken first (``octo.cli.common.take_port``, before the
engine worker starts: in use is an error at once), the models start loading (in the worker started before the
gateway's imports) and the port answers 503 while they load, then the API serves until SIGINT or SIGTERM, and
drains."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

import click

from octo.cli.common import take_port, url_host
from octo.config import ServerConfig
from octo.errors import OctoError


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


async def run(config: ServerConfig, specs: list, socks: list | None = None) -> None:
    """Serve on ``socks`` (taken now when not given) until SIGINT or SIGTERM, then drain
    (``config.shutdown_timeout``) and stop."""
    registry, runner, port = await _start(config, specs, socks or take_port(config.host, config.port))
    from octo.runtime.process import SPARE

    await SPARE.enable(config.worker_timeout, config.plugins_dir, lull=registry.lull)
    _settle_heap()
    loop = asyncio.get_running_loop()
    base = f"http://{url_host(config.host)}:{port}"
    click.echo(f"octo: serving {_served(registry)} at {base}/v1 "
               f"(max batch {config.max_batch}, queue {config.max_queue}, {_loop_label(loop)} loop); "
               f"dashboard at {base}/", err=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await _drain(runner.app, config.shutdown_timeout)
    finally:
        click.echo("octo: shutting down", err=True)
        await runner.cleanup()


async def _start(config: ServerConfig, specs: list, socks: list) -> tuple[Any, Any, int]:
    """On the sockets taken already, the models' loads start first and the server's own imports run while they
    load; the port answers 503 until the API serves. Returns (the registry, the app's runner, the port)."""
    from octo.plugins import load_plugins

    registry = loading = starting = None
    try:
        pm = load_plugins(config.plugins_dir)
        if not config.cluster:  # the models' loads start first; the server's own imports run while they load
            starting = asyncio.get_running_loop().create_task(_start_registry(config, specs, pm))
            await until_loading(starting)
        from octo.server import listen

        if starting is None:
            starting = asyncio.get_running_loop().create_task(_start_registry(config, specs, pm))
        from aiohttp import web

        from octo.server.app import create_app
        from octo.server.guard import error_response
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
        await _undo(loading, starting, registry, socks)
        raise
    return registry, runner, socks[0].getsockname()[1]


async def _undo(loading: Any, starting: asyncio.Task | None, registry: Any, socks: list) -> None:
    """Stop what a failed start started: the 503 responder, the registry (its loads cancelled), the pre-spawned
    worker, the sockets."""
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


def _settle_heap() -> None:
    """The garbage collector for a long-running server."""
    # Everything loaded so far (libraries, model, app) lives as long as the server: move it out of the cyclic
    # GC's sight, so full collections stay short (bench/overhead.py: p99 at concurrency 64 went from 45 to 14 ms).
    gc.collect()
    gc.freeze()
    # A request allocates a few hundred objects: with the default threshold (700) a young-generation collection ran
    # about every other request; fewer, larger ones cost less CPU a request (bench/overhead.py, CPU per request)
    gc.set_threshold(20_000, 50, 100)


def _served(registry: Any) -> str:
    """The start-up line's account of the models loaded and where each runs."""
    return ", ".join(f"'{s.name}' with {s.handle.engine_name} ("
                     + (f"worker pid {s.handle.worker.pid})" if s.handle.isolation == "process" else
                        f"{s.handle.cluster_info()['replicas']} Ray Serve replica(s))"
                        if s.handle.isolation == "cluster" else "in-process)")
                     for s in registry.loaded()) or "no model yet (loaded on demand)"


async def until_loading(starting: asyncio.Task, limit: float = 5.0) -> None:
    """Wait until the first model's load is handed to its engine (or the start ends, or has no model to load), at
    most ``limit`` seconds; the hand-off itself wakes it (``prespawn.LOAD_HANDED_OVER``)."""
    from octo.runtime.prespawn import LOAD_HANDED_OVER

    loop = asyncio.get_running_loop()
    handed = loop.create_future()

    def wake() -> None:  # on the thread that hands the load over
        loop.call_soon_threadsafe(lambda: handed.done() or handed.set_result(None))

    LOAD_HANDED_OVER.add_callback(wake)
    try:
        await asyncio.wait((starting, handed), timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    finally:
        LOAD_HANDED_OVER.remove_callback(wake)
        handed.cancel()


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
