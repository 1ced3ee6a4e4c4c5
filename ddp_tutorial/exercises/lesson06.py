"""Lesson 06's exercise: one accumulated, clipped, scheduled optimizer step, alike on every rank.

``06_clip_and_schedule``: the learner's ``train_step`` runs three steps of a small DDP model
whose inputs are large (so the gradient norm is well above the limit) with a GradScaler and a
warm-up schedule, each step over K micro-batches (lesson 04's no_sync, as the template's
--grad-accum: DDP's all_reduces are counted through its comm hook). Each rank also computes,
alone, what the step must give: plain SGD on the global batch (every rank's batch, which it
can rebuild from the seeds), clipped to the limit, at the schedule's rate. The judge compares
the norm, the learning rate and the weights, and reads the order of the calls the step made
(the scaler's, the optimizer's, the scheduler's): on a CPU in float32 the scaler changes no
number, so an answer without it would pass unseen.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_tutorial.exercises import noting
from ddp_tutorial.exercises.core import Context, Exercise, Record, divided_by
from ddp_tutorial.exercises.lesson04 import EVERY, counted
from ddp_tutorial.exercises.lesson11 import AMP_ERRORS
from ddp_tutorial.exercises.noting import NotingScaler, NotingSchedule, noted, without
from ddp_tutorial.exercises.spies import spying
from ddp_tutorial.exercises.step_calls import call_order

# the limit is not 1.0: the lesson's own line (max_norm=1.0) copied with the number in it
# would pass unseen with the argument ignored
STEPS, MAX_NORM, SCALE, LR, WARMUP = 3, 0.75, 2.0**16, 0.1, 4
K = 4  # micro-batches per step, of equal size (each loss / K: the rank's mean); not 2, the world


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:  # K micro-batches of 5
    g = torch.Generator().manual_seed(1000 * step + rank)
    return 10 * torch.randn(20, 8, generator=g), torch.randint(0, 3, (20,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def reference(world_size: int, clip: bool) -> list[dict[str, object]]:
    """Per step: the true norm, the rate after the step and the weights, on the global batch."""
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    steps = []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [nn.functional.cross_entropy(net(x), y)
                  for x, y in (batch(r, step) for r in range(world_size))]  # fmt: skip
        (sum(losses) / world_size).backward()  # what DDP's averaged gradients are
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM if clip else 1e30)
        optimizer.step()
        scheduler.step()
        steps.append({"norm": norm.item(), "lr": scheduler.get_last_lr()[0], "w": _flat(net)})
    return steps


def run_clip(module: ModuleType, ctx: Context) -> Record:
    # DDP's constructor imports torch._dynamo before its first collective: seconds on a busy
    # machine, not the same on every rank. Imported here, then the ranks meet in torchrun's
    # store (no collective timeout there), so that a slow import cannot pass for a hang.
    import torch._dynamo  # noqa: F401

    from ddp_tutorial.exercises.runner import meet  # not at the top: the runner imports us

    meet(ctx, "06-ready")  # in torchrun's store: no collective timeout there
    model = nn.parallel.DistributedDataParallel(_net())
    syncs: list[int] = []  # DDP's all_reduces in this step

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses other annotations
        syncs.append(calls.count("scaler.scale"))  # in micro-batch i's backward: i
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    start = _flat(model.module)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    calls: list[str] = []  # this step's calls, in order
    model.register_forward_pre_hook(noting.noted_forward(calls))  # each micro-batch's
    optimizer.register_step_pre_hook(lambda *_: calls.append("optimizer.step"))
    for owner in (optimizer, model):  # either zeroes the gradients
        owner.zero_grad = noted(owner.zero_grad, calls)  # type: ignore[method-assign]
    scheduler = NotingSchedule(optimizer, warmup)
    scheduler.calls = calls
    scaler = NotingScaler(calls, SCALE)
    want, unclipped = reference(ctx.world_size, True), reference(ctx.world_size, False)
    steps = []
    clips: list[tuple[float, float]] = []  # (max_norm, norm_type) of each clip_grad_norm_ call

    def clipped(_: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append("clip")
        limit = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
        clips.append((float(limit), float(kwargs.get("norm_type", args[2] if len(args) > 2
                                                      else 2.0))))  # fmt: skip

    for step in range(STEPS):
        x, y = batch(ctx.rank, step)
        micro = list(zip(x.chunk(K), y.chunk(K), strict=True))
        calls.clear()
        clips.clear()
        syncs.clear()
        collectives: list[str] = []  # the learner's and DDP's (its hook calls dist.all_reduce)
        with (spying(("clip_grad_norm_",), clipped, module, source=torch.nn.utils),
              counted(EVERY, collectives, module)):  # fmt: skip
            norm = module.train_step(model, optimizer, scheduler, scaler, micro, MAX_NORM)
        w = _flat(model.module)
        steps.append({
            "norm": float(norm), "want_norm": want[step]["norm"],
            "lr": optimizer.param_groups[0]["lr"], "want_lr": want[step]["lr"],  # h. 164
            "moved": not torch.equal(w, start),
            "gap": (w - want[step]["w"]).abs().max().item(),
            "gap_unclipped": (w - unclipped[step]["w"]).abs().max().item(),
            "weights": w.tolist(), "calls": list(calls), "clips": list(clips),
            "syncs": len(syncs), "sync_at": list(syncs),
            "own": without(collectives, ["all_reduce"] * len(syncs)),
        })  # fmt: skip
    return {"rank": ctx.rank, "steps": steps}


def _returned_norm(norm: float, true: float, world: int, own: bool = True) -> str | None:
    """train_step's norm against the true one: / world, x world, / k twice, some parameters."""
    said = f"train_step returned {norm:.4g}"
    if abs(norm * world - true) < 1e-4 * true:
        return (f"{said}, 1/{world} of the true gradient norm {true:.4g}: the loss was divided "
                "by the world size - DDP averages the gradients over the ranks already; divide "
                "each micro-batch's loss by k only "
                '(lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
    if world > 1 and abs(norm - world * true) < 1e-4 * true and not own:  # helper 164
        return (f"{said}, {world} times the true gradient norm {true:.4g}, with no collective "
                "of yours: the loss (clipping hid it in the weights) or the norm was multiplied "
                "by the world size - DDP averages over the ranks already: each micro-batch's "
                "loss / k, and return what clip_grad_norm_ returns "
                '(lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
    if world > 1 and abs(norm - world * true) < 1e-4 * true:
        return (f"{said}, {world} times the true gradient norm {true:.4g}: the norm was summed "
                "over the ranks - it is already the same on every rank (measured on the "
                "averaged gradients): return what clip_grad_norm_ returns, with no collective "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if true > MAX_NORM and abs(norm - MAX_NORM) < 1e-4 * MAX_NORM:  # helper 142
        return (f"{said}, max_norm itself: the norm was measured after clipping (the clipped "
                f"gradients' norm); the norm before it was {true:.4g} - return what "
                "clip_grad_norm_ returns "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if abs(norm * SCALE - true) < 1e-3 * true:  # helper 142: scaler.scale(loss) thrown away
        return (f"{said}, the true gradient norm {true:.4g} / {SCALE:g}, the scale: backward "
                "ran on the loss itself, not on scaler.scale(loss), and unscale_ then divided "
                "unscaled gradients by the scale - scaler.scale(loss).backward() "
                '(lesson 11, "1 · Mixed precision under DDP")')  # fmt: skip
    if abs(norm - true) > 1e-4 * true:  # 1/K: divided twice; less: some parameters
        why = ("the loss was divided by k twice - each micro-batch's loss / k, once"
               if abs(norm * K - true) < 1e-4 * true else "clip_grad_norm_ of every "
               "parameter, model.parameters(), after scaler.unscale_ - and return it"
               if norm < true else "return what clip_grad_norm_ returns")  # fmt: skip
        return (f"{said}; the gradient norm before clipping was {true:.4g}: {why} "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return None


def judge_clip(records: list[Record]) -> str | None:
    for step in range(STEPS):
        rows = [r["steps"][step] for r in records]
        if not rows[0]["moved"]:
            return _unmoved(rows[0]["calls"])
        if "autocast" in rows[0]["calls"]:  # the template's loop has it; this check does not
            return ("the forward ran under autocast: this check trains in float32 on the CPU "
                    "and compares the numbers with float32's - leave autocast out here (the "
                    "template's loop keeps it, lesson 11 times it)")  # fmt: skip
        if mistake := _accumulated(rows, step) or _rates(records, rows, step):
            return mistake
        if mistake := call_order(rows[0]["calls"], step):
            return mistake
        if mistake := _clip_arguments(rows[0].get("clips", []), len(records), step):
            return mistake
        norm, true = rows[0]["norm"], rows[0]["want_norm"]
        if mistake := _scaled_norm(norm, true, rows[0]["clips"], rows[0]["calls"]):
            return mistake
        norms = [row["norm"] for row in rows]
        if max(norms) - min(norms) > 1e-5 * max(norms):
            return (
                f"the ranks measured different gradient norms at step {step + 1} ({norms}): "
                "clip after backward(), on every rank - the averaged gradients are the same "
                "everywhere, so every rank clips alike, with no communication "
                '(lesson 06, "Three things every real loop needs")'
            )
        if len({tuple(row["weights"]) for row in rows}) > 1:
            return (f"the ranks' weights differ after step {step + 1}: every rank must take the "
                    "same step (clip, step and schedule on every rank) "
                    '(lesson 06, "Rank 0 alone: fine, slow, or wrong")')  # fmt: skip
        own = any(row.get("own") for row in rows)
        if mistake := _returned_norm(norm, true, len(records), own):
            return mistake
        if rows[0]["gap"] > 1e-5:
            if rows[0]["gap_unclipped"] < 1e-5:
                return (f"the gradients (norm {true:.3g}) were not clipped to {MAX_NORM}: "
                        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before "
                        "the step "
                        '(lesson 06, "Three things every real loop needs")')  # fmt: skip
            by_norm = "" if rows[0]["clips"] else (": clip_grad_norm_, the norm of all the "
                "gradients together (clip_grad_value_ clips each element alone)")  # fmt: skip
            return (f"after step {step + 1} the weights differ from one clipped SGD step on the "
                    f"global batch (by {rows[0]['gap']:.2g}){by_norm}")  # fmt: skip
        if own := max((row.get("own", []) for row in rows), key=len):
            return (f"the numbers are right, but step {step + 1} made {len(own)} collective(s) "
                    f"of your own ({', '.join(own)}): clipping needs none - after DDP's "
                    "all_reduce every rank holds the same gradients, so clip_grad_norm_ "
                    "measures the same norm on every rank, and each collective makes every "
                    "rank wait for the slowest, every step "
                    '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return None


def _unmoved(calls: list[str]) -> str:
    """The weights did not change: the gradients zeroed between the last backward and the
    step (helper 117: the verdict listed the calls the learner had made), or a call missing."""
    last = max((i for i, c in enumerate(calls) if c == "scaler.scale"), default=-1)
    stepped = calls.index("scaler.step") if "scaler.step" in calls else -1
    if stepped > last >= 0 and "zero_grad" in calls[last:stepped]:
        return ("the weights did not change: the gradients were zeroed after the last "
                "backward and before scaler.step, so the step had nothing to apply - zero "
                "them once, at the start of the step (or after it) "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return ("the weights did not change: backward through the scaler, then "
            "scaler.step(optimizer) and scaler.update() "
            '(lesson 06, "Three things every real loop needs")')  # fmt: skip


def _backwards(rows: list[Record], step: int) -> str | None:
    """A backward through the scaler for each of the K micro-batches."""
    stepped = rows[0]["calls"].count("scaler.step")
    scaled = rows[0]["calls"].count("scaler.scale")
    norm, true = rows[0]["norm"], rows[0]["want_norm"]
    summed = abs(norm - true) <= 1e-4 * true  # the true norm: one backward of the losses added
    if 0 < scaled < K == rows[0]["calls"].count("forward") and stepped == 1 and not summed:
        return (f"step {step + 1} ran {K} micro-batches but only {scaled} backward(s) through "
                "scaler.scale(loss): the others' backward ran on the loss itself, and "
                f"unscale_ then divides their share of the gradients by the scale ({SCALE:g}) "
                "- scaler.scale(loss).backward() for every micro-batch "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if scaled < K and stepped == 1:
        return (f"step {step + 1} ran {rows[0]['calls'].count('scaler.scale')} backward(s) for "
                f"its {K} micro-batches: put together, they are one batch of all of them, the "
                "memory --grad-accum exists to avoid - a forward and a backward per micro-batch, "
                'the gradients adding up (lesson 04, "`no_sync()`: gradient accumulation '
                'without wasted all_reduces")')  # fmt: skip
    return None


def _accumulated(rows: list[Record], step: int) -> str | None:
    """One all_reduce and one optimizer step for the K micro-batches, each loss / K."""
    if mistake := _backwards(rows, step):
        return mistake
    syncs, stepped = rows[0]["syncs"], rows[0]["calls"].count("scaler.step")
    norm, true = rows[0]["norm"], rows[0]["want_norm"]
    if syncs == 0 and (own := rows[0].get("own", [])):
        return (f"step {step + 1}: every micro-batch ran under no_sync(), and {len(own)} "
                f"collective(s) of your own ({own[0]}, ...) averaged the gradients instead: "
                "one call per tensor where DDP sends a few buckets, overlapped with the last "
                "backward - run the last micro-batch outside no_sync(), and DDP does it "
                '(lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    if syncs == 0:
        return (f"step {step + 1} made no all_reduce: every micro-batch ran under no_sync(), "
                "the last one too, so the ranks never averaged their gradients - run the last "
                'one outside it (lesson 04, "`no_sync()`: gradient accumulation without '
                'wasted all_reduces")')  # fmt: skip
    if stepped > 1:
        return (f"scaler.step ran {stepped} times in step {step + 1} of {K} micro-batches: "
                "step once, after the last micro-batch's backward - until then the gradients "
                'only add up (lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    if stepped == 1 and (opt := rows[0]["calls"].count("optimizer.step")) > 1:
        return (f"the optimizer stepped {opt} times in step {step + 1}: scaler.step(optimizer) "
                "calls optimizer.step() itself (unless a gradient is inf or nan) - no "
                "optimizer.step() beside it")  # fmt: skip
    if syncs > 1:
        return (f"{syncs} all_reduces in step {step + 1} for {K} micro-batches: the weights may "
                "be right, but all but one are wasted communication - the forward and backward "
                "of all but the last inside `with model.no_sync():`, the forward too: DDP "
                "decides in the forward whether the backward after it sends (lesson 04, "
                "\"`no_sync()`: "
                'gradient accumulation without wasted all_reduces")')  # fmt: skip
    scaled = rows[0]["calls"].count("scaler.scale") == K  # then sync_at counts micro-batches
    if scaled and (at := rows[0]["sync_at"][0]) != K:
        return (f"step {step + 1}'s all_reduce ran in micro-batch {at}'s backward, not the "
                f"last's ({K}): DDP averaged what was accumulated by then, and the later "
                "micro-batches added their gradients on each rank alone - all but the last "
                "inside no_sync() (`nullcontext() if i == k - 1 else model.no_sync()`) "
                '(lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    if abs(norm - K * true) < 1e-4 * K * true:
        return (f"train_step returned {norm:.4g}, {K} times the true norm {true:.4g}: the {K} "
                "micro-batches' gradients add up, so divide each micro-batch's loss by k "
                '(lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    size = len(batch(0, 0)[1]) // K  # samples per micro-batch: not K (5, not 4)
    if abs(norm - K / size * true) < 1e-4 * true:
        return (f"train_step returned {norm:.4g}, {K}/{size} of the true norm {true:.4g}: each "
                f"micro-batch's loss was divided by its size ({size} samples: cross_entropy's "
                f"mean has done that already), not by k = {K}, the number of micro-batches "
                '(lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    return None


def _scaled_norm(norm: float, true: float, clips: list[list[float]],
                 calls: list[str]) -> str | None:  # fmt: skip
    """A norm of the scaled gradients: measured by a clip before unscale_, or returned so."""
    scaled_limit = any(abs(c[0] - MAX_NORM * SCALE) <= 1e-9 * c[0] for c in clips)
    unscaled_first = "clip" in calls and "scaler.unscale_" in calls[: calls.index("clip")]
    if norm > 100 * true and unscaled_first and not scaled_limit:
        return (f"train_step returned {norm:.4g}, the norm of the scaled gradients "
                f"({norm / true:.0f} times the true {true:.4g}), though it clipped after "
                "scaler.unscale_: the norm "
                "it returned was measured before unscale_ - return what clip_grad_norm_ returns "
                "(lesson 06, \"Three things every real loop needs\")")  # fmt: skip
    if norm > 100 * true and scaled_limit:
        return (
            f"train_step returned {norm:.4g}, the norm of the scaled gradients "
            f"({norm / true:.0f} times the true {true:.4g}): clipping them at max_norm x "
            "scale clips the same, but the norm to log is the true one - divide by "
            "scaler.get_scale(), or scaler.unscale_(optimizer) first and clip at max_norm "
            '(lesson 06, "Three things every real loop needs")'
        )
    if norm > 100 * true:
        return (
            f"clip_grad_norm_ measured {norm:.4g}, {norm / true:.0f} times the true norm "
            f"{true:.4g}: it saw the scaled gradients - call scaler.unscale_(optimizer) "
            "before clipping, or the limit and the step are off by the scale (lesson 06, "
            '"Three things every real loop needs")'
        )
    unscaled = [i for i, c in enumerate(calls) if c == "scaler.unscale_"]
    if "clip" in calls and unscaled and calls.index("clip") < unscaled[0] and not scaled_limit:
        return ("clip_grad_norm_ ran before scaler.unscale_(optimizer): it measured and "  # h. 164
                "clipped the scaled gradients, at a limit off by the scale (a norm divided by "
                "the scale afterwards does not undo the clip) - unscale_ first, then clip "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return None


def _clip_arguments(clips: list[list[float]], world: int, step: int) -> str | None:
    """The limit and the norm the learner clipped with, against ``max_norm`` and the L2 norm."""
    if len(clips) > 1:
        return (f"in step {step + 1} clip_grad_norm_ ran {len(clips)} times: the limit is on "
                "the norm of all the gradients together - one call, on model.parameters(), "
                "not one per tensor "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    for limit, norm_type in clips:
        if norm_type != 2.0:
            return (f"in step {step + 1} clip_grad_norm_ measured the norm_type={norm_type:g} "
                    "norm: the limit is on the L2 norm of all the gradients together "
                    "(norm_type=2, the default) "
                    '(lesson 06, "Three things every real loop needs")')  # fmt: skip
        if abs(limit * world - MAX_NORM) < 1e-9 and world > 1:
            return (f"in step {step + 1} clip_grad_norm_ was given max_norm / {world}: after "
                    "backward every rank holds the same averaged gradients, not a share of "
                    "them - clip with max_norm itself, on every rank "
                    '(lesson 06, "Three things every real loop needs")')  # fmt: skip
        if abs(limit - MAX_NORM * SCALE) <= 1e-9 * limit:
            continue  # the scaled gradients clipped at max_norm x scale: the same clip
        if limit != MAX_NORM and limit != float("inf"):  # inf: named below, "not clipped"
            return (f"in step {step + 1} clip_grad_norm_ was given max_norm={limit:g}, not "
                    f"train_step's max_norm argument ({MAX_NORM:g}): pass it on "
                    '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return None


def _rates(records: list[Record], rows: list[Record], step: int) -> str | None:
    """The learning rate after the step, on each rank, against the schedule's."""
    want_lr = rows[0]["want_lr"]
    stuck = [r["rank"] for r, row in zip(records, rows, strict=True)
             if abs(row["lr"] - want_lr) > 1e-9 * want_lr]  # fmt: skip
    if stuck and len(stuck) < len(records):
        rank, row = stuck[0], rows[stuck[0]]
        right = [r["rank"] for r in records if r["rank"] not in stuck]
        whose = f"rank {right[0]}'s" if len(right) == 1 else "the other ranks'"
        return (
            f"after step {step + 1} rank {rank}'s learning rate was {row['lr']:.4g}, "
            f"{whose} {want_lr:.4g}: call scheduler.step() on every rank, once per "
            "optimizer step (stepped on rank 0 alone, the replicas drift apart, silently) "
            '(lesson 06, "Rank 0 alone: fine, slow, or wrong")'
        )
    if stuck:
        return (
            f"after step {step + 1} the optimizer's learning rate was {rows[0]['lr']:.4g}, not "
            f"{want_lr:.4g}: call scheduler.step() once after each optimizer step, and set "
            "param_groups' lr nowhere else (the schedule holds the peak, scaled once) "
            '(lesson 06, "Three things every real loop needs")'
        )
    return None


EXERCISES = [
    Exercise(
        name="06_clip_and_schedule", lesson="06", run=run_clip, judge=judge_clip,
        hidden=((divided_by(K), "the loss is divided by 4, this check's "
                 "number of micro-batches: with another accumulation count the gradient is "
                 "scaled wrong - divide by k = len(micro_batches)"),),
        title="an accumulated, clipped, scheduled step under a GradScaler, alike on every rank",
        teaches='lesson 06, "Three things every real loop needs" and "Rank 0 alone: fine, slow, '
        'or wrong"', errors=AMP_ERRORS,
        proves=(
            "at every step one all_reduce for the micro-batches, the scheduled learning rate, "
            "unscale before clipping, the true gradient norm returned, the same weights on "
            "every rank, equal to one clipped SGD step on the global batch"
        ),
    ),
]  # fmt: skip
