"""Lesson 04, a reference answer: gradient accumulation (see ../04_accumulate_no_sync.py)."""

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # e.g. F.cross_entropy: a mean


def accumulation_step(
    model: DDP, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], loss_fn: LossFn
) -> None:
    """One optimizer step over k micro-batches: the step one process takes on all of them."""
    k = len(micro_batches)
    optimizer.zero_grad(set_to_none=True)
    # YOUR CODE: forward and backward for every (x, y); all but the last inside model.no_sync().
    for x, y in micro_batches[:-1]:
        with model.no_sync():  # forward and backward in here: the gradients add up, unsent
            (loss_fn(model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (loss_fn(model(x), y) / k).backward()  # outside: one all_reduce of the accumulated sum
    # END YOUR CODE
    optimizer.step()
