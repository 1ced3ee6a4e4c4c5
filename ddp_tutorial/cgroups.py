"""What this process's cgroup allows: the CPUs of its quota and the memory left under its limit.

A container (a Kubernetes pod's ``resources.limits``) or a SLURM job (``--mem``, with
ConstrainRAMSpace) is limited by its cgroup, not by the machine: ``os.sched_getaffinity``
still lists every core of the node under a CPU quota, and ``psutil.virtual_memory`` the
node's memory under a memory limit. The doctor reads both here, so that it advises threads
for the cores the quota gives and projects memory against what the OOM killer enforces.
cgroup v2 (one tree; the group from ``/proc/self/cgroup``'s ``0::`` line, whose parents may
limit it too) and v1 (a tree per controller). Standard library only: ranks import it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc/self/cgroup")
UNLIMITED_V1 = 2**60  # v1 writes "no limit" as a page-rounded 2**63 - 1
MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes"),
)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _groups(proc: Path) -> dict[str, str]:
    """Controllers as the line names them (``"cpu,cpuacct"``; ``""`` for v2) -> this
    process's group path, from /proc/self/cgroup."""
    found: dict[str, str] = {}
    for line in (_read(proc) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:  # "id:controllers:path"; anything else is not a group line
            found[parts[1]] = parts[2].lstrip("/")
    return found


def _up(here: Path, root: Path) -> list[Path]:
    """A group and its parents up to the root: a limit set on any of them holds."""
    return [here, *(p for p in here.parents if p.is_relative_to(root))]


def _dirs(root: Path, proc: Path, controller: str) -> list[Path]:
    """The v2 group (and parents), or the v1 ``controller``'s (its mount may be a comounted
    "cpu,cpuacct"; inside a container the host's path is absent: the mount's root)."""
    groups = _groups(proc)
    if "" in groups:
        return _up(root / groups[""], root)
    for key, rel in groups.items():
        if controller in key.split(","):
            mount = next((root / n for n in (key, controller) if os.path.isdir(root / n)), None)
            if mount is not None:
                return _up(mount / rel if os.path.isdir(mount / rel) else mount, mount)
    return []


def cpu_quota(root: Path = ROOT, proc: Path = PROC) -> float | None:
    """CPUs the quota allows (``cpu.max`` 250000 100000: 2.5), or None without a quota."""
    quotas = []
    for where in _dirs(root, proc, "cpu"):
        quota, _, period = (_read(where / "cpu.max") or "max").partition(" ")  # v2
        if quota != "max" and period:
            quotas.append(int(quota) / int(period))
        quota_us, period_us = _read(where / "cpu.cfs_quota_us"), _read(where / "cpu.cfs_period_us")
        if quota_us and period_us and int(quota_us) > 0:  # v1; -1: none
            quotas.append(int(quota_us) / int(period_us))
    return min(quotas) if quotas else None


def _inactive_file(where: Path) -> int:
    """Page cache the kernel reclaims before it kills: not counted against the limit (as
    the kubelet's working set does not)."""
    for line in (_read(where / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file"):  # v2, v1
            return int(value)
    return 0


def memory_left(root: Path = ROOT, proc: Path = PROC) -> int | None:
    """Bytes the group may still take before its OOM killer (limit - usage), or None."""
    left = []
    for where in _dirs(root, proc, "memory"):
        for limit_file, used_file in MEMORY_FILES:
            limit, used = _read(where / limit_file), _read(where / used_file)
            if limit and limit != "max" and int(limit) < UNLIMITED_V1:
                left.append(int(limit) - int(used or 0) + _inactive_file(where))
    return max(0, min(left)) if left else None


def cores_within_quota(affinity: int, root: Path = ROOT, proc: Path = PROC) -> int:
    """The cores a thread count should assume: the affinity, capped by the quota's whole CPUs."""
    quota = cpu_quota(root, proc)
    return affinity if quota is None else max(1, min(affinity, math.floor(quota)))
