"""Lesson 02, a reference answer: exact validation over ranks (see ../02_exact_accuracy.py)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset


def exact_accuracy(model: nn.Module, dataset: Dataset, batch_size: int = 4) -> tuple[int, int]:
    """(correct, count) over the WHOLE ``dataset``, the same on every rank (the group is up).

    ``model`` is the plain model (``ddp_model.module`` in a training script); it predicts the
    class with the largest output.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device  # nccl: a collective's tensors on the GPU
    sums = torch.zeros(2, dtype=torch.int64, device=device)  # [correct, count]
    # YOUR CODE: this rank's samples without padding, counted into `sums`, then every rank's sums
    # added up.
    shard = Subset(dataset, range(rank, len(dataset), world))  # r, r + N, ...: no padding
    loader = DataLoader(shard, batch_size=batch_size)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)  # the model's device (a GPU under nccl)
            right = (model(x).argmax(dim=1) == y).sum()
            sums += torch.stack([right, torch.tensor(len(y), device=device)])
    dist.all_reduce(sums)  # every rank: the totals, each sample counted once
    # END YOUR CODE
    return int(sums[0]), int(sums[1])
