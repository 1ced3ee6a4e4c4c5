"""Lesson 01's stopped jobs: who the ranks of a running launch are, and who outlives it.

``scripts/demos/orphans.py`` writes each rank's pid, session and DataLoader workers once its
workers run; these helpers wait for those records while the launch runs, then watch the
job's processes after the launcher was stopped.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import psutil

from ddp_tutorial.harness.launch import Launch
from ddp_tutorial.harness.processes import alive, run_command
from ddp_tutorial.records import read_rank_records


def wait_for_ranks(launch: Launch, nproc: int, timeout_s: float = 90.0) -> list[dict[str, Any]]:
    """The ``nproc`` ranks' records, once every rank wrote its own (its workers started).

    Raises ``RuntimeError`` with the launch's output if it ends, or ``timeout_s`` passes,
    before that: a job that never started cannot show what a stop leaves behind."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not launch.done:
        records = read_rank_records(launch.run_dir)
        if len(records) == nproc:
            return records
        launch.poll(block_s=0.2)
    raise RuntimeError(
        f"{launch.spec.name}: {nproc} ranks did not report within {timeout_s:.0f} s:\n"
        + "".join(launch.lines[-20:])
    )


def job_pids(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The ranks' pids and their DataLoader workers' pids."""
    return {
        "ranks": [r["pid"] for r in records],
        "workers": [w for r in records for w in r["workers"]],
    }


def survivors(jobs: dict[str, Iterable[int]], settle_s: float) -> dict[str, list[int]]:
    """For each job, the pids still running after up to ``settle_s`` seconds: a job whose
    processes all end earlier stops the wait for itself; the others wait it out."""
    left = {name: list(pids) for name, pids in jobs.items()}
    deadline = time.monotonic() + settle_s
    while True:
        left = {name: [p for p in pids if alive(p)] for name, pids in left.items()}
        if time.monotonic() >= deadline or not any(left.values()):
            return left
        time.sleep(0.1)


def parent_of(pid: int) -> int | None:
    """``pid``'s parent now (None once it is gone): an orphan's is no longer torchrun."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


# torchrun's LaunchConfig, built as torchrun builds it from flags left at their defaults
_LAUNCH_CONFIG = (
    "from torch.distributed.launcher.api import LaunchConfig as C; "
    "print(C(min_nodes=1, max_nodes=1, nproc_per_node=2).shutdown_timeout)"
)


def launcher_shutdown_timeout(timeout_s: float = 60.0) -> int:
    """torchrun's grace period (``--shutdown-timeout`` unset), read in a process of its own:
    building a ``LaunchConfig`` asks ``torch.accelerator.is_available()`` (for NUMA binding),
    the CUDA runtime on a CUDA build, and a lesson's kernel stays free of CUDA (lesson 01)."""
    done = run_command([sys.executable, "-c", _LAUNCH_CONFIG], timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun's LaunchConfig could not be built:\n{done.output[-2000:]}")
    return int(done.output.strip().splitlines()[-1])
