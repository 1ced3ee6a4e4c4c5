"""What the template adds to a DDP step, each piece timed alone, in microseconds.

    python scripts/compare/step_costs.py                      # the course's CNN, 32 px
    python scripts/compare/step_costs.py --model resnet18 --image-size 64

``scripts/compare/speed.py`` compares whole launches, and on a shared VM a
launch's speed moves by tens of percent between minutes: a 1 % difference
between the template and a bare loop is far below what it can see. This
script looks at the difference itself. On the model's real gradients (one
forward and backward on a batch), it times every call the template makes per
optimizer step that a bare DDP loop (``scripts/compare/loops.py --framework
bare``) does not — with the package's own functions, the ones ``train.py``
calls — and the optimizer step both make, each the best of ``--repeats``
runs of ``--number`` calls (the best: noise only ever adds). Per step, the
template's extra microseconds are then set against the bare loop's whole step
(forward, backward, all_reduce, SGD), timed the same way.

One process, a one-rank gloo group (its ``all_reduce`` skips the network:
what a collective costs is ``scripts/benchmark.py``'s subject), one thread,
as each rank of a 2-rank job here.
"""

from __future__ import annotations

import argparse
import math
import timeit
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before init (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.loop import TrainLog, build_optimizer, counted_targets, lr_at, set_lr
from ddp_tutorial.models import MODEL_NAMES, build_model
from ddp_tutorial.records import format_table, write_json
from ddp_tutorial.stopping import StopCheck


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODEL_NAMES, default="cnn")
    p.add_argument("--image-size", type=int, default=32, help="height = width, pixels")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--number", type=int, default=200, help="calls per timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per piece; the best is kept")
    p.add_argument("--out", default=None, help="write the table here as JSON")
    args = p.parse_args(argv)
    if min(args.number, args.repeats, args.batch_size) < 1:
        p.error("--number, --repeats and --batch-size must be at least 1")
    return args


def best_us(fn: Callable[[], Any], number: int, repeats: int) -> float:
    """Microseconds per call of ``fn``: the fastest of ``repeats`` runs of ``number`` calls."""
    fn()  # once untimed: first calls allocate
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def pieces(model: DDP, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The per-step calls to time: ``{name: (fn, calls per step, side)}``.

    ``side`` says whose step the call is in: ``"bare"``, ``"template"``, or
    ``"both"`` (the forward, backward and all_reduce both loops make).
    """
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(model(x), y)
    loss.backward()  # real gradients for the optimizers and the clipping
    # lr 0: the same arithmetic, weights that stay put over thousands of timed calls
    bare_opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # loops.py's
    template_opt = build_optimizer("sgd", model, 0.0, 5e-4)  # train.py --optimizer sgd
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # --amp off: every call a no-op
    checks = StopCheck(torch.device("cpu"))  # every 10 steps (fast ones): an all_reduce of 4
    loss_sum = torch.zeros(2, dtype=torch.float64)
    log = TrainLog(rank=1, every=50, global_batch=64)  # rank 1: returns unless due
    no_norm = torch.tensor(math.nan)
    done = loss.detach()

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)  # both loops zero the gradients every step
        loss_fn(model(x), y).backward()

    def contexts() -> None:  # the micro-batch's no_sync choice and the autocast around forward
        with nullcontext(), torch.autocast("cpu", dtype=torch.float32, enabled=False):
            pass

    def scaler_calls() -> None:  # scaler.step() is optimizer.step(): timed with the optimizers
        scaler.scale(done)
        scaler.unscale_(template_opt)
        scaler.update()

    def clip() -> None:
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def schedule() -> None:
        set_lr(template_opt, lr_at(0.5, 0.05, 0.05), 0.05)

    def token_mean() -> torch.Tensor:  # the step's targets counted over the ranks: a share
        counts = torch.stack([counted_targets(y, loss_fn)])
        total = counts.sum()
        dist.all_reduce(total, async_op=True).wait()
        loss_sum.add_(torch.stack([done.double() * counts[0], counts[0]]))
        return done * counts[0] / total  # the micro-batch's loss, weighed by its share

    return {
        "forward + backward (all_reduce)": (forward_backward, 1, "both"),
        "SGD step (for-loop, no decay)": (bare_opt.step, 1, "bare"),
        "SGD step (fused, decay groups)": (template_opt.step, 1, "template"),
        "clip_grad_norm_": (clip, 1, "template"),
        "autocast + no_sync contexts": (contexts, 1, "template"),
        "GradScaler calls (disabled)": (scaler_calls, 1, "template"),
        "lr_at + set_lr": (schedule, 1, "template"),
        "target count (all_reduce), loss sums": (token_mean, 1, "template"),
        "StopCheck.observe": (lambda: checks.observe(7, done), 1, "template"),
        "StopCheck.check, not due": (lambda: checks.check(7), 0.9, "template"),
        "StopCheck.check, due (all_reduce)": (lambda: checks.check(10, True), 0.1, "template"),
        "TrainLog.step, not due": (lambda: log.step(7, done, 0.1, no_norm), 1, "template"),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each piece's microseconds, and the template's extra per step against the bare step."""
    torch.manual_seed(0)
    model = DDP(build_model(args.model, 10, args.image_size))
    model.broadcast_buffers = False  # as the template; the bare loop's broadcast is not timed
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch_size,))
    rows = []
    for name, (fn, per_step, side) in pieces(model, x, y).items():
        us = best_us(fn, args.number, args.repeats)
        rows.append({"piece": name, "side": side, "us_per_call": us, "calls_per_step": per_step,
                     "us_per_step": us * per_step})  # fmt: skip
    per_side = {s: sum(r["us_per_step"] for r in rows if r["side"] in (s, "both"))
                for s in ("bare", "template")}  # fmt: skip
    bare, template = per_side["bare"], per_side["template"]
    return {"model": args.model, "image_size": args.image_size, "batch_size": args.batch_size,
            "rows": rows, "bare_step_us": bare, "template_step_us": template,
            "extra_us": template - bare, "extra_fraction": (template - bare) / bare}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as each rank under torchrun (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = measure(args)
    finally:
        dist.destroy_process_group()
    shown = [{k: f"{v:.1f}" if isinstance(v, float) else v for k, v in r.items()}
             for r in result["rows"]]  # fmt: skip
    print(format_table(shown))
    print(f"a bare step {result['bare_step_us'] / 1000:.2f} ms; the template's "
          f"{result['template_step_us'] / 1000:.2f} ms: {result['extra_us']:+.0f} µs a step "
          f"({result['extra_fraction']:+.1%})")  # fmt: skip
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
