"""Lesson 06, your turn: one optimizer step as a real loop takes it, the same on every rank.

Write the step the template takes: the loss scaled by the GradScaler for backward (under DDP
the gradients are averaged over the ranks when backward() returns), the true gradients back
with ``scaler.unscale_(optimizer)`` *before* ``clip_grad_norm_`` (else it measures gradients
65536 times too large, and the step shrinks by as much), the optimizer's step through the
scaler, then ``scaler.update()`` and ``scheduler.step()`` - on every rank: stepped on rank 0
alone, the ranks' learning rates part, and their replicas drift apart without an error.
Return the norm clipping measured (a rising norm is the first sign of divergence: log it).

Check it (2 gloo ranks, three steps of a small DDP model with large gradients, compared with
one clipped SGD step on the global batch; the calls your step made are noted too, in order:
on this CPU in float32 a step past the scaler changes no number):

    ddp-tutorial check 06
"""

import torch
import torch.distributed as dist
from torch import nn


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
               x: torch.Tensor, y: torch.Tensor, max_norm: float) -> float:  # fmt: skip
    """One optimizer step of a real loop under DDP (``model`` is the DDP wrapper); returns the
    gradient norm that clipping measured, for the log."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    norm = torch.tensor(0.0)
    # YOUR CODE: backward through the scaler (DDP averages the gradients there); the true
    # gradients back (the scaler multiplied them); clip them to max_norm, keeping the norm it
    # measured; the optimizer's step through the scaler, and the scaler's update; then the
    # learning rate's next value - on every rank
    # END YOUR CODE
    return float(norm)
