"""Lesson 04, your turn: gradient accumulation under DDP, micro-batches of unequal sizes.

A batch too large for memory is split into k micro-batches: run forward and backward on each,
let the gradients add up in ``.grad``, then step once. Under DDP every backward would
all-reduce; inside ``with model.no_sync():`` it sends nothing, and the first backward outside
it reduces the accumulated sum. Here the micro-batches differ in size (the last one of an
epoch, variable-length text cut to a token budget), and so do the ranks' totals: rank 0 holds
4 + 4 + 2 samples, rank 1 holds 6 + 3 + 5. The lesson's ``accumulate`` (each mean loss / k)
then trains another step than one process on all 24 samples. Write the step so that it equals
one process's on every sample of every rank (lesson 04, "Tokens, not samples"), with exactly
one all_reduce of the gradients per step.

A tensor you make for a collective goes on the device of the ones you are given
(device=x.device): gloo takes CPU tensors, nccl CUDA ones only (lesson 01, "Backends:
gloo and nccl"), and the check reads your lines for it.

Check it (2 gloo ranks; the check counts DDP's all_reduces and yours, and compares the weights
with one process trained on the global batch):

    ddp-tutorial check 04
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)
LossFn = Callable[..., torch.Tensor]  # F.cross_entropy: a mean, or a sum with reduction="sum"


def accumulation_step(
    model: DDP, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], loss_fn: LossFn
) -> None:
    """One optimizer step over k micro-batches: the step one process takes on all of them."""
    world = dist.get_world_size()
    optimizer.zero_grad(set_to_none=True)
    # YOUR CODE: forward and backward for every (x, y); all but the last inside model.no_sync().
    # The loss of one micro-batch: loss_fn(model(x), y) is the mean over ITS samples. One
    # process would take the mean over every sample of every rank: what does each micro-batch's
    # loss need, so that DDP's average over the ranks gives exactly that? (`world` is above.)
    # Careful: DDP decides in the *forward* whether the backward after it will send.
    # END YOUR CODE
    optimizer.step()
