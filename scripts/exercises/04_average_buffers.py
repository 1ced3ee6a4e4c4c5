"""Lesson 04, your turn: make every rank's BatchNorm buffers the same before evaluating.

Each rank's BatchNorm normalises its own batches and keeps running statistics of them
(``running_mean``, ``running_var``): after training, the ranks hold different ones, so they
would evaluate (and rank 0 would save) a model whose statistics come from its own shard only.
Before evaluating or saving, make them the same on every rank: their mean over the ranks
(all_reduce, then divide by the world size; rank 0's alone, a broadcast, would be the same
everywhere but from rank 0's batches only). Every rank calls this function; leave
``num_batches_tracked``, an integer counter that is the same everywhere, alone.

Check it (2 gloo ranks, each with its own images; the check reads every buffer on every rank):

    ddp-tutorial check 04
"""

import torch.distributed as dist
from torch import nn


def average_buffers(model: nn.Module) -> None:
    """Every rank's BatchNorm statistics replaced by their mean over the ranks, on every rank."""
    world = dist.get_world_size()
    # YOUR CODE: all_reduce each floating-point buffer, then divide by the world size.
    # model.buffers() yields every buffer of every layer; buffer.is_floating_point() tells the
    # statistics from the counter. Every rank must make the same calls, in the same order.
    # END YOUR CODE
