"""Small, inspectable pieces for looking inside DDP (lesson 04).

Everything here is plain PyTorch, shared by ``scripts/demos/ddp_anatomy.py`` (the
ranks), the notebook (the single-process reference) and the tests, so that the
DDP run and the reference it is compared with use the very same model, data
and optimizer — the comparison is only meaningful if nothing else differs.
"""

# No `from __future__ import annotations` here: DDP checks the comm hook's annotations
# at run time (``bucket: dist.GradBucket`` must be the class, not a string).
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_tutorial.models import MLP

IN_FEATURES = 8
NUM_CLASSES = 3


def tiny_model(seed: int, hidden: int = 16) -> nn.Module:
    """An MLP whose initial weights depend only on ``seed`` (ranks pick different seeds)."""
    torch.manual_seed(seed)
    return MLP(IN_FEATURES, NUM_CLASSES, hidden=hidden)


def global_batch(step: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``step``-th global batch: the same on every process, learnable labels."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, IN_FEATURES, generator=gen)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(dim=1)


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous, equal slice of a batch (what a sampler would give it)."""
    if tensor.shape[0] % world_size:
        raise ValueError(
            f"a batch of {tensor.shape[0]} does not split into {world_size} equal shards; "
            "DDP equals one big batch only when every rank's loss is a mean over the same count"
        )
    n = tensor.shape[0] // world_size
    return tensor[rank * n : (rank + 1) * n]


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one CPU vector (for comparing replicas)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients as one CPU vector (zeros where a parameter has no gradient)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
            for p in model.parameters()
        ]
    )


def sgd_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer
) -> float:
    """One step: mean cross-entropy over *this process's* batch, backward, update."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # under DDP this is where the gradients are all-reduced
    opt.step()
    return loss.item()


def train_single(
    seed: int,
    steps: int,
    batch_size: int,
    lr: float,
    build: Callable[[int], nn.Module] = tiny_model,
    chunks: int = 1,
) -> torch.Tensor:
    """The reference: one process, the whole global batch each step. Returns final params.

    ``chunks > 1`` runs the model on that many equal slices of the batch and
    takes the loss over all of them: a BatchNorm model then normalises each
    slice with its own statistics, which is what ``chunks`` DDP ranks do.
    """
    model = build(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = global_batch(step, batch_size)
        if chunks == 1:
            sgd_step(model, x, y, opt)
            continue
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(torch.cat([model(part) for part in x.chunk(chunks)]), y).backward()
        opt.step()
    return flat_params(model)


@dataclass
class CommCounter:
    """State of :func:`counting_allreduce_hook`: one entry per all_reduce DDP launched."""

    numels: list[int] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.numels)

    def reset(self) -> None:
        self.numels.clear()


def counting_allreduce_hook(
    state: CommCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all_reduce (sum, then divide by world size), counted per bucket.

    DDP calls its communication hook once per gradient *bucket* as soon as
    every gradient in that bucket is ready — while backward is still running
    for the layers below. Register with ``ddp.register_comm_hook(counter, hook)``.
    """
    state.numels.append(bucket.buffer().numel())
    return default_hooks.allreduce_hook(None, bucket)


class UnusedBranch(nn.Module):
    """A model whose ``aux`` head never contributes to the output (a common accident)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN_FEATURES, NUM_CLASSES)
        self.aux = nn.Linear(IN_FEATURES, NUM_CLASSES)  # built, never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def deep_mlp(seed: int, width: int = 64, depth: int = 24) -> nn.Module:
    """A long chain of small layers: the autograd graph that ``find_unused_parameters`` walks."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    layers += [nn.ReLU(), nn.Linear(width, NUM_CLASSES)]
    return nn.Sequential(*layers)


def time_steps(step: Callable[[], object], steps: int) -> list[float]:
    """Wall seconds of each call of ``step`` (take the median: the machine is shared)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def first_line(exc: BaseException, lines: int = 1) -> str:
    """``Type: message`` cut to its first ``lines`` lines (errors can be paragraphs)."""
    text = "\n".join(str(exc).strip().splitlines()[:lines])
    return f"{type(exc).__name__}: {text}"


# -- the anchor bug ------------------------------------------------------------------


def tutorial_series_run(loss_name: str, steps: int = 20, seed: int = 0) -> dict[str, object]:
    """pytorch/examples' ddp-tutorial-series model and data, trained with one loss.

    Its dataset is ``(torch.rand(20), torch.rand(1))`` pairs and its model
    ``Linear(20, 1)``; its Trainer uses ``F.cross_entropy(output, targets)``.
    With one output column, log-softmax is ``z - logsumexp(z) = 0`` for every
    input, so the loss is 0 and every gradient is 0: nothing ever trains. The
    targets are real numbers, so the fix is a regression loss (``mse``).
    """
    losses = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}
    if loss_name not in losses:
        raise ValueError(f"loss must be one of {sorted(losses)}, got {loss_name!r}")
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.rand(64, 20, generator=gen), torch.rand(64, 1, generator=gen)
    torch.manual_seed(seed)
    model = nn.Linear(20, 1)
    before = flat_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    history, grad_norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = losses[loss_name](model(x), y)
        loss.backward()
        grad_norms.append(flat_grads(model).norm().item())
        opt.step()
        history.append(loss.item())
    return {
        "loss": loss_name,
        "first_loss": history[0],
        "last_loss": history[-1],
        "max_grad_norm": max(grad_norms),
        "weights_changed": not torch.equal(before, flat_params(model)),
    }


def run_sections(
    sections: dict[str, Callable[[Any, Any], Any]], args: Any, out: str | None
) -> None:
    """Run ``args.only``'s sections in one process group; each rank writes what it saw.

    One launch for a whole lesson (each launch costs seconds of start-up). The
    sections start together (a barrier between them), so a failure shows up
    in its own section; the record holds every section's result under its name.
    """
    import os

    from ddp_tutorial.distributed import process_group
    from ddp_tutorial.records import write_rank_record

    with process_group(backend=args.backend) as info:
        record = {"backend": info.backend, "device": str(info.device),
                  "world_size": info.world_size, "pid": os.getpid()}  # fmt: skip
        for name in args.only:
            record[name] = sections[name](args, info)
            dist.barrier()
            if info.is_main:
                print(f"{name}: done", flush=True)
        write_rank_record(out, record)
