"""Lesson 05, your turn: a snapshot that a crash can never leave half-written.

Write ``save_snapshot``, which every rank calls at the end of an epoch: only global rank 0
writes (one writer in the whole job, not one per machine), and it writes atomically: the state
(the model inside DDP, without ``module.``; the optimizer; the epoch and the step) goes to a
temporary file in the same folder, is flushed and fsynced, then renamed over the snapshot with
``os.replace`` - so a crash at any moment leaves the old snapshot or the new one, never half of
one. The other ranks wait at a barrier, so that none reads a file that is not there yet. Then
``load_snapshot``, what every rank calls to read it back: tensors and plain values only
(``weights_only=True``: a pickle can run code), onto this rank's ``device`` (``map_location``),
whatever device rank 0 saved from.

Check it (2 gloo ranks; the check slows rank 0's write down, kills one save in the middle, and
loads a snapshot that rank 0 saved from its GPU):

    ddp-tutorial check 05
"""

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
    # END YOUR CODE


def load_snapshot(path: Path, device: torch.device) -> dict[str, Any]:
    """What every rank reads back: tensors and plain values only, onto ``device``."""
    state: dict[str, Any] = {}
    # YOUR CODE: read `path` onto `device`, whatever device wrote it; tensors and plain values only
    # END YOUR CODE
    return state
