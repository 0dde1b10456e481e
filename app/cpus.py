"""The cores this process may use: CPU affinity and the cgroup CPU quota (v2 or v1)."""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "usable_cpus"]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (``2.5``), or None without one.

    cgroup v2: ``cpu.max`` (``"<quota> <period>"``, ``"max ..."`` when unlimited); cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under ``cpu`` or ``cpu,cpuacct`` (quota -1
    when unlimited). ``root`` is the cgroup mount as the container sees it.
    """
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max":
            return None
        try:
            return int(quota) / int(period or "100000")
        except (ValueError, ZeroDivisionError):
            return None
    for directory in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota_text = _read(root / directory / "cpu.cfs_quota_us")
        period_text = _read(root / directory / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            continue
        try:
            quota_us, period_us = int(quota_text), int(period_text)
        except ValueError:
            return None
        if quota_us <= 0 or period_us <= 0:
            return None
        return quota_us / period_us
    return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on (its affinity mask), capped by the cgroup quota
    rounded up (a 1.5-core quota allows 2 busy processes' worth of bursts), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # macOS
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)
