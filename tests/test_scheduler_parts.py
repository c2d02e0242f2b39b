"""The scheduler's structure (docs/scheduler.md, "The scheduler's parts"): parts held as attributes and wired to
each other through their constructors, not mixins; no part reads another object's underscore attributes; no
function over 60 lines; the watchdog typed by its owner protocol, not by the Scheduler."""

import ast
import inspect
from pathlib import Path

from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig
from octo.scheduler import watchdog
from octo.scheduler.admission import Scheduler
from octo.scheduler.disk_cache import DiskTier
from octo.scheduler.emission import Emission
from octo.scheduler.engine_loop import EngineLoop
from octo.scheduler.kv_pressure import KVPressure
from octo.scheduler.pacer import Pacer
from octo.scheduler.prefix_cache import PrefixCache
from octo.scheduler.reuse import PrefixReuse
from octo.scheduler.sharing import PrefixSharing
from octo.scheduler.step_isolation import StepIsolation

SCHEDULER = Path(__file__).resolve().parents[1] / "octo" / "scheduler"


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.name, ast.parse(p.read_text())) for p in sorted(SCHEDULER.glob("*.py"))]


def test_the_loop_holds_its_parts_instead_of_deriving_from_them():
    assert Scheduler.__mro__ == (Scheduler, EngineLoop, object)
    e = EchoEngine(EngineConfig())
    e.load("x", "m")
    s = Scheduler(e, cache=PrefixCache(1 << 20, e.kv_free))
    assert isinstance(s.kv, KVPressure) and isinstance(s.sharing, PrefixSharing)
    assert isinstance(s.emission, Emission) and isinstance(s.isolation, StepIsolation)
    assert isinstance(s.reuse, PrefixReuse) and isinstance(s.pacer, Pacer) and s.disk is None
    # one running list, handed to the parts that read it; KV pressure owns the preempted queue
    assert s.kv.active is s.sharing.active and s.kv.sharing is s.sharing and s.kv.cache is s.cache
    assert s.stats()["preempted"] == len(s.kv.preempted) == 0
    assert Scheduler(e).reuse is None  # no prefix cache: nothing to reuse
    assert DiskTier.__mro__ == (DiskTier, object)


def test_no_part_reads_another_objects_underscore_attributes():
    found = set()
    for name, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.add((name, ast.unparse(node)))
    assert not found, sorted(found)


def test_no_function_of_the_scheduler_is_over_60_lines():
    long = [(name, node.name, node.end_lineno - node.lineno + 1) for name, tree in _modules()
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long


def test_the_watchdog_knows_its_owner_only_by_protocol():
    assert inspect.signature(watchdog.Watchdog).parameters["owner"].annotation in ("WatchdogOwner",
                                                                                   watchdog.WatchdogOwner)
    assert "octo.scheduler.admission" not in Path(watchdog.__file__).read_text()
    members = {"stopping", "on_loop", "fail_everything", "restart_loop"}
    assert members <= set(vars(watchdog.WatchdogOwner)) and all(hasattr(Scheduler, m) for m in members)
