"""Every environment variable the course itself reads, with its default, in one place.

Rank side and host side both read these (a launcher sets them, a rank obeys
them), so the names live here rather than in either: a rank that imports this
module pulls in nothing but the standard library. torchrun's own contract
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, …) is read where it is used, in
:mod:`ddp_tutorial.distributed`; :func:`env_int` reads any of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BACKEND_ENV = "DDP_TUTORIAL_BACKEND"
"""The backend every rank uses: "auto" (nccl when each local rank has a GPU, else gloo),
"gloo" or "nccl"."""
BACKEND_DEFAULT = "auto"

TIMEOUT_ENV = "DDP_TUTORIAL_TIMEOUT"
"""Seconds a collective (and the rendezvous) may wait before the rank fails."""
TIMEOUT_DEFAULT_S = 60.0

INIT_TIMEOUT_ENV = "DDP_TUTORIAL_INIT_TIMEOUT"
"""Seconds every rank may take to join the process group (a slow ``import torch`` is not a bug)."""
INIT_TIMEOUT_DEFAULT_S = 600.0

RUNS_ENV = "DDP_TUTORIAL_RUNS"
"""Where launches write their run directories. Unset: ``runs/`` under the current directory
(``notebooks/runs/`` in Jupyter, git-ignored, pruned to the newest runs of each script).
``make run`` and the notebook tests point it into ``build/`` or a temporary folder."""

CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
"""cuBLAS's workspace layout; ``:4096:8`` makes its results deterministic (``numerics``)."""

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
"""Which GPUs a process may see, read by the CUDA driver once, when CUDA initialises."""
DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"
"""How CUDA numbers GPUs: "FASTEST_FIRST" (its default) or "PCI_BUS_ID" (nvidia-smi's order)."""


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def backend(env: Mapping[str, str] | None = None) -> str:
    """The requested backend (``$DDP_TUTORIAL_BACKEND``, default "auto")."""
    return _env(env).get(BACKEND_ENV) or BACKEND_DEFAULT


def runs_root(env: Mapping[str, str] | None = None) -> str:
    """The folder run directories go under (``$DDP_TUTORIAL_RUNS``, default ``runs``)."""
    return _env(env).get(RUNS_ENV) or "runs"


def timeout_s(env: Mapping[str, str] | None = None, default: float = TIMEOUT_DEFAULT_S) -> float:
    """The collective timeout in seconds (``$DDP_TUTORIAL_TIMEOUT``, else ``default``: 60)."""
    return _seconds(_env(env), TIMEOUT_ENV, default)


def init_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long joining the group may take (``$DDP_TUTORIAL_INIT_TIMEOUT``, default 600)."""
    return _seconds(_env(env), INIT_TIMEOUT_ENV, INIT_TIMEOUT_DEFAULT_S)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """An integer from the environment, with a clear error when it is not one."""
    raw = _env(env).get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def affinity_cores() -> int:
    """Cores this process may be scheduled on (affinity-aware, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def usable_cores() -> int:
    """The cores to plan threads for: the affinity's, capped by a container's or job's CPU
    quota (ddp_tutorial.cgroups)."""
    from ddp_tutorial import cgroups

    return cgroups.cores_within_quota(affinity_cores())


def machine_load() -> tuple[float, int]:
    """The 1-minute load average and the cores this process may use: how crowded the host is.

    Lesson 06's busy floor and exercise 12's timing verdict read it. Where the system keeps
    no load average (Windows), the load is 0, as on a quiet machine.
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return load, affinity_cores()  # the load average counts the whole host, not a quota
