"""Lesson 02, your turn: exact validation on a set that does not divide by the ranks.

Every rank evaluates its part of the validation set and the ranks add up what they counted.
The number must be the one a single process would report: every sample counted exactly once.
A ``DistributedSampler`` pads (it repeats samples until every rank has as many), so summing
over it counts the repeats twice; ``drop_last=True`` leaves samples out. Give rank r the
samples r, r + N, r + 2N, ... (no padding), count ``[correct, count]`` on it, and add the
ranks' counts with ``dist.all_reduce``, so that every rank returns the totals.

A tensor you make for a collective goes on the device of the ones you are given
(device=x.device): gloo takes CPU tensors, nccl CUDA ones only (lesson 01, "Backends:
gloo and nccl"), and the check reads your lines for it.

Check it (2 gloo ranks, 11 validation samples; the check calls your function on every rank):

    ddp-tutorial check 02
"""

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
    # added up. Hint: Subset(dataset, range(...)) and a DataLoader; model.eval(), torch.no_grad().
    # END YOUR CODE
    return int(sums[0]), int(sums[1])
