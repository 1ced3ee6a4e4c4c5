"""Lesson 06, your turn: one optimizer step as the template takes it - accumulated, scaled,
clipped, scheduled - the same on every rank.

Write the step of the template's loop (lesson 06, section 8): the batch comes as k
micro-batches (``--grad-accum``), all but the last under ``model.no_sync()`` so that DDP
all-reduces once (lesson 04), each loss divided by k (they are of equal size here) and scaled
by the GradScaler for backward. After the LAST backward, the gradients are the global batch's:
the true gradients back with ``scaler.unscale_(optimizer)`` - once, it refuses a second call
before ``update()`` - *before* ``clip_grad_norm_`` (else it measures gradients 65536 times too
large), the optimizer's step through the scaler, then ``scaler.update()`` and
``scheduler.step()`` - on every rank: stepped on rank 0 alone, the ranks' learning rates part,
and their replicas drift apart without an error (the template sets the rate by hand from
its position in training, ``kit.set_lr``; with a torch scheduler, as here,
``scheduler.step()`` after the optimizer's step). Return the norm clipping measured (a rising
norm is the first sign of divergence: log it).

Check it (2 gloo ranks, three steps of a small DDP model with large gradients, each of 4
micro-batches, compared with one clipped SGD step on the global batch; DDP's all_reduces and
the calls your step made are noted too, in order: on this CPU in float32 a step past the
scaler changes no number):

    ddp-tutorial check 06
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
    # END YOUR CODE
    return float(norm)
