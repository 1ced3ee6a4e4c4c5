"""Lesson 04, a reference answer: gradient accumulation (see ../04_accumulate_no_sync.py)."""

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
    device = micro_batches[0][1].device  # nccl's collectives take tensors on the GPU only
    count = torch.tensor(float(sum(len(y) for _, y in micro_batches)), device=device)
    dist.all_reduce(count)  # the step's samples over every rank, before the forwards
    for x, y in micro_batches[:-1]:
        with model.no_sync():  # forward and backward in here: the gradients add up, unsent
            (loss_fn(model(x), y, reduction="sum") * world / count).backward()
    x, y = micro_batches[-1]
    (loss_fn(model(x), y, reduction="sum") * world / count).backward()  # outside: one all_reduce
    # END YOUR CODE
    optimizer.step()
