"""Lesson 07, a reference answer: an honest DDP step time (see ../07_honest_timing.py)."""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def time_steps(
    step: Callable[[], object], steps: int, warmup: int, synchronize: Callable[[], None]
) -> float:
    """Seconds the slowest rank took for ``steps`` calls of ``step()`` after ``warmup`` more."""
    times: list[float] = []  # the seconds of each timed call, on this rank
    # YOUR CODE: warmup + steps calls of step(); time only the last `steps`, each between two
    # clock readings (time.perf_counter()), with synchronize() before each reading.
    for i in range(warmup + steps):
        synchronize()  # start with nothing queued
        start = time.perf_counter()
        step()
        synchronize()  # the step's work has run, not only been queued
        if i >= warmup:  # the first calls are warm-up: not the speed you keep
            times.append(time.perf_counter() - start)
    # END YOUR CODE
    slowest = torch.tensor([sum(times)], dtype=torch.float64)
    # YOUR CODE: make `slowest` the largest total over the ranks, on every rank (one collective).
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the job moves at its slowest rank's pace
    # END YOUR CODE
    return slowest.item()
