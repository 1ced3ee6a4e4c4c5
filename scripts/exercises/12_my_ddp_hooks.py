"""Lesson 12, your turn (1 of 2): your own DDP, the simplest one that is right.

``DDP(model)`` does two things for you (lesson 04, "What DDP does with them"): at
construction it broadcasts rank 0's weights, so that every replica starts the same; in
backward, a hook on every parameter averages its gradient over the ranks, so that every
replica takes the same step. Write both, with no DDP: ``broadcast_parameters`` copies rank
0's parameters to every rank; ``add_gradient_hooks`` registers, on every parameter,
``p.register_post_accumulate_grad_hook(hook)``: autograd calls ``hook(p)`` as soon as
``p.grad`` holds this backward's gradient, and the hook replaces it with the mean over the
ranks (``dist.all_reduce`` sums; then divide by the world size).

A tensor you make for a collective goes on the device of the ones you are given
(device=x.device): gloo takes CPU tensors, nccl CUDA ones only (lesson 01, "Backends:
gloo and nccl"), and the check reads your lines for it.

Check it (2 gloo ranks, each starting from its own random weights; your 4 SGD steps are
compared with DistributedDataParallel's on the same data):

    ddp-tutorial check 12
"""

import torch
import torch.distributed as dist
from torch import nn


def broadcast_parameters(model: nn.Module) -> None:
    """Rank 0's parameters on every rank, in place (what ``DDP(model)`` does at construction)."""
    # YOUR CODE: for every parameter, dist.broadcast its tensor from rank 0 (src=0), in place.
    # (DDP broadcasts outside autograd: p.data, or the loop under torch.no_grad(), does too.)
    # END YOUR CODE


def add_gradient_hooks(model: nn.Module) -> None:
    """After every backward, each ``p.grad`` holds the mean of the ranks' gradients."""
    world = dist.get_world_size()

    # YOUR CODE: define hook(p): all_reduce p.grad (a sum, in place), then divide it by world;
    # register it on every parameter: p.register_post_accumulate_grad_hook(hook).
    # END YOUR CODE
