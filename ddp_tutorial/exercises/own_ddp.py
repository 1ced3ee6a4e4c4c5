"""What lesson 12's two exercises (your own DDP) train on: the check's MLP, each rank's batches,
the training loop they share, and DistributedDataParallel's results to compare with.

Apart from the judges (``lesson12``, ``lesson12_buckets``): a model or a batch changed here
changes what every one of their verdicts is measured against, in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from ddp_tutorial.exercises.tracing import Trace

SIZES = (8, 32, 32, 32, 4)  # the MLP's widths, as it runs: 4 Linear layers, 8 parameter tensors
# 1056 fp32 numbers: 3 buckets for this MLP, not 1, not 8; and its first bucket holds exactly
# the cap, so a bucket closed only above it (`>` for DDP's `>=`) comes out different
BUCKET_CAP_BYTES = 4224
SECOND_CAP_BYTES = 1100  # the layout asked again at another cap: 4 buckets, not 3
STEPS = 4  # SGD steps; the first is a warm-up, the others are timed
TIMING_ROUNDS = 8  # then one step of yours, one of DDP's, in turn: the quickest of each counts
BATCH = 16  # samples per rank and step
LR = 0.1


DEFINED = (3, 1, 0, 2)  # the MLP's layers by the place each runs in, in the order it defines them


class OutOfOrderMLP(nn.Module):
    """The check's MLP: its layers run from input to output but are defined out of that order
    (``DEFINED``). DDP's first buckets assume the layers run in the order they are defined (its
    own comment in ``DistributedDataParallel.__init__``; it rebuilds them after a step in the
    order the gradients came); buckets built by that rule here fill neither in their list's
    order nor in its reverse (2, 0, 1), so a bucket paired with its Work by position (zip, or
    zip with reversed()), found by a count over all the gradients, or sent when its last-listed
    parameter is ready, is seen (helper 171: an MLP run in definition order passed all three;
    helper 175: one defined from the output back passed the reversed ones)."""

    def __init__(self) -> None:
        super().__init__()
        widths = list(zip(SIZES, SIZES[1:], strict=False))
        self.layers = nn.ModuleList(nn.Linear(*widths[i]) for i in DEFINED)
        self.run_order = sorted(range(len(DEFINED)), key=DEFINED.__getitem__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *hidden, out = (self.layers[i] for i in self.run_order)
        for layer in hidden:
            x = torch.relu(layer(x))
        return out(x)


def make_model(seed: int) -> nn.Module:
    """The MLP, from ``seed``: every rank builds its own (different) weights, as in lesson 04."""
    torch.manual_seed(seed)
    return OutOfOrderMLP()


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples at ``step``: different on every rank, as a DistributedSampler's are."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, SIZES[0], generator=g), torch.randint(
        0, SIZES[-1], (BATCH,), generator=g
    )


def flat_weights(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach()


def train(
    model: nn.Module,
    rank: int,
    lr: float,
    finish: Callable[[], None] = lambda: None,
    trace: Trace | None = None,
    steps: int = STEPS,
) -> list[float]:
    """``steps`` SGD steps on this rank's batches; each step's seconds."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seconds = []
    for step in range(steps):
        x, y = rank_batch(rank, step)
        begun = time.perf_counter()
        if trace is not None:
            trace.step, trace.grads = step, 0
        weights = flat_weights(model).clone() if trace is not None else None
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        finish()
        if trace is not None:
            trace.add("step", unwaited=len(trace.unwaited))
            trace.moved_weights |= not torch.equal(weights, flat_weights(model))  # before the step
        opt.step()
        seconds.append(time.perf_counter() - begun)
    return seconds


def references(rank: int, world: int) -> dict[str, Any]:
    """The weights after STEPS steps: DDP's; DDP's with the gradients summed (SGD without
    momentum: the sum is the mean times world, so lr times world), or divided twice (lr over
    world); rank 0's start trained on
    this rank's data alone. And DDP's step times."""
    ddp = DDP(make_model(rank))  # DDP broadcasts rank 0's weights, as yours must
    seconds = train(ddp, rank, LR)
    summed = DDP(make_model(rank))
    train(summed, rank, LR * world)
    halved = DDP(make_model(rank))  # divided by the world size twice
    train(halved, rank, LR / world)
    alone, own_over_world = make_model(0), make_model(0)
    train(alone, rank, LR)
    train(own_over_world, rank, LR / world)  # its own gradient / world: the sum went elsewhere
    return {
        "ddp": flat_weights(ddp.module),
        "summed": flat_weights(summed.module),
        "halved": flat_weights(halved.module),
        "alone": flat_weights(alone),
        "own_over_world": flat_weights(own_over_world),
        "ddp_seconds": seconds,
        "ddp_model": ddp,  # for the timing rounds
    }


def quickest_steps(
    mine: nn.Module, finish: Callable[[], None], ddp: nn.Module, rank: int,
    timed: tuple[list[float], list[float]],
) -> tuple[float, float]:  # fmt: skip
    """``(yours, DDP's)``: the quickest step of each, over the timed steps and TIMING_ROUNDS
    more taken in turn. On a busy host a few steps can all be slowed (a reference answer once
    measured 92x DDP's beside a full test suite); in turn, both sides see the same host."""
    mine_s, ddp_s = min(timed[0][1:]), min(timed[1][1:])  # the first step: a warm-up
    for _ in range(TIMING_ROUNDS):
        mine_s = min(mine_s, *train(mine, rank, LR, finish, steps=1))
        ddp_s = min(ddp_s, *train(ddp, rank, LR, steps=1))
    return mine_s, ddp_s
