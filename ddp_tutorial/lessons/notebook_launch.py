"""Lesson 01, "From inside a notebook": starting ranks from a Jupyter kernel.

A notebook user who wants N ranks without leaving the notebook reaches for one
of three things: ``torch.multiprocessing.spawn`` (fresh interpreters that must
*import* the function they run), a fork-based launcher such as Accelerate's
``notebook_launcher`` or Lightning's ``ddp_notebook`` strategy (copies of the
kernel: nothing imported, nothing pickled), or a ``torchrun`` subprocess (what
this course does). The lesson defines :func:`all_reduce_worker` in a cell as a
learner would, and runs the *same* function from here, an importable module,
to show which start works with which.

Rank side: spawned children import this module, so it imports only torch,
the standard library and rank-side modules of the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_tutorial.records import write_rank_record


def all_reduce_worker(index: int, world_size: int, port: int, out: str) -> None:
    """One rank: join a gloo group at 127.0.0.1:port, all_reduce ``index + 1``, record the sum."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=index,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        value = torch.tensor([float(index + 1)])
        dist.all_reduce(value)
        # "ipykernel" loaded although this function never imports it: a copy of the kernel
        record = {"sum": value.item(), "parent": os.getppid(), "kernel": "ipykernel" in sys.modules}
        write_rank_record(out, record, rank=index)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def stderr_to(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Send file descriptor 2 (this process's and its children's stderr) to ``path``.

    A child started by ``mp.spawn`` writes the traceback of an error it hits
    *before* running your function (unpickling it) to its own stderr, never to
    the parent: in a notebook that is the kernel's terminal, not the cell. The
    children inherit descriptor 2 from this process when they start, so while
    this block runs their stderr lands in ``path``; afterwards descriptor 2 is
    what it was, and the kernel's own output goes where it went before.
    """
    path = Path(path)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("w") as file:
            os.dup2(file.fileno(), 2)
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


CUDA_CASES = (
    ("nothing", False),
    ("device_count", False),
    ("is_available", False),
    ("is_available", True),
    ("memory_allocated", False),
    ("mem_get_info", False),
    ("tensor", False),
    ("adam_step", False),  # what calls is_available() for you, on the CPU too
    ("pin_memory", False),
    ("data_parallel", False),
)
FOR_YOU = ("adam_step", "pin_memory", "data_parallel")  # ask the CUDA runtime as is_available()
"""``(--touch, --nvml-check)`` of each parent ``scripts/demos/fork_after_cuda.py`` stands in for."""


def fork_after_cuda(
    gpus: int,
    timeout: float,
    demos: str = "../scripts/demos",
    cases: tuple[tuple[str, bool], ...] = CUDA_CASES,
) -> list[dict[str, Any]]:
    """Run ``fork_after_cuda.py`` once per case (:data:`CUDA_CASES`); its JSON report for each.

    Each case needs a fresh parent: a process that initialised CUDA cannot
    fork CUDA workers any more, and a notebook kernel that did would need a
    restart. So every case is a subprocess standing in for the kernel, and
    the kernel itself never touches CUDA. Side by side, except where the GPUs
    take one process at a time (EXCLUSIVE_PROCESS: one case after another).
    ``timeout`` bounds all the cases together, so that a notebook cell's own
    timeout can be set above it: side by side each case gets all of it, one
    after another each gets its share.
    Host side: the harness is imported here, never at module level.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ddp_tutorial.harness.launch import exclusive_gpus
    from ddp_tutorial.harness.processes import run_command

    nprocs = min(2, gpus)
    one_at_a_time = exclusive_gpus()
    each = timeout / len(cases) if one_at_a_time else timeout

    def one(case: tuple[str, bool]) -> dict[str, Any]:
        touch, nvml_check = case
        command = [sys.executable, f"{demos}/fork_after_cuda.py", "--touch", touch,
                   "--nprocs", str(nprocs), *(["--nvml-check"] if nvml_check else [])]  # fmt: skip
        result = run_command(command, timeout=each)
        reports = [ln for ln in result.output.splitlines() if ln.startswith('{"touch"')]
        if result.returncode != 0 or not reports:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.output[-3000:]}")
        return json.loads(reports[-1])

    with ThreadPoolExecutor(max_workers=1 if one_at_a_time else len(cases)) as pool:
        return list(pool.map(one, cases))
