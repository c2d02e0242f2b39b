"""Conditions of a start-up benchmark measurement: did other processes compete for the cores meanwhile? And the
host facts that engines' measurements are keyed and bounded by (``cpu_flags``, ``available_memory``).

``LoadMonitor`` samples, around a measurement, the CPUs' busy and steal time (/proc/stat, only the CPUs this
process may run on), this process's own CPU time and its threads' run-queue wait (/proc/self/task/*/schedstat:
time runnable but not running). ``octo.runtime.benchmark`` repeats a disturbed measurement once when the host calms
down within ``wait_quiet``'s second; ``octo.runtime.selection`` caches one that stayed disturbed as provisional.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

DISTURBED_WAIT = 0.10
DISTURBED_FOREIGN = 0.10
DISTURBED_STEAL = 0.10
FALLBACK_FOREIGN = 0.25
QUIET_FOREIGN = 0.15  # a repeat waits (up to the budget, 1-3 s) for others to use less than this share


def _cpu_seconds(cpus: set[int]) -> tuple[float, float] | None:
    """(busy, steal) seconds so far of the CPUs in ``cpus``, from /proc/stat (None where there is none)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = steal = 0
    for line in lines:
        f = line.split()
        if len(f) > 8 and f[0].startswith("cpu") and f[0][3:].isdigit() and int(f[0][3:]) in cpus:
            v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            busy += v[0] + v[1] + v[2] + v[5] + v[6]
            steal += v[7]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return busy / hz, steal / hz


def _run_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (per-thread schedstat)."""
    total, seen = 0, False
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


class LoadMonitor:
    """What competed with a measurement, between ``start()`` and ``stop()``.

    - ``foreign_load``: the share of the cores this process may run on that other processes used (the CPUs'
      busy time from /proc/stat, less this process's own CPU time);
    - ``run_wait``: how long this process's threads were runnable but waiting for a CPU, per second of
      measurement (from each thread's /proc/self/task/TID/schedstat): the direct cost of that competition;
    - ``steal``: the share of those cores the hypervisor gave to other machines.

    ``disturbed``: ``steal >= 0.10``, or ``run_wait >= 0.10`` while ``foreign_load >= 0.10`` (our threads waited
    for cores that others were using; waiting caused by our own threads alone does not count). Without
    schedstat, ``foreign_load >= 0.25``.
    """

    def __init__(self) -> None:
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))

    def _sample(self) -> tuple[float, tuple[float, float] | None, float, float | None]:
        return time.perf_counter(), _cpu_seconds(self.cpus), time.process_time(), _run_wait()

    def start(self) -> LoadMonitor:
        self.first = self._sample()
        return self

    def disturbed_so_far(self) -> bool:
        """Whether the measurement is disturbed so far (``stop()``'s verdict now; the monitor goes on)."""
        return bool(self.stop()["disturbed"])

    def stop(self) -> dict[str, Any]:
        (t0, cpu0, own0, wait0), (t1, cpu1, own1, wait1) = self.first, self._sample()
        wall, n = max(t1 - t0, 1e-6), max(1, len(self.cpus))
        if cpu0 is None or cpu1 is None:
            return {"foreign_load": None, "run_wait": None, "steal": None, "disturbed": False}
        foreign = max(0.0, (cpu1[0] - cpu0[0]) - (own1 - own0)) / (wall * n)
        steal = max(0.0, cpu1[1] - cpu0[1]) / (wall * n)
        run_wait = None if wait0 is None or wait1 is None else max(0.0, wait1 - wait0) / wall
        if run_wait is None:
            disturbed = foreign >= FALLBACK_FOREIGN or steal >= DISTURBED_STEAL
        else:
            disturbed = steal >= DISTURBED_STEAL or (run_wait >= DISTURBED_WAIT and foreign >= DISTURBED_FOREIGN)
        return {"foreign_load": round(foreign, 3), "run_wait": None if run_wait is None else round(run_wait, 3),
                "steal": round(steal, 3), "disturbed": disturbed}


def quiet_now(window: float = 0.2) -> bool:
    """Whether other processes left the cores mostly idle over the next ``window`` seconds (True where /proc/stat
    cannot tell)."""
    mon = LoadMonitor().start()
    time.sleep(window)
    cond = mon.stop()
    return cond["foreign_load"] is None or (cond["foreign_load"] < QUIET_FOREIGN and cond["steal"] < DISTURBED_STEAL)


def wait_quiet(limit: float, window: float = 0.2) -> bool:
    """Wait (at most ``limit`` seconds) until other processes leave the cores mostly idle; True when they did."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        if quiet_now(window):
            return True
    return False


def loadavg_1min() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's ``flags``, or ``Features`` on ARM): what a cached measurement of this
    host is keyed by; the processor's name where there is no /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (/proc/meminfo's ``MemAvailable``); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
