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


def bn_model(seed: int, hidden: int = 16) -> nn.Module:
    """Linear → BatchNorm → ReLU → Linear, initialised from ``seed`` only: lesson 04's
    BatchNorm model, trained by the ranks and by the one-process reference alike."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


TOKEN_FEATURES, TOKEN_CLASSES, MAX_TOKENS = 4, 3, 12
IGNORE_INDEX = -100  # cross_entropy's default ignore_index: padding, no label


def token_batches(rank: int, k: int, seed: int = 0, rows: int = 2) -> list[Any]:
    """Rank ``rank``'s ``k`` micro-batches of padded sequences, ``(x [rows, MAX_TOKENS, F],
    labels [rows, MAX_TOKENS])``: labels are IGNORE_INDEX past each sequence's length, and the
    lengths differ from one micro-batch and one rank to the next, as they do in text."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    out = []
    for _ in range(k):
        lengths = torch.randint(1, MAX_TOKENS + 1, (rows,), generator=gen)
        x = torch.randn(rows, MAX_TOKENS, TOKEN_FEATURES, generator=gen)
        y = torch.randint(0, TOKEN_CLASSES, (rows, MAX_TOKENS), generator=gen)
        y[torch.arange(MAX_TOKENS) >= lengths[:, None]] = IGNORE_INDEX
        out.append((x, y))
    return out


def token_model(seed: int) -> nn.Module:
    """A per-token classifier (logits for every position), initialised from ``seed`` only."""
    torch.manual_seed(seed)
    return nn.Linear(TOKEN_FEATURES, TOKEN_CLASSES)


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


@dataclass
class StepTimeline(CommCounter):
    """What one DDP step did, and in which order: gradients ready, buckets sent, buckets done.

    The state of :func:`timed_allreduce_hook`. :meth:`watch` puts a hook on
    every parameter that notes when backward produced its gradient; the comm
    hook notes when DDP handed it each bucket (the all_reduce is launched
    then) and when that all_reduce finished; :meth:`mark` notes the phases of
    the step (forward, backward, optimizer). Times are milliseconds since
    :meth:`reset`, on this process's clock (on a GPU: when the CPU *launched*
    the work). :meth:`record` gives it all as plain data for the rank's record.
    """

    names: dict[int, str] = field(default_factory=dict)  # data_ptr of a parameter -> its name
    origin: float = field(default_factory=time.perf_counter)
    marks: dict[str, float] = field(default_factory=dict)
    grads: list[tuple[str, float]] = field(default_factory=list)
    buckets: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return 1e3 * (time.perf_counter() - self.origin)

    def reset(self) -> None:
        super().reset()
        self.marks.clear()
        self.grads.clear()
        self.buckets.clear()
        self.origin = time.perf_counter()

    def mark(self, phase: str) -> None:
        self.marks[phase] = self.now()

    def watch(self, model: nn.Module) -> None:
        """Note the moment backward computes each parameter's gradient (a tensor hook)."""
        for name, p in model.named_parameters():
            self.names[p.data_ptr()] = name
            p.register_hook(lambda grad, name=name: self.grads.append((name, self.now())))

    def record(self) -> dict[str, Any]:
        return {"marks": dict(self.marks), "grads": [list(g) for g in self.grads],
                "buckets": [dict(b) for b in self.buckets]}  # fmt: skip


def timed_allreduce_hook(
    state: StepTimeline, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """:func:`counting_allreduce_hook` that also notes when each bucket left and came back."""
    state.numels.append(bucket.buffer().numel())
    entry = {"index": bucket.index(), "numel": bucket.buffer().numel(), "sent": state.now(),
             "done": None, "params": [state.names.get(p.data_ptr(), "?")
                                      for p in bucket.parameters()]}  # fmt: skip
    state.buckets.append(entry)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        entry["done"] = state.now()
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(done)


def step_order(timeline: dict[str, Any]) -> dict[str, Any]:
    """The order facts of one recorded step (:meth:`StepTimeline.record`), no durations.

    ``first_sent_before_last_grad``: the first bucket left while backward was
    still computing gradients (what lets communication overlap computation);
    ``all_done_before_backward_returned``: ``loss.backward()`` returned only
    after every bucket's all_reduce had finished; ``params_once``: every
    parameter travelled in exactly one bucket.
    """
    grads = [t for _, t in timeline["grads"]]
    buckets = timeline["buckets"]
    sent = [p for b in buckets for p in b["params"]]
    if not grads or not buckets:
        raise ValueError("a step with no gradient or no bucket recorded")
    return {
        "buckets": len(buckets),
        "first_sent_before_last_grad": buckets[0]["sent"] < max(grads),
        "all_done_before_backward_returned": all(
            b["done"] is not None and b["done"] <= timeline["marks"]["optimizer.step"]
            for b in buckets
        ),
        "params_once": sorted(sent) == sorted(name for name, _ in timeline["grads"]),
    }


def ddp_step_figure(records: list[dict[str, Any]], values: int = 24) -> Any:
    """Lesson 04's picture, from the launch's records: construction, then two steps in time.

    Top: the first ``values`` parameters of every rank before and after
    ``DDP(model)`` (rank 0's are broadcast). Below, rank 0's first and last
    recorded step, one row per event source: the step's phases; each
    parameter, with a dot where backward computed its gradient (coloured by
    the bucket it travels in); each bucket, a bar from the moment DDP sent its
    all_reduce to the moment it came back (a dotted line marks the sending).
    """
    from ddp_tutorial.harness.plots import new_figure

    wraps = [r["wrap"] for r in records]
    steps = wraps[0]["timelines"]
    rows_per_step = [1 + len(tl["grads"]) + len(tl["buckets"]) for tl in steps.values()]
    heights = [max(2.0, 0.8 * len(wraps)), *rows_per_step]  # in rows of about 0.3 inch
    fig = new_figure(figsize=(9.5, 0.3 * sum(heights) + 0.8 * len(heights)))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    _construction_panel(fig.add_subplot(grid[0]), wraps, values)
    for k, (step, tl) in enumerate(steps.items()):
        _step_panel(fig.add_subplot(grid[1 + k]), step, tl)
    fig.tight_layout()
    return fig


def _construction_panel(ax: Any, wraps: list[dict[str, Any]], values: int) -> None:
    """Every rank's first ``values`` parameters before and after ``DDP(model)``, as colours."""
    import numpy as np

    table = [w["params_before_wrap"][:values] for w in wraps]
    table += [w["params_after_wrap"][:values] for w in wraps]
    labels = [f"rank {r} before DDP()" for r in range(len(wraps))]
    labels += [f"rank {r} after DDP()" for r in range(len(wraps))]
    ax.imshow(np.array(table), aspect="auto", cmap="coolwarm", interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel(f"the first {values} parameter values (colour: value)", fontsize=8)
    ax.set_title("construction: DDP(model) broadcasts rank 0's parameters to every rank",
                 fontsize=9)  # fmt: skip


def _step_panel(ax: Any, step: str, tl: dict[str, Any]) -> None:
    """One recorded step in time: phases, gradient-ready dots, one bar per bucket."""
    marks, grads, buckets = tl["marks"], tl["grads"], tl["buckets"]
    bucket_of = {p: i for i, b in enumerate(buckets) for p in b["params"]}
    top = len(grads) + len(buckets)
    phases = [("forward", "backward", "0.55"), ("backward", "optimizer.step", "0.8"),
              ("optimizer.step", "done", "0.55")]  # fmt: skip
    for a, b, grey in phases:
        ax.broken_barh([(marks[a], marks[b] - marks[a])], (top - 0.35, 0.7), color=grey)
    ax.text(marks["backward"], top, " backward() ", fontsize=7, va="center")
    for row, (name, t) in enumerate(grads):
        ax.plot(t, top - 1 - row, "o", ms=6, color=f"C{bucket_of.get(name, 0) % 10}",
                mec="k", mew=0.5)  # fmt: skip
    for i, b in enumerate(buckets):
        y = len(buckets) - 1 - i
        ax.broken_barh([(b["sent"], b["done"] - b["sent"])], (y - 0.3, 0.6),
                       color=f"C{i % 10}", alpha=0.85, label=f"bucket {i}")  # fmt: skip
        ax.vlines(b["sent"], y, top - 0.5, color=f"C{i % 10}", ls=":", lw=1)
        layers = ", ".join(dict.fromkeys(p.rsplit(".", 1)[0] for p in b["params"]))
        ax.text(b["sent"], y, f" {b['numel']} values ({layers})", fontsize=7, va="center")
    ax.set_yticks(
        [top, *(top - 1 - r for r in range(len(grads))), *range(len(buckets))][::-1],
        [f"all_reduce of bucket {i}" for i in range(len(buckets))]
        + [f"grad of {name}" for name, _ in grads][::-1]
        + ["forward | backward | step"],
        fontsize=7,
    )
    ax.set_ylim(-0.6, top + 0.6)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(f"step {step} on rank 0: {len(buckets)} bucket(s)", fontsize=9)
    ax.set_xlabel("ms since the step began", fontsize=8)


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
