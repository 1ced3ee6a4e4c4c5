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
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc/self/cgroup")
UNLIMITED_V1 = 2**60  # v1 writes "no limit" as a page-rounded 2**63 - 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _groups(proc: Path) -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's group path, from /proc/self/cgroup."""
    found: dict[str, str] = {}
    for line in (_read(proc) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path.lstrip("/")
    return found


def _v2_dirs(root: Path, proc: Path) -> list[Path]:
    """This process's v2 group and its parents up to the root (each may hold a limit)."""
    if (rel := _groups(proc).get("")) is None:
        return []
    here = root / rel
    return [here, *(p for p in here.parents if p.is_relative_to(root))]


def _v1_dir(root: Path, proc: Path, controller: str) -> Path | None:
    groups = _groups(proc)
    for key, rel in groups.items():
        if controller in key.split(","):
            mount = root / key if (root / key).is_dir() else root / controller
            return mount / rel if (mount / rel).is_dir() else mount
    return None


def cpu_quota(root: Path = ROOT, proc: Path = PROC) -> float | None:
    """CPUs the quota allows (``cpu.max`` 250000 100000: 2.5), or None without a quota."""
    quotas = []
    for where in _v2_dirs(root, proc):
        quota, _, period = (_read(where / "cpu.max") or "max").partition(" ")
        if quota != "max" and period:
            quotas.append(int(quota) / int(period))
    v1 = _v1_dir(root, proc, "cpu")
    if v1 is not None:
        quota_us, period_us = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota_us and period_us and int(quota_us) > 0:
            quotas.append(int(quota_us) / int(period_us))
    return min(quotas) if quotas else None


def memory_left(root: Path = ROOT, proc: Path = PROC) -> int | None:
    """Bytes the group may still take before its OOM killer (limit - usage), or None."""
    left = []
    for where in _v2_dirs(root, proc):
        limit, used = _read(where / "memory.max"), _read(where / "memory.current")
        if limit and limit != "max":
            left.append(int(limit) - int(used or 0))
    v1 = _v1_dir(root, proc, "memory")
    if v1 is not None:
        limit, used = _read(v1 / "memory.limit_in_bytes"), _read(v1 / "memory.usage_in_bytes")
        if limit and int(limit) < UNLIMITED_V1:
            left.append(int(limit) - int(used or 0))
    return max(0, min(left)) if left else None


def cores_within_quota(affinity: int, root: Path = ROOT, proc: Path = PROC) -> int:
    """The cores a thread count should assume: the affinity, capped by the quota's whole CPUs."""
    quota = cpu_quota(root, proc)
    return affinity if quota is None else max(1, min(affinity, math.floor(quota)))
