"""The --cluster settings of a model (replicas, autoscaling, resources), parsed without importing Ray."""

from __future__ import annotations

from typing import Any

from octo.errors import ConfigError

_AUTOSCALING_KEYS = {"min", "max", "target", "min_replicas", "max_replicas", "target_ongoing_requests",
                     "upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"}


_RESOURCE_KEYS = {"num_cpus", "num_gpus", "memory", "memory_gb"}


# -- configuration ------------------------------------------------------------------------------------------
def parse_cluster(value: str | None) -> str | None:
    """``ray`` (start a local head) -> "", ``ray://HOST:PORT`` or ``ray:auto`` -> the address for ``ray.init``."""
    if value is None or value == "":
        return None
    v = value.strip()
    if v == "ray":
        return ""
    if v.startswith("ray://"):
        return v
    if v.startswith("ray:") and len(v) > 4:  # ray:auto, ray:HOST:6379 (a cluster this machine is a node of)
        return v[4:]
    raise ConfigError(f"--cluster {value!r}: expected 'ray' (a local Ray head) or 'ray://HOST:10001'.",
                      param="cluster")


def parse_autoscaling(value: Any, where: str = "--autoscaling") -> dict[str, Any] | None:
    """``MIN:MAX[:TARGET]`` or a mapping (min, max, target, upscale_delay_s, downscale_delay_s, ...) -> Ray Serve's
    ``autoscaling_config``."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        parts = value.split(":")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3):
            raise ConfigError(f"{where}: expected MIN:MAX[:TARGET_ONGOING_REQUESTS], got {value!r}.")
        value = {"min": nums[0], "max": nums[1], **({"target": nums[2]} if len(nums) == 3 else {})}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: autoscaling must be a mapping (min, max, target) or MIN:MAX[:TARGET].")
    unknown = set(value) - _AUTOSCALING_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown autoscaling key(s) {', '.join(sorted(unknown))}; known: min, max, "
                          "target, upscale_delay_s, downscale_delay_s, metrics_interval_s, look_back_period_s.")
    out: dict[str, Any] = {}
    try:
        lo = int(value.get("min", value.get("min_replicas", 1)))
        hi = int(value.get("max", value.get("max_replicas", max(lo, 1))))
        target = float(value.get("target", value.get("target_ongoing_requests", 2)))
        for k in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"):
            if k in value:
                out[k] = float(value[k])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: autoscaling values must be numbers.") from None
    if lo < 0 or hi < 1 or hi < lo or target <= 0:
        raise ConfigError(f"{where}: autoscaling needs 0 <= min <= max, max >= 1 and target > 0.")
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target, **out}


def parse_resources(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - _RESOURCE_KEYS:
        raise ConfigError(f"{where}: resources must be a mapping of num_cpus, num_gpus, memory_gb.")
    try:
        out = {k: float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: resources must be numbers.") from None
    if any(v < 0 for v in out.values()):
        raise ConfigError(f"{where}: resources must not be negative.")
    if "memory" in out:
        out["memory_gb"] = out.pop("memory")
    return out


def cluster_keys(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The cluster keys of one models-file entry: ``replicas``, ``autoscaling``, ``resources``."""
    replicas = item.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
        raise ConfigError(f"{where}: replicas must be a positive integer.")
    autoscaling = parse_autoscaling(item.get("autoscaling"), where)
    if replicas is not None and autoscaling is not None:
        raise ConfigError(f"{where}: give replicas or autoscaling, not both.")
    return {"replicas": replicas, "autoscaling": autoscaling,
            "resources": parse_resources(item.get("resources"), where)}
