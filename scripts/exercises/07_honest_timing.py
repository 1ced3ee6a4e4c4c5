"""Lesson 07, your turn: time a DDP step honestly.

Three habits decide whether a step time means anything: the first steps (allocation, kernel
choice, DDP's bucket building, compilation) are not timed; on a GPU, a call returns once its
work is *queued*, so synchronise before each clock reading; and a DDP job moves at its slowest
rank's pace, so report the slowest rank's time, the same number on every rank. Write
``time_steps``: ``warmup`` untimed calls of ``step()``, then ``steps`` timed ones, and the
slowest rank's total seconds (each rank adds up its own timed steps; the largest of those
totals, not the longest single step). ``synchronize()`` waits until the device has run everything
queued (on a GPU you would pass ``lambda: torch.cuda.synchronize(device)``).

Check it (2 gloo ranks; each gets a device whose step only queues work, rank 1's is slower
than rank 0's, and one timed step stalls, as a data loader can):

    ddp-tutorial check 07
"""

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
    # clock readings (time.perf_counter()). What must run before each reading, so that it
    # counts the work and not only its queueing?
    # END YOUR CODE
    slowest = torch.tensor([sum(times)], dtype=torch.float64)
    # YOUR CODE: make `slowest` the largest total over the ranks, on every rank (one collective).
    # END YOUR CODE
    return slowest.item()
