"""One scheduler for every text engine: admission, the step loop, emission, KV pressure, prefix sharing,
the prefix cache and its disk tier, pacing and the engine-thread watchdog."""

from octo.scheduler.admission import Scheduler

__all__ = ["Scheduler"]
