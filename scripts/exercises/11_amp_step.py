"""Lesson 11, your turn: a mixed-precision optimizer step with accumulation, under DDP.

Lesson 11, "1 · Mixed precision under DDP": forward and loss under autocast (the 16-bit type
`dtype`); backward through a `GradScaler` (float16 needs it: the loss times the scale, so that
small gradients stay above 0); `accum` micro-batches per optimizer step, DDP's all_reduce on the
last one only (`model.no_sync()` on the others); then the step through the scaler, which
unscales the gradients and skips the step if one is inf or nan, and the scaler's update. The
check runs your `amp_step` on 2 gloo ranks with a GradScaler: a step of 4 micro-batches in
float16, compared with float32 on the global batch, then one of 2 micro-batches in bfloat16
with an inf in one rank's gradient: every rank must skip that step and halve its scale; then
one of 3 in bfloat16, taken and compared with float32's.
The scaler it hands you is enabled in both dtypes: go through it always (a scaler disabled
for bfloat16, as the template scripts/train.py makes it, passes the same calls through and
skips nothing). DDP's all_reduces are counted in both.

Check it:

    ddp-tutorial check 11
"""

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
        # (lesson 11's snippet: `model.no_sync()`; `torch.autocast(device_type, dtype=...)`)
        # END YOUR CODE
        with sync:
            with cast:
                loss = nn.functional.cross_entropy(model(x), y) / accum
            to_backward = loss
            # YOUR CODE: what backward() must run on, with a GradScaler
            # (to_backward = the loss as the scaler scales it: lesson 11's snippet)
            # END YOUR CODE
            to_backward.backward()
        total += loss.item()
    # YOUR CODE: the optimizer step, and the scale for the next one
    # (two lines: the step through the scaler, then its update)
    # END YOUR CODE
    return total
