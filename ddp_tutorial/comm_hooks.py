"""Gradient compression for DDP: which communication hook ``--comm-hook`` registers.

DDP all_reduces every gradient bucket in float32. A communication hook
replaces that all_reduce: ``fp16``/``bf16`` halve the bytes on the wire
(each rank casts its bucket, the sum travels in 16 bits, the result is cast
back), ``powersgd`` sends low-rank factors of each gradient matrix and keeps
the compression error to add back next step (error feedback). Worth it when
the network, not the GPU, is the bottleneck (many nodes, no InfiniBand);
lesson 11 measures what each one changes.

PowerSGD starts compressing at ``start_powerSGD_iter`` (1000 here, its
documented default: a warm-up of exact all_reduces keeps early training
stable); before that it *is* the plain all_reduce. Its error-feedback
buffers are not part of a template snapshot: a resume restarts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def comm_hook(name: str, start_powersgd_iter: int = 1000) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook  # state None: the default group
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=start_powersgd_iter,
        )
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(f"--comm-hook must be one of {COMM_HOOKS[1:]} (or none), got {name!r}")
