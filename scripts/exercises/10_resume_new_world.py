"""Lesson 10, your turn: the rest of an interrupted epoch, dealt out to a new number of ranks.

A node was lost mid-epoch: the job stopped on 2 ranks and resumes on 3. The template can do
this because every rank takes every WORLD_SIZE-th entry of ONE seeded order of the epoch, so
after k steps of batch B on N ranks the job has used exactly the first k*B*N positions of that
order, whatever N was: the snapshot keeps that count, ``consumed``. Write what each rank of the
new world trains on for the rest of the epoch: the order's positions after ``consumed``, padded
to a multiple of the new world size by repeating their start (so that every rank takes the
same number of steps - a rank with one batch less leaves the others waiting in an all_reduce),
dealt out rank r, r + world_size, ... - so that the next snapshot can count them the same way.

Check it (3 gloo ranks, resuming epochs that 2 and 4 ranks had started, and a fresh one):

    ddp-tutorial check 10
"""

import torch


def rest_of_epoch(num_samples: int, seed: int, epoch: int, consumed: int, rank: int,
                  world_size: int) -> list[int]:  # fmt: skip
    """The sample indices this rank trains on for the rest of ``epoch``, after the job (on any
    number of ranks) had consumed its first ``consumed`` samples."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    order = order.tolist()  # the epoch's order: the same on every rank, whatever the world size
    mine: list[int] = []
    # YOUR CODE: skip the positions the job consumed (the first `consumed` of `order`), pad the
    # rest to a multiple of world_size by repeating its start, as often as that takes (as
    # DistributedSampler pads: fewer samples may be left than the padding needs),
    # then deal it out: this rank takes positions rank, rank + world_size, ...
    # END YOUR CODE
    return mine
