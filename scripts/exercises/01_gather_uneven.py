"""Lesson 01, your turn: all_gather tensors whose lengths differ from rank to rank.

``dist.all_gather(out, t)`` needs the same shape on every rank, but per-rank results often
differ (an evaluation shard of 151 samples beside one of 150). Return every rank's 1-D
tensor, in rank order, on every rank, each with its own length, in the dtype it was sent in
(every rank sends the same dtype: the check sends int64 labels, -1 and 0 among them), the
tensors through ``dist.all_gather`` (not ``all_gather_object``: it pickles on the CPU; a few
lengths may go either way).

A tensor you make for a collective goes on the device of the ones you are given
(device=x.device): gloo takes CPU tensors, nccl CUDA ones only (lesson 01, "Backends:
gloo and nccl"), and the check reads your lines for it.

Check it (2 gloo ranks; rank 0 has 3 values, rank 1 has 5; int64, then floats):

    ddp-tutorial check 01
"""

import torch
import torch.distributed as dist


def gather_uneven(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (lengths differ), in rank order, on every rank."""
    world = dist.get_world_size()
    result = [tensor] * world  # yours to replace: every rank's tensor, in rank order
    # YOUR CODE: 1. all_gather every rank's length (one number each: the same shape everywhere)
    #            2. pad yours to the longest, all_gather the padded tensors
    #            3. trim each one to its rank's length: that list is `result`
    # END YOUR CODE
    return result
