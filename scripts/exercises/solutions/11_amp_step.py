"""Lesson 11, a reference answer: a mixed-precision step, accumulated (see ../11_amp_step.py)."""

from contextlib import nullcontext

import torch
from torch import nn


def amp_step(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    dtype: torch.dtype,
) -> float:
    """One optimizer step of the DDP ``model`` over ``micro_batches``, in ``dtype``; the loss."""
    accum, total = len(micro_batches), 0.0
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        last = i == accum - 1
        sync, cast = nullcontext(), nullcontext()
        # YOUR CODE: `sync`: no all_reduce but on the last micro-batch; `cast`: autocast
        sync = nullcontext() if last else model.no_sync()
        cast = torch.autocast(x.device.type, dtype=dtype)
        # END YOUR CODE
        with sync:
            with cast:
                loss = nn.functional.cross_entropy(model(x), y) / accum
            to_backward = loss
            # YOUR CODE: what backward() must run on, with a GradScaler
            to_backward = scaler.scale(loss)  # fp16: small gradients stay above 0
            # END YOUR CODE
            to_backward.backward()
        total += loss.item()
    # YOUR CODE: the optimizer step, and the scale for the next one
    scaler.step(optimizer)  # unscales; skips the step on every rank if a gradient is inf/nan
    scaler.update()  # after a skip: the scale halves
    # END YOUR CODE
    return total
