"""Lesson 05, a reference answer: a rank-0 atomic snapshot, and the load that goes with it."""

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def save_snapshot(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                  step: int) -> None:  # fmt: skip
    """Every rank calls it; global rank 0 writes ``path``; every rank returns once it is there."""
    # YOUR CODE: on global rank 0 only: the state {"model", "optimizer", "epoch", "step"}, with
    # the model inside DDP (`model` is the wrapper); written to a temporary name in the same
    # folder as `path`, flushed and fsynced, then renamed over `path` with os.replace.
    # Then every rank waits until the file is in place.
    if dist.get_rank() == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch, "step": step}  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    dist.barrier()
    # END YOUR CODE


def load_snapshot(path: Path, device: torch.device) -> dict[str, Any]:
    """What every rank reads back: tensors and plain values only, onto ``device``."""
    state: dict[str, Any] = {}
    # YOUR CODE: read `path` onto `device`, whatever device wrote it; tensors and plain values only
    state = torch.load(path, map_location=device, weights_only=True)
    # END YOUR CODE
    return state
