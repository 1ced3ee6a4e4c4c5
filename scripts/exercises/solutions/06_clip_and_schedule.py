"""Lesson 06, a reference answer: one accumulated, clipped, scheduled step, alike on every rank.

See ../06_clip_and_schedule.py.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
               micro_batches: list[Batch], max_norm: float) -> float:  # fmt: skip
    """One optimizer step of a real loop under DDP (``model`` is the DDP wrapper) over k
    micro-batches; returns the gradient norm that clipping measured, for the log."""
    optimizer.zero_grad()
    k = len(micro_batches)
    norm = torch.tensor(0.0)
    # YOUR CODE: for each micro-batch, forward and backward through the scaler (its loss
    # nn.functional.cross_entropy(model(x), y), divided by k), all but the last inside
    # model.no_sync() - `nullcontext()` is the context that does nothing; after the last one:
    # the true gradients back, clipped to max_norm (keep the norm it measured), the step through
    # the scaler, the scaler's update, the learning rate's next value - on every rank
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == k - 1 else model.no_sync():  # one all_reduce: the last
            loss = nn.functional.cross_entropy(model(x), y) / k
            scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    # END YOUR CODE
    return float(norm)
