"""What runs inside Ray: one replica of a model deployment, and the gateway's session-affinity request router.

Imported only with ``octo serve --cluster`` (it imports ray). A replica is an ordinary octo model: it resolves the
model and chooses its engine with ``octo.runtime.loader.open_model`` on its own node (the start-up benchmark there), and
serves it with the same :class:`octo.runtime.worker.Worker` an engine worker process runs (``WorkerScheduler``, prefix
cache, constraints), whose messages go to per-request Ray streams instead of a socket. The gateway reads those
streams with the same event handling as a worker's (``octo.runtime.handle.Forwarder.on_wire``, events of
``octo.scheduler.events``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import os
import random
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from octo.config import ServerConfig
from octo.errors import OctoError
from octo.logsafe import quoted
from octo.scheduler.events import DONE
from octo.serving import openai as serving

log = logging.getLogger("octo.cluster.deploy")
_ids = itertools.count(1)


class _Demux:
    """Stands in for a worker's socket sender: event batches go to the asyncio queue of their request's stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lock = threading.Lock()
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.streams: dict[int, asyncio.Queue] = {}
        self.fault: str | None = None

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.send_locked(msg)

    def send_locked(self, msg: tuple) -> None:
        if msg[0] == "ev":
            by_rid: dict[int, list] = {}
            for item in msg[1]:
                by_rid.setdefault(item[0], []).append(item)
            if threading.get_ident() == self.loop_thread:
                self._deliver(by_rid)
            else:
                self.loop.call_soon_threadsafe(self._deliver, by_rid)
        elif msg[0] == "fault":  # the worker exits next (os._exit): Ray restarts this replica
            self.fault = msg[1]

    def _deliver(self, by_rid: dict[int, list]) -> None:
        for rid, items in by_rid.items():
            q = self.streams.get(rid)
            if q is not None:
                q.put_nowait(items)


class OctoReplica:
    """One replica of a model deployment (wrapped by ``serve.deployment`` in ``octo.cluster.deploy``)."""

    async def __init__(self, config: ServerConfig, plugins_dir: str | None, download: bool) -> None:
        from octo.plugins import engine_registry, load_plugins
        from octo.runtime.loader import open_model
        from octo.runtime.worker import Worker

        logging.basicConfig(level=os.environ.get("OCTO_LOG_LEVEL", "INFO").upper())
        # the replica is the isolation unit here: a native crash ends this actor and Ray Serve restarts it
        # and it measures its candidate engines before serving: it has no registry of idle models to measure them
        # later (--bench-when-idle does not apply)
        config = dataclasses.replace(config, isolation="thread", bench_when_idle=False)
        self.config = config
        t0 = time.monotonic()
        engines = engine_registry(load_plugins(plugins_dir))
        handle, rows = await open_model(config, engines, say=log.info, download=download)
        loop = asyncio.get_running_loop()
        self.demux = _Demux(loop)
        self.worker = Worker(self.demux, loop)  # the same worker an engine process runs, unchanged
        self.worker.engine_thread.shutdown(wait=False)  # the engine stays on the thread that loaded it
        self.worker.engine, self.worker.engine_thread = handle.engine, handle.engine_thread
        self.worker.spec = {"name": handle.name, "artifact": handle.artifact}
        self.threads = await self._fit_threads(handle)
        self.worker.op_serve(config)
        ctx = serve.get_replica_context()
        self.meta = {"replica": ctx.replica_id.unique_id, "node_id": ray.get_runtime_context().get_node_id(),
                     "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "name": handle.name,
                     "aliases": list(handle.aliases), "engine": handle.engine_name, "info": handle.info,
                     "batching": handle.engine.batching, "version": handle.engine_cls.version(),
                     "selection": handle.selection, "benchmarks": handle.benchmarks, "rows": rows,
                     "load_seconds": round(time.monotonic() - t0, 3), "threads": self.threads}
        log.info("octo replica %s: '%s' ready with %s", self.meta["replica"], quoted(handle.name, bare=True),
                 handle.engine_name)

    async def _fit_threads(self, handle: Any) -> int | None:
        """Compute with as many threads as the CPUs Ray reserved for this replica (when fewer than the node's cores
        and the user set no thread option): replicas sharing a node then share its cores instead of each running a
        pool as wide as the node (two busy pools on the same cores collapse both)."""
        counts = handle.engine.thread_counts()
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if not counts or not cpus or any("thread" in k for k in self.config.options):
            return counts[0] if counts else None
        want = max(1, int(cpus))
        if want >= counts[0]:
            return counts[0]
        usable = [n for n in counts if n <= want] or [min(counts)]
        n = max(usable)
        await asyncio.get_running_loop().run_in_executor(handle.engine_thread, handle.engine.set_threads, n)
        return n

    # -- requests ----------------------------------------------------------------------------------------
    async def run(self, kind: str, req: Any, affinity: str | None = None) -> tuple[str, list]:
        """A request that is not streamed: every event in one answer (one round trip instead of one per step)."""
        events: list = []
        gen = self.generate(kind, req, affinity)
        try:
            async for item in gen:
                if isinstance(item, list):
                    events += item
        finally:
            await gen.aclose()
        return self.meta["replica"], events

    async def generate(self, kind: str, req: Any, affinity: str | None = None):
        """One generation request: first ("replica", who), then the worker's event batches until every sequence
        has its result; cancelled with the stream (its sequences leave the batch at the next step)."""
        rid = next(_ids)
        q: asyncio.Queue = asyncio.Queue()
        self.demux.streams[rid] = q
        expected = serving.sequence_count(kind, req)
        finished = 0
        try:
            yield ("replica", self.meta["replica"])
            self.worker.on_message(("gen", rid, kind, req))
            while finished < expected:
                batch = await q.get()
                while not q.empty():  # what came meanwhile goes in the same message
                    batch += q.get_nowait()
                for _rid, code, index, _value in batch:
                    if code >= DONE:
                        finished = expected if index < 0 else finished + 1
                yield batch
        finally:
            self.demux.streams.pop(rid, None)
            if finished < expected:
                self.worker.on_message(("cancel", rid))

    async def op(self, name: str, *args: Any) -> tuple[str, bool, Any]:
        """(replica, ok, value) of a model operation: call, prompt_texts, count_tokens, tokenize, detokenize, stats,
        info. Errors come back as values (an OctoError keeps its status and shape)."""
        who = self.meta["replica"]
        try:
            if name == "info":
                return who, True, self.meta
            if name == "stats":
                return who, True, self._stats()
            handle = self.worker.handle
            value = await getattr(handle, name)(*args)
            return who, True, value
        except OctoError as exc:
            return who, False, exc
        except Exception as exc:  # noqa: BLE001 - the gateway answers with the reason, never a traceback
            return who, False, OctoError(f"{type(exc).__name__}: {exc}")

    def _stats(self) -> dict[str, Any]:
        from octo.runtime.model import local_stats

        return {**local_stats(self.worker.handle), "replica": self.meta["replica"], "node_id": self.meta["node_id"],
                "node_ip": self.meta["node_ip"], "pid": self.meta["pid"]}

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the Serve controller: where this replica runs and its queue/cache numbers (the gateway shows
        them in /v1/models and /v1/queue/stats)."""
        return self._stats()

    def check_health(self) -> None:
        if self.demux.fault is not None:
            raise RuntimeError(self.demux.fault)
        handle = self.worker.handle
        if handle is not None and handle.state != "ready":
            raise RuntimeError(f"engine {handle.state}: {handle.reason}")

    def __del__(self) -> None:
        handle = getattr(getattr(self, "worker", None), "handle", None)
        if handle is not None:
            try:
                handle.stop()
            except Exception:  # noqa: BLE001
                pass


# -- the gateway's request router -----------------------------------------------------------------------------
ROUTERS: dict[str, AffinityRouter] = {}  # application name -> its router in this process (replica listing)


def _score(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


class AffinityRouter(RequestRouter):
    """Requests of one conversation go to the same replica (rendezvous hashing of the request's affinity key over
    the running replicas, so adding or losing one moves only its share); that replica is the first rank and the
    others follow, so a full preferred replica spills over instead of queueing. Requests without a key: the power
    of two choices, as Ray Serve's default router."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.app = kwargs.get("app") or self._deployment_id.app_name
        self.routed: dict[str, int] = {}  # replica id -> requests routed from this gateway
        from octo.cluster import (
            replica as cluster_replica,  # the module itself: Ray may have rebuilt this class's globals by value
        )

        cluster_replica.ROUTERS[self.app] = self

    def replicas(self) -> list[RunningReplica]:
        return list(self._replicas.values())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if key:
            ranked = sorted(candidate_replicas, key=lambda r: _score(key, r.replica_id.unique_id), reverse=True)
            return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        rid = replica_id.unique_id
        if not hasattr(self, "routed"):
            self.routed = {}
        self.routed[rid] = self.routed.get(rid, 0) + 1
