"""Rank 0 alone: printing there is right, evaluating there is slow, scheduling there is wrong.

    torchrun --standalone --nproc-per-node 2 scripts/demos/imbalance.py --eval rank0 \\
        --schedule rank0                                                        # the habits
    torchrun --standalone --nproc-per-node 2 scripts/demos/imbalance.py --eval sharded  # the fixes

A DDP training loop as you would write it (lesson 06): a GradScaler, gradient
clipping after ``scaler.unscale_``, a warm-up + cosine learning-rate schedule
scaled with the global batch, and log lines from rank 0 only. Two habits of
"only the main process does it" are switchable:

* ``--eval rank0``: rank 0 evaluates a validation batch before every step.
  A DDP step holds collectives that complete only when *every* rank reaches
  them — the buffer broadcast at the start of ``forward()`` (a model with
  BatchNorm, ``broadcast_buffers=True``, the default) and the gradient
  all_reduce in ``backward()`` — so the other ranks wait there, every step.
  ``--eval sharded``: each rank evaluates its slice and the counts are summed
  with all_reduce: the same work, split evenly.
* ``--schedule rank0``: ``scheduler.step()`` on rank 0 only. Nothing fails:
  DDP averages the gradients, but each rank applies them with its own learning
  rate, and the replicas silently drift apart. ``every`` (the default) steps it
  on every rank, once per optimizer step.

The batches are generated once, on the rank's device (no input pipeline: on a
GPU the step is the GPU's work). Each rank records its per-step times (its
evaluation, DDP forward, backward + optimizer step, which include any waiting),
learning rates and gradient norms, and a digest of its weights at the end.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import process_group, wrap
from ddp_tutorial.lessons.perf import clock
from ddp_tutorial.models import MODEL_NAMES, build_model
from ddp_tutorial.recorder import state_digest
from ddp_tutorial.records import write_rank_record

REFERENCE_BATCH = 256  # --lr is the peak learning rate of a global batch of this size
CALIBRATE = 3  # --seconds: the step count is set after this many steps (within the warm-up)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval", choices=["none", "rank0", "sharded"], default="rank0")
    p.add_argument("--schedule", choices=["every", "rank0"], default="every")
    p.add_argument("--model", choices=MODEL_NAMES, default="cnn")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seconds", type=float, default=0.0,
                   help="run at least this long: more steps on a fast device (the monitor's "
                   "samples need seconds of work)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--eval-batch", type=int, default=256, help="validation samples per step")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.2, help="peak LR of a global batch of 256")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.seconds and args.warmup_steps < CALIBRATE:
        p.error(f"--seconds sets the step count after {CALIBRATE} steps, inside the warm-up "
                f"(its rates do not use it): need --warmup-steps >= {CALIBRATE}")  # fmt: skip
    if args.seconds:
        args.steps = max(args.steps, CALIBRATE)  # at least the steps that time the rest
    return args


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


@torch.no_grad()
def count_correct(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> int:
    model.eval()
    correct = (model(images).argmax(1) == labels).sum().item()
    model.train()
    return int(correct)


def steps_for(seconds: float, step_times: list[float], device: torch.device, at_least: int) -> int:
    """The steps that fill ``seconds``, from the steps run so far: the same on every rank.

    A fast GPU does lesson 06's 100 steps in under a second: a handful of
    utilization samples (NVML's own window is up to a second), too few to
    judge "busy". Real steps are timed (evaluation and waiting included), the
    first left out (a warm-up); the slowest rank's mean decides.
    """
    mean = torch.tensor([sum(step_times[1:]) / len(step_times[1:])], dtype=torch.float64,
                        device=device)  # fmt: skip
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return max(at_least, min(20_000, math.ceil(seconds / mean.item())))


def random_batch(n: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images and labels drawn on the generator's device: nothing to load, nothing to copy."""
    device = gen.device
    images = torch.randn(n, 3, size, size, generator=gen, device=device)
    return images, torch.randint(0, 10, (n,), generator=gen, device=device)


@record
def main() -> None:
    args = parse_args()
    with process_group() as info:
        rank, world, device = info.rank, info.world_size, info.device
        log = print if rank == 0 else (lambda *a, **k: None)  # one voice: rank 0's
        torch.manual_seed(0)
        model = wrap(build_model(args.model, 10, args.image_size), device)  # .to(device), DDP
        global_batch = args.batch_size * world
        peak = args.lr * global_batch / REFERENCE_BATCH  # the linear scaling rule
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9)
        gen = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own data
        batches = [random_batch(args.batch_size, args.image_size, gen) for _ in range(4)]
        plan = {"steps": args.steps}  # --seconds: fixed after CALIBRATE steps, in the warm-up
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, args.warmup_steps, plan["steps"])
        )
        scaler = torch.amp.GradScaler(device.type)  # fp16's loss scaling; runs on a CPU too
        val_x, val_y = random_batch(args.eval_batch, args.image_size, gen.manual_seed(1))
        shard = slice(rank, None, world)  # each rank's slice of the validation batch (the fix)
        times: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "eval": []}
        lrs, norms = [], []
        log(f"{world} ranks, global batch {global_batch}, peak lr {peak:.4g}, eval={args.eval}, "
            f"schedule={args.schedule}", flush=True)  # fmt: skip
        start, step = time.time(), 0
        while step < plan["steps"]:
            x, y = batches[step % len(batches)]
            t0 = clock(device)  # on a GPU: after the queued work, or the times mean nothing
            if args.eval == "rank0" and rank == 0:
                count_correct(model.module, val_x, val_y)  # only rank 0 works; others wait
            elif args.eval == "sharded":
                correct = torch.tensor(
                    count_correct(model.module, val_x[shard], val_y[shard]), device=device
                )
                dist.all_reduce(correct)  # every rank gets the full count
            t1 = clock(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)  # broadcasts buffers first
            t2 = clock(device)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # the gradient all_reduce: waits for every rank
            scaler.unscale_(optimizer)  # true gradients again, before measuring them
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            lrs.append(optimizer.param_groups[0]["lr"])  # the rate this step uses
            scaler.step(optimizer)  # skipped if a gradient is inf/nan (on every rank alike)
            scaler.update()
            if args.schedule == "every" or rank == 0:
                scheduler.step()  # "every": once per optimizer step, on every rank
            t3 = clock(device)
            times["eval"].append(t1 - t0)
            times["forward"].append(t2 - t1)
            times["backward"].append(t3 - t2)
            times["step"].append(t3 - t0)
            norms.append(norm.item())
            if args.seconds and step == CALIBRATE - 1:  # the warm-up's rates do not use the total
                plan["steps"] = steps_for(args.seconds, times["step"], device, args.steps)
                log(f"{plan['steps']} steps fill {args.seconds:g} s", flush=True)
            if (step + 1) % args.log_every == 0:
                log(f"step {step + 1}: loss {loss.item():.4f}, grad norm {norms[-1]:.3f} "
                    f"(max {args.clip:g}), lr {lrs[-1]:.4g}", flush=True)  # fmt: skip
            step += 1
        end = time.time()
        weights = state_digest(dict(model.module.named_parameters()))
        sizes = {"batch_size": args.batch_size, "world_size": world, "device": str(device),
                 "buffers": len(list(model.module.buffers())),  # BatchNorm's: synced in forward
                 "forward_sync_buffers": bool(model.forward_sync_buffers)}  # fmt: skip
        write_rank_record(args.out, {"eval": args.eval, "schedule": args.schedule, "start": start,
                                     "end": end, **times, "lr": lrs, "grad_norm": norms,
                                     "weights": weights, **sizes})  # fmt: skip


if __name__ == "__main__":
    main()
