"""Lesson 10, a reference answer: the rest of an epoch, dealt out to a new number of ranks."""

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
    rest = order[consumed:]
    padding = -len(rest) % world_size
    rest += (rest * padding)[:padding]
    mine = rest[rank::world_size]
    # END YOUR CODE
    return mine
