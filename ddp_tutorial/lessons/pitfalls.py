"""Three things DDP users trip over, each run inside the ranks of lesson 04's launch.

* **BatchNorm breaks "2 ranks × 16 = 1 process × 32".** Each rank normalises
  with its own shard's statistics, so DDP trains the model one process would
  train if it normalised each 16-sample chunk separately ("ghost batches"),
  not the model it trains on the whole 32. :func:`bn_model` and
  ``anatomy.train_single(..., chunks=N)`` give both references.
* **Reentrant activation checkpointing with ``find_unused_parameters=True``**
  (seed 000 turns the flag on always). ``checkpoint(..., use_reentrant=True)``
  runs the block's forward without building a graph, so DDP's search for
  unused parameters after forward does not find the block's parameters and
  marks them ready at once; when backward reaches the block and recomputes it,
  their gradients arrive and are marked ready a second time: "Expected to
  mark a variable ready only once". Fixes: ``use_reentrant=False`` (the
  recommended checkpoint), or ``static_graph=True`` instead of the search.
* **Two forwards before one backward with BatchNorm** (a GAN discriminator on
  fake, then on real). By default each DDP forward copies
  rank 0's buffers into place; torch 2.6 up to the release that took pytorch
  PR #175851 (Feb 2026) raised "modified by an inplace operation" on the next
  backward. :func:`two_forwards` runs it and the usual fixes; what holds on
  every version is which fixes change the gradient.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddp_tutorial.distributed import wrap
from ddp_tutorial.lessons.anatomy import IN_FEATURES, NUM_CLASSES, first_line, flat_grads


def bn_model(seed: int, hidden: int = 16) -> nn.Module:
    """Linear → BatchNorm → ReLU → Linear, initialised from ``seed`` only."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


class Checkpointed(nn.Module):
    """An MLP whose middle block is recomputed in backward (activation checkpointing)."""

    def __init__(self, seed: int, use_reentrant: bool | None, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(IN_FEATURES, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, NUM_CLASSES)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if self.use_reentrant is None:  # not passed: torch warns, then picks use_reentrant=True
            h = checkpoint(self.block, h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)  # saves memory
        return self.head(h)


CHECKPOINT_CASES = {
    "reentrant + find_unused_parameters": (True, {"find_unused_parameters": True}),
    "use_reentrant not passed + find_unused_parameters": (None, {"find_unused_parameters": True}),
    "use_reentrant=False + find_unused_parameters": (False, {"find_unused_parameters": True}),
    "reentrant + static_graph": (True, {"static_graph": True}),
}


def checkpointing(
    seed: int, x: torch.Tensor, y: torch.Tensor, device: torch.device, steps: int = 3
) -> dict[str, Any]:
    """Each of :data:`CHECKPOINT_CASES` trained ``steps`` steps: its error or its gradients."""
    out: dict[str, Any] = {}
    for name, (reentrant, options) in CHECKPOINT_CASES.items():
        ddp = wrap(Checkpointed(seed, reentrant), device, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:  # kept in the record, not printed
            warnings.simplefilter("always")
            try:
                for _ in range(steps):
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(ddp(x), y).backward()
                    grad = flat_grads(ddp)
                    opt.step()
                out[name] = {"error": None, "grad": grad}
            except RuntimeError as exc:  # raised in backward, on every rank alike
                out[name] = {"error": first_line(exc, lines=20), "grad": None}
        checkpoint_warnings = [str(w.message) for w in caught if "use_reentrant" in str(w.message)]
        out[name]["warning"] = checkpoint_warnings[0] if checkpoint_warnings else None
    return out


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option that stops the buffer copy before each forward, in this torch's spelling.

    ``forward_sync_buffers=False`` where this torch has it (2.13+; it still
    copies rank 0's buffers once, at construction: what you want here), else
    ``broadcast_buffers=False`` (which 2.14.1 deprecates with a FutureWarning
    and which, unlike the new name, also skips the copy at construction).
    """
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


def two_forwards(
    seed: int, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """Two halves of the batch through a BatchNorm model, one backward: three ways.

    ``two forwards``: the GAN pattern, buffers synced before each forward (default).
    ``no buffer sync``: the same computation without the buffer copy
    (:func:`no_forward_buffer_sync`).
    ``one combined forward``: both halves in one call — BatchNorm then
    normalises them *together*, a different computation.
    """
    half = x.shape[0] // 2
    parts = [(x[:half], y[:half]), (x[half:], y[half:])]
    out: dict[str, Any] = {}
    for name in ("two forwards", "no buffer sync", "one combined forward"):
        options = no_forward_buffer_sync() if name == "no buffer sync" else {}
        ddp = wrap(bn_model(seed), device, **options)
        try:
            if name == "one combined forward":
                loss = F.cross_entropy(ddp(x), y, reduction="sum") / 2
            else:
                loss = sum(F.cross_entropy(ddp(px), py, reduction="sum") for px, py in parts) / 2
            loss.backward()
            out[name] = {"error": None, "grad": flat_grads(ddp)}
        except RuntimeError as exc:  # torch 2.6 up to the fix: the buffer copy was in place
            out[name] = {"error": first_line(exc, lines=3), "grad": None}
    return out
