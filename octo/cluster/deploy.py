"""Scale-out on Ray Serve (``octo serve --cluster ray[://ADDRESS]``): each model is a Ray Serve deployment whose
replicas each run an ordinary octo model (``octo.cluster.replica``); octo's aiohttp app stays the front door and
forwards to the deployment's handle, so endpoints, errors, auth, metrics and streaming are those of a local model.

:class:`Cluster` connects to Ray (or starts a small local head) and deploys models; :class:`ClusterHandle` is a model
served by a deployment: an ``octo.runtime.handle.Handle`` sharing the worker handle's forwarding
(``octo.runtime.handle.Forwarder``;
the registry and the route handlers cannot tell them apart). Backpressure: a replica takes at most
``max_batch + max_queue`` requests (``max_ongoing_requests``) and the gateway queues at most ``max_batch`` more
(``max_queued_requests``); beyond that Ray's ``BackPressureError`` is octo's 503 with ``Retry-After``. A replica that
dies ends its in-flight requests with a 503 ``replica_lost``; Ray Serve restarts it and the others go on. Requests of
one conversation prefer one replica (``octo.cluster.replica.AffinityRouter``), so its prefix cache keeps working.

This module imports ray only inside functions: ``octo serve`` without ``--cluster`` never imports it.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import itertools
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import orjson

from octo.config import ServerConfig
from octo.errors import ConfigError, ModelFailed, OctoError, Overloaded, QueueTimeout
from octo.logsafe import quoted
from octo.runtime.handle import Forwarder, WireTicket
from octo.runtime.specs import parse_cluster
from octo.serving import openai as serving

log = logging.getLogger("octo.cluster.deploy")
ANSWERED_BY: contextvars.ContextVar[str | None] = contextvars.ContextVar("octo_replica", default=None)
REPLICA_HEADER = "X-Octo-Replica"
LOAD_TIMEOUT = 900.0
LOCAL_HEAD_CPUS = 8  # logical CPUs of a local head: replicas ask for 1 each by default (placement, not cores)
LOCAL_OBJECT_STORE = 128 * 2**20
_ids = itertools.count(1)


class ReplicaLost(OctoError):
    """The replica serving a request died (killed, crashed, its node lost); Ray Serve restarts it."""

    status = 503
    type = "server_error"
    code = "replica_lost"










def affinity_key(kind: str, req: Any) -> str | None:
    """What keeps one conversation on one replica: the client's ``prompt_cache_key``/``user`` when it sends one,
    else a hash of the conversation's start (system prompt and first user turn; a prompt's first 512 characters),
    which every later turn of it shares."""
    for attr in ("prompt_cache_key", "user"):
        v = getattr(req, attr, None)
        if isinstance(v, str) and v:
            return f"{attr}:{v}"
    head: Any = None
    messages = getattr(req, "messages", None)
    if isinstance(messages, list) and messages:
        head = []
        for m in messages:
            head.append(m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m)
            if (getattr(m, "role", None) or (m.get("role") if isinstance(m, dict) else None)) == "user":
                break
        system = getattr(req, "system", None)
        if system is not None:
            head.insert(0, system if isinstance(system, str) else [getattr(s, "text", str(s)) for s in system])
    elif isinstance(getattr(req, "prompt", None), str):
        head = req.prompt[:512]
    elif isinstance(getattr(req, "prompt", None), list) and req.prompt:
        head = req.prompt[0][:512] if isinstance(req.prompt[0], (str, list)) else req.prompt[:128]
    if head is None:
        return None
    data = orjson.dumps(head, default=str)
    return "prefix:" + hashlib.blake2b(data, digest_size=12).hexdigest()


def app_name(model: str) -> str:
    return "octo-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", model)[:80]


def _error(exc: BaseException, name: str) -> OctoError:
    """A Ray failure as octo's error (the OpenAI shape, the right status)."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), OctoError):
        return exc.cause
    if isinstance(exc, OctoError):
        return exc
    if isinstance(exc, BackPressureError):
        return Overloaded(f"Every replica of '{name}' is busy and the cluster's queue for it is full; retry later.",
                          headers={"Retry-After": "1"})
    if isinstance(exc, TimeoutError):
        return QueueTimeout(f"No replica of '{name}' took the request in time; retry later.",
                            headers={"Retry-After": "1"})
    if isinstance(exc, RayActorError):
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return ReplicaLost(f"The replica of '{name}' serving this request was lost ({type(exc).__name__}: {why}); "
                           "the other replicas go on and Ray Serve restarts it. Retry the request.", param="model",
                           headers={"Retry-After": "1"})
    if isinstance(exc, DeploymentUnavailableError):
        return ModelFailed(f"Model '{name}' has no running replica: {exc}", param="model",
                           headers={"Retry-After": "5"})
    return ReplicaLost(f"The cluster could not serve '{name}': {type(exc).__name__}: {str(exc)[:300]}",
                       param="model", headers={"Retry-After": "1"})


# -- the cluster ---------------------------------------------------------------------------------------------
class Cluster:
    """The Ray connection of one gateway and the deployments it made."""

    def __init__(self, config: ServerConfig, say: Callable[[str], None] = log.info) -> None:
        self.config = config
        self.address = parse_cluster(config.cluster)
        self.say = say
        self.started_head = False
        self.connected = False
        self.apps: set[str] = set()
        # Ray Serve's own low-latency mode (the router on the caller's loop, replica code on the replica's loop,
        # gRPC between them): read when ray.serve is first imported, so set before that
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")

    async def start(self) -> None:
        await asyncio.to_thread(self._connect)

    def _connect(self) -> None:
        import ray
        from ray import serve

        if self.address:
            ray.init(address=self.address, namespace="octo", log_to_driver=True)
            where = self.address
        else:
            cpus = int(os.environ.get("OCTO_RAY_CPUS") or max(LOCAL_HEAD_CPUS, os.cpu_count() or 1))
            ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE,
                     namespace="octo", log_to_driver=True)
            self.started_head = True
            where = f"a local Ray head ({cpus} logical CPUs)"
        serve.start(http_options={"location": "NoServer"})  # octo's aiohttp app is the HTTP front door
        self.connected = True
        self.say(f"octo: cluster: connected to {where}; each model is a Ray Serve deployment")

    def settings(self, spec: Any, config: ServerConfig) -> dict[str, Any]:
        """Replicas or autoscaling and per-replica resources of one model (its models-file keys, else the flags)."""
        autoscaling = getattr(spec, "autoscaling", None)
        replicas = getattr(spec, "replicas", None)
        if autoscaling is None and replicas is None:
            autoscaling = self.config.autoscaling
            replicas = None if autoscaling else self.config.replicas
        resources = {**self.config.replica_resources, **(getattr(spec, "resources", None) or {})}
        return {"replicas": replicas, "autoscaling": autoscaling, "resources": resources}

    def deployment_options(self, settings: dict[str, Any], config: ServerConfig, app: str) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        res = settings["resources"]
        actor: dict[str, Any] = {"num_cpus": res.get("num_cpus", 1.0), "runtime_env": {"env_vars": {
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")}}}
        if res.get("num_gpus"):
            actor["num_gpus"] = res["num_gpus"]
        if res.get("memory_gb"):
            actor["memory"] = int(res["memory_gb"] * 2**30)
        opts: dict[str, Any] = {
            "name": "model", "ray_actor_options": actor,
            "max_ongoing_requests": config.max_batch + config.max_queue,
            "max_queued_requests": max(1, config.max_batch),
            "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
            "health_check_period_s": 2.0, "health_check_timeout_s": 30.0, "graceful_shutdown_timeout_s": 5.0,
            "request_router_config": RequestRouterConfig(request_router_class="octo.cluster.replica.AffinityRouter",
                                                         request_router_kwargs={"app": app},
                                                         request_routing_stats_period_s=1.0,
                                                         request_routing_stats_timeout_s=5.0)}
        if settings["autoscaling"]:
            opts["autoscaling_config"] = dict(settings["autoscaling"])
        else:
            opts["num_replicas"] = settings["replicas"] or 1
        return opts

    async def open_model(self, spec: Any, config: ServerConfig, engines: dict[str, Any],
                         say: Callable[[str], None] = log.info, download: bool = True) -> tuple[Any, list]:
        """Deploy ``spec``'s model (its replicas load it on their nodes) and return its handle and engine rows."""
        from ray import serve

        from octo.cluster.replica import OctoReplica

        app = app_name(config.model)
        settings = self.settings(spec, config)
        opts = self.deployment_options(settings, config, app)
        how = (f"autoscaling {settings['autoscaling']['min_replicas']}-{settings['autoscaling']['max_replicas']}"
               if settings["autoscaling"] else f"{opts['num_replicas']} replica(s)")
        say(f"octo: cluster: deploying '{quoted(config.model, bare=True)}' as Ray Serve app '{app}' ({how})")
        bound = serve.deployment(OctoReplica).options(**opts).bind(config, config.plugins_dir, download)
        self.apps.add(app)
        try:
            dh = await asyncio.wait_for(asyncio.to_thread(serve.run, bound, name=app, route_prefix=None),
                                        LOAD_TIMEOUT)
            who, ok, meta = await dh.op.remote("info")
        except TimeoutError:
            await self.delete(app)
            raise ModelFailed(f"Model '{config.model}': its replicas did not start within {LOAD_TIMEOUT:g} s.",
                              param="model") from None
        except OctoError:
            await self.delete(app)
            raise
        except Exception as exc:  # noqa: BLE001 - a replica that cannot load: the reason, not a traceback
            await self.delete(app)
            why = str(exc).strip().splitlines()
            raise ConfigError(f"Model '{config.model}' could not be deployed on the cluster: "
                              f"{why[-1] if why else type(exc).__name__}") from None
        if not ok:
            await self.delete(app)
            raise meta
        handle = ClusterHandle(self, app, dh, meta, config, engines, settings)
        return handle, meta["rows"]

    async def delete(self, app: str) -> None:
        from ray import serve

        self.apps.discard(app)
        try:
            await asyncio.to_thread(serve.delete, app)
        except Exception:  # noqa: BLE001
            log.exception("deleting the Ray Serve app %s failed", app)

    async def close(self) -> None:
        if not self.connected:
            return
        self.connected = False
        await asyncio.gather(*(self.delete(a) for a in list(self.apps)), return_exceptions=True)
        await asyncio.to_thread(self._disconnect)

    def _disconnect(self) -> None:
        import ray
        from ray import serve

        try:
            if self.started_head:
                serve.shutdown()
        finally:
            ray.shutdown()


class _EngineStub:
    """What the gateway knows of an engine that is installed only on the cluster's nodes."""

    tasks: frozenset = frozenset()

    def __init__(self, name: str, version: str) -> None:
        self.name, self._version = name, version

    def version(self) -> str:
        return self._version


# -- a model served by a deployment ----------------------------------------------------------------------
class ClusterHandle(Forwarder):
    """A model whose replicas run on the cluster; the registry and route handlers use it as a worker's handle."""

    isolation = "cluster"

    def __init__(self, cluster: Cluster, app: str, dh: Any, meta: dict[str, Any], config: ServerConfig,
                 engines: dict[str, Any], settings: dict[str, Any]) -> None:
        self.cluster, self.app, self._dh, self.config, self.settings = cluster, app, dh, config, settings
        self._stream_dh = dh.options(stream=True)
        self.name, self.aliases, self.engine_name = meta["name"], tuple(meta["aliases"]), meta["engine"]
        self.engine_cls = engines.get(self.engine_name) or _EngineStub(self.engine_name, meta["version"])
        self.info, self.batching = meta["info"], meta["batching"]
        self.selection, self.benchmarks = meta["selection"], meta["benchmarks"]
        self.fingerprint = f"octo-{self.engine_name}-{meta['version']}"
        self.first_replica = meta
        self.state, self.reason = "ready", None
        self.answered: dict[str, int] = {}
        self.lost = 0
        self._requests = {}
        self._streams: dict[int, tuple[Any, asyncio.Task]] = {}

    # -- life cycle --------------------------------------------------------------------------------------
    async def activate(self, config: ServerConfig) -> None:
        return None  # each replica started serving when it loaded

    async def ensure_ready(self) -> None:
        if self.state != "ready":
            raise ModelFailed(f"Model '{self.name}' is not available ({self.state}).", headers={"Retry-After": "5"})

    async def close(self) -> None:
        self.state = "stopped"
        self.fail_all(ModelFailed(f"Model '{self.name}' was unloaded.", headers={"Retry-After": "5"}))
        for gen, task in list(self._streams.values()):
            _cancel(gen)
            task.cancel()
        await self.cluster.delete(self.app)

    # -- requests ----------------------------------------------------------------------------------------
    async def submit(self, kind: str, req: Any, size: int = 0) -> tuple[list[WireTicket], asyncio.Queue | None]:
        """Route the request to a replica (session affinity) and read its events; refused at once (503) when every
        replica and the queue in front of them are full."""
        loop = asyncio.get_running_loop()
        rid = next(_ids)
        tickets = [WireTicket(loop, rid, i) for i in range(serving.sequence_count(kind, req))]
        if not req.stream:
            return await self._run(rid, tickets, kind, req), None
        gen = self._stream_dh.generate.remote(kind, req, affinity=affinity_key(kind, req))
        try:
            first = await asyncio.wait_for(gen.__anext__(), self.config.queue_timeout)
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        except BaseException as exc:  # noqa: BLE001
            _cancel(gen)
            raise self._lost(exc) from None
        replica = first[1]
        ANSWERED_BY.set(replica)
        self.answered[replica] = self.answered.get(replica, 0) + 1
        events = self.open_request(rid, tickets, True)
        self._streams[rid] = (gen, loop.create_task(self._pump(rid, gen)))
        return tickets, events

    async def _run(self, rid: int, tickets: list[WireTicket], kind: str, req: Any) -> list[WireTicket]:
        """A request that is not streamed: one call whose answer holds every event (the tickets are done when it
        returns); a client that goes away cancels it on the replica."""
        resp = self._dh.run.remote(kind, req, affinity=affinity_key(kind, req))
        try:
            replica, batch = await asyncio.wait_for(resp, self.config.queue_timeout + 3600)
        except asyncio.CancelledError:
            _cancel(resp)
            raise
        except BaseException as exc:  # noqa: BLE001
            raise self._lost(exc) from None
        ANSWERED_BY.set(replica)
        self.answered[replica] = self.answered.get(replica, 0) + 1
        self.open_request(rid, tickets, False)
        self.on_wire([(rid, code, index, value) for _, code, index, value in batch])
        if rid in self._requests:
            self.fail_request(rid, ReplicaLost(f"The replica serving '{self.name}' ended the request without "
                                                "its result.", headers={"Retry-After": "1"}))
        return tickets

    async def _pump(self, rid: int, gen: Any) -> None:
        try:
            async for batch in gen:  # the replica numbers its requests itself: these events are ``rid``'s
                self.on_wire([(rid, code, index, value) for _, code, index, value in batch])
                if rid not in self._requests:
                    return
            if rid in self._requests:
                self.fail_request(rid, ReplicaLost(f"The replica serving '{self.name}' ended the request without "
                                                    "its result.", headers={"Retry-After": "1"}))
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        except BaseException as exc:  # noqa: BLE001 - the replica died: its requests end now, never hang
            self.fail_request(rid, self._lost(exc))
        finally:
            self._streams.pop(rid, None)

    def _lost(self, exc: BaseException) -> OctoError:
        err = _error(exc, self.name)
        if isinstance(err, ReplicaLost):
            self.lost += 1
            log.warning("%s: %s", quoted(self.name, bare=True), err.message)
        return err

    def _cancel(self, rid: int, tracked: bool) -> None:
        entry = self._streams.pop(rid, None)
        if entry is not None:
            _cancel(entry[0])  # the replica's generator ends: its sequences leave the batch
            entry[1].cancel()

    async def _op(self, name: str, *args: Any) -> Any:
        try:
            who, ok, value = await asyncio.wait_for(self._dh.op.remote(name, *args), self.config.queue_timeout)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            raise self._lost(exc) from None
        ANSWERED_BY.set(who)
        self.answered[who] = self.answered.get(who, 0) + 1
        if not ok:
            raise value
        return value

    # -- where it runs -----------------------------------------------------------------------------------
    def replica_rows(self) -> list[dict[str, Any]]:
        """Each running replica: its id, node, pid and latest queue/cache numbers (reported every second)."""
        from octo.cluster.replica import ROUTERS

        router = ROUTERS.get(self.app)
        rows = []
        for r in (router.replicas() if router is not None else []):
            rid = r.replica_id.unique_id
            st = dict(r.routing_stats or {})
            rows.append({"replica": rid, "node_id": r.node_id, "node_ip": st.get("node_ip"), "pid": st.get("pid"),
                         "answered": self.answered.get(rid, 0), "queue": st.get("queue"), "cache": st.get("cache")})
        return sorted(rows, key=lambda row: row["replica"])

    def cluster_info(self) -> dict[str, Any]:
        """For /v1/models: replicas (how many, how they scale, what each asks for) and where each runs."""
        rows = self.replica_rows()
        return {"app": self.app, "replicas": len(rows), "autoscaling": self.settings["autoscaling"],
                "target_replicas": self.settings["replicas"], "resources": self.settings["resources"],
                "requests_lost": self.lost,
                "placement": [{k: row[k] for k in ("replica", "node_id", "node_ip", "pid", "answered")}
                              for row in rows]}

    async def stats(self) -> dict[str, Any]:
        """Queue and prefix-cache numbers summed over the replicas (each as its last report), with the replicas."""
        rows = self.replica_rows()
        if not any(r["queue"] for r in rows):  # no report yet: ask one replica now
            fresh = await self._op("stats")
            rows = [{"replica": fresh["replica"], "node_id": fresh["node_id"], "node_ip": fresh["node_ip"],
                     "pid": fresh["pid"], "answered": self.answered.get(fresh["replica"], 0),
                     "queue": fresh["queue"], "cache": fresh["cache"]}]
        queue = _sum([r["queue"] for r in rows if r["queue"]])
        queue["replicas"] = [{k: r[k] for k in ("replica", "node_id", "node_ip", "pid", "answered")}
                             | {k: (r["queue"] or {}).get(k) for k in ("pending", "active", "total_processed")}
                             for r in rows]
        caches = [r["cache"] for r in rows if r["cache"]]
        cache = _sum(caches) if caches else None
        if cache is not None:
            lookups = cache.get("hits", 0) + cache.get("misses", 0)
            cache["hit_rate"] = round(cache.get("hits", 0) / lookups, 4) if lookups else 0.0
        return {"queue": queue, "cache": cache}


def _cancel(gen: Any) -> None:
    """Cancel a Ray response (its replica's generator ends); one that already failed re-raises here: ignored."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001
        pass


def _sum(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "hit_rate":
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out
