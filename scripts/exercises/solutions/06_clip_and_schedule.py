"""Lesson 06, a reference answer: one clipped, scheduled optimizer step, alike on every rank."""

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
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    # END YOUR CODE
    return float(norm)
