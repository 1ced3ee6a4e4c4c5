"""Lesson 04's first exercise: gradient accumulation under DDP, with micro-batches of unequal sizes.

``04_accumulate_no_sync``: one optimizer step over k micro-batches of a DDP model, all but the
last under ``model.no_sync()``, the step equal to one process's on every sample of every rank.
The micro-batches differ in size, and so do the ranks' totals: the lesson's ``accumulate``
(each mean loss divided by k) then trains a mean of means; the learner combines it with the
lesson's "Tokens, not samples" rule (a sum over the samples, divided by the step's count over
every rank, times the world size). Checked against one process on the global batch; DDP's own
syncs are counted through its comm hook (DDP's, wrapped), the learner's collectives apart.
The lesson's BatchNorm exercise is in ``lesson04_buffers``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.core import (
    DIVIDED_BY_2,
    Context,
    Exercise,
    Record,
    ranks_written_as,
)
from ddp_tutorial.exercises.spies import is_async, spying

ACCUM_TEACHES = 'lesson 04, "`no_sync()`: gradient accumulation without wasted all_reduces"'
TOKENS_TEACHES = 'lesson 04, "Tokens, not samples: divide by the global count"'

STEPS, LR, FEATURES, CLASSES = 2, 0.5, 8, 3
# each rank's micro-batch sizes, per step (rank r of a larger world takes row r % 2): unequal
# inside a rank and between the ranks (10 and 14 samples, then 8 and 6); k = len(micro_batches)
# changes from one step to the next, so a number fitted to one call is wrong at the next
SIZES = (((4, 4, 2), (6, 3, 5)), ((5, 3), (2, 4)))
K = len(SIZES[0][0])
# wrong weightings of the samples, each named
RULES = ("mean of means", "each rank's own mean", "each rank's own count", "means over the count")
# every collective a learner may call for a count or a sum (the buffers exercise counts them too)
EVERY = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
         "reduce", "reduce_scatter", "reduce_scatter_tensor")  # fmt: skip


@contextmanager
def counted(names: tuple[str, ...], calls: list[str], module: ModuleType,
            asyncs: dict[str, int] | None = None, touched: list[str] | None = None,
            sizes: list[tuple[str, int]] | None = None,
            late_s: float = 0.0) -> Iterator[None]:  # fmt: skip
    """Append the name of each ``dist.<name>`` call made inside the block to ``calls`` (and
    with ``asyncs``: count the calls with async_op=True and the waits on what they returned;
    ``touched``: those whose tensor the learner changed before the wait; ``sizes``: each
    call's name and the number of elements of its tensor). ``late_s``: rank 1 starts each
    async call this late, so rank 0's result cannot be there before rank 0 reads it early."""

    def note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
        calls.append(name)
        # what this rank sends: all_gather*(out, in) and reduce_scatter*(out, in) name it second
        second = name.startswith(("all_gather", "reduce_scatter")) and len(args) > 1
        tensor = args[1] if second else args[0] if args else kwargs.get("tensor")
        if sizes is not None and isinstance(tensor, torch.Tensor):
            sizes.append((name, tensor.numel()))
        if asyncs is None or not is_async(args, kwargs):  # all_reduce's and broadcast's 4th
            return None
        if late_s and torch.distributed.get_rank() == 1:
            time.sleep(late_s)
        asyncs["sent"] += 1
        return lambda: asyncs.update(waited=asyncs["waited"] + 1)

    with spying(names, note, module, touched=touched):
        yield


def _mlp() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _sizes(step: int, rank: int) -> tuple[int, ...]:
    return SIZES[step][rank % 2]


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: every rank's micro-batches, in order."""
    gen = torch.Generator().manual_seed(40 + step)
    x = torch.randn(sum(sum(_sizes(step, r)) for r in range(world)), FEATURES, generator=gen)
    return x, torch.randint(0, CLASSES, (x.shape[0],), generator=gen)


def _micro_batches(x: torch.Tensor, y: torch.Tensor, step: int, rank: int) -> list[Any]:
    start, sizes = sum(sum(_sizes(step, r)) for r in range(rank)), list(_sizes(step, rank))
    rows = slice(start, start + sum(sizes))
    return list(zip(x[rows].split(sizes), y[rows].split(sizes), strict=True))


def _weights(step: int, world: int, rule: str) -> torch.Tensor:
    """Each sample's weight in the loss DDP ends up averaging, under a rule a learner may
    write: the lesson's mean per micro-batch / k, or each rank's mean of its own samples."""
    out, total = [], sum(sum(_sizes(step, r)) for r in range(world))
    for rank in range(world):
        sizes = _sizes(step, rank)
        for size in sizes:
            per = {
                "mean of means": 1 / (len(sizes) * size),
                "each rank's own mean": 1 / sum(sizes),
                "each rank's own count": world / sum(sizes),  # x world, the count not reduced
                "means over the count": world / (size * total),
            }[rule]
            out += [per / world] * size
    return torch.tensor(out)


def _first_step_under(rule: str, world: int) -> list[float]:
    """One process's first SGD step on the global batch, each sample weighted as ``rule``."""
    model, (x, y) = _mlp(), _global_batch(0, world)
    losses = F.cross_entropy(model(x), y, reduction="none")
    (losses * _weights(0, world, rule)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return _flat(model)


def _flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def run_accumulate(module: ModuleType, ctx: Context) -> Record:
    """STEPS steps of the learner's accumulation_step on a DDP model; the one-process reference."""
    model = DDP(_mlp())
    forwards: list[int] = []  # through the wrapper (model(x), not model.module(x))
    backwards: list[int] = []  # backward passes: the first layer's weight gets its gradient
    started: list[int] = []  # backward passes begun (the model's output got its gradient)
    synced: list[tuple[int, int]] = []  # DDP's syncs: (forwards, backwards begun) before each

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses other annotations
        synced.append((len(forwards), len(started)))
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _mlp()  # one process, the whole global batch, a plain SGD step
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    params, ref_params, passes, steps_per_call, own = (
        [_flat(model.module)],
        [_flat(reference)],
        [],
        [],
        [],
    )
    stepped: list[int] = []  # optimizer.step() calls in this accumulation_step
    unwaited: list[int] = []  # the learner's async collectives never waited on, per step
    optimizer.register_step_pre_hook(lambda *_: stepped.append(1))
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    model.module.register_full_backward_pre_hook(lambda *_: started.append(1))
    model.module[0].weight.register_post_accumulate_grad_hook(lambda _: backwards.append(1))
    names: set[str] = set()  # the collectives called in accumulation_step (DDP's too)
    for step in range(STEPS):
        x, y = _global_batch(step, ctx.world_size)
        micro = _micro_batches(x, y, step, ctx.rank)
        calls: list[str] = []
        asyncs = {"sent": 0, "waited": 0}
        with counted(EVERY, calls, module, asyncs):
            module.accumulation_step(model, optimizer, micro, F.cross_entropy)
        unwaited.append(asyncs["sent"] - asyncs["waited"] - len(synced))  # DDP's own are async
        passes.append({"forwards": len(forwards), "backwards": len(backwards), "k": len(micro),
                       "reduced_at": [f for f, _ in synced],
                       "in_backward": [b for _, b in synced]})  # fmt: skip
        own.append(len(calls) - len(synced))  # DDP's hook calls dist.all_reduce too
        names.update(calls)
        for seen in (forwards, backwards, started, synced):
            seen.clear()
        steps_per_call.append(len(stepped))
        stepped.clear()
        params.append(_flat(model.module))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_params.append(_flat(reference))
    rules = {rule: _first_step_under(rule, ctx.world_size) for rule in RULES}
    return {"params": params, "reference": ref_params, "passes": passes, "own_calls": own,
            "calls_per_step": [len(p["reduced_at"]) for p in passes],
            "steps_per_call": steps_per_call, "rules": rules, "unwaited": unwaited,
            "names": sorted(names)}  # fmt: skip


def _judge_passes(records: list[Record]) -> str | None:
    """The forwards, backwards and DDP's syncs of each accumulation step, on each rank."""
    for rank, rec in enumerate(records):
        for one in rec["passes"]:
            k = one["k"]
            if one["forwards"] < k:
                return (f"rank {rank} ran {one['forwards']} of its {k} forwards through the DDP "
                        "wrapper: model.module(x) bypasses DDP's forward, where DDP prepares the "
                        "backward's all_reduce, syncs buffers and marks unused parameters - a "
                        "backward after it sends nothing, as under no_sync(), but by accident "
                        "of that bookkeeping: call model(x), under model.no_sync() for all but "
                        "the last micro-batch "
                        '(lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
            if one["backwards"] == 1 and k > 1:
                return (f"rank {rank} ran one backward for its {k} micro-batches: every "
                        "micro-batch's graph was kept until then, which accumulation exists "
                        "to avoid - backward each micro-batch's loss after its "
                        "forward")  # fmt: skip
            if len(one["reduced_at"]) == 1 and one["reduced_at"] == [k] != one["in_backward"]:
                return (f"rank {rank}'s all_reduce ran in backward {one['in_backward'][0]} of "
                        f"{k}, though the last forward was outside no_sync(): DDP prepares the "
                        "sending in a forward for the next backward - run each micro-batch's "
                        "forward and backward together, then the next")  # fmt: skip
            if len(one["reduced_at"]) == 1 and one["reduced_at"] != [k]:
                return (f"rank {rank}'s all_reduce ran in the backward of micro-batch "
                        f"{one['reduced_at'][0]} of {k}, not the last: model.no_sync() around "
                        "every micro-batch but the last, so that the last one's all_reduce "
                        "carries the sum of them all")  # fmt: skip
    return None


def _weighting(
    step1: torch.Tensor, rules: dict[str, list[float]], start: torch.Tensor
) -> str | None:
    """A first update that one of the plausible weightings of the samples explains."""
    told = {
        rule
        for rule, params in rules.items()
        if torch.allclose(step1, torch.tensor(params) - start, rtol=1e-4, atol=1e-6)
    }
    sizes = " and ".join(str(list(_sizes(0, r))) for r in range(2))
    fix = ("sum the losses (reduction='sum'), divide by the step's sample count over every "
           "rank (one all_reduce of it, before the forwards), times the world size "
           f"({TOKENS_TEACHES})")  # fmt: skip
    if "mean of means" in told:
        return (f"each micro-batch's mean loss divided by k: with micro-batches of {sizes} "
                "samples that is a mean of means, in which a sample of a small micro-batch "
                "weighs more than one of a large one; one process weighs every sample once - "
                f"{fix}")  # fmt: skip
    if told & {"each rank's own mean", "each rank's own count"}:
        return ("each rank divided by its own sample count: right on one rank, but the ranks "
                f"hold {sum(_sizes(0, 0))} and {sum(_sizes(0, 1))} samples and DDP averages "
                f"their means, so a sample of the smaller rank weighs more - {fix}")  # fmt: skip
    if "means over the count" in told:
        return ("loss_fn(model(x), y) is already a mean over the micro-batch's samples: divided "
                "by the count over every rank it counts each sample 1/len(x) times - the SUM of "
                "the losses (reduction='sum') over the count, times the world size "
                f"({TOKENS_TEACHES})")  # fmt: skip
    return None


def _misscaled(step1: torch.Tensor, ref1: torch.Tensor, world: int) -> str | None:
    """What a first update that is a multiple of one process's says about the loss's scale."""
    if world > 1 and torch.allclose(step1 * world, ref1, rtol=1e-3, atol=1e-6):
        return (
            f"the first update is 1/{world} of one process's on the global batch: the sum over "
            f"the samples divided by their count over every rank is one process's loss, but "
            f"DDP's average divides by the {world} ranks again - multiply by the world size "
            f"({TOKENS_TEACHES})"
        )
    scale = float(step1 @ ref1 / (ref1 @ ref1))  # SGD's first update is linear in the loss
    if abs(scale - 1) < 1e-3 or not torch.allclose(step1, scale * ref1, rtol=1e-3, atol=1e-6):
        return None
    factor = f"1/{1 / scale:.3g} of" if scale < 1 else f"{scale:.3g} times"
    n = sum(sum(_sizes(0, r)) for r in range(world))  # the first step's samples, every rank's
    return (
        f"the first update is {factor} one process's on the global batch: the loss is scaled "
        f"wrong (with the lesson's loss, a count of {n / scale:.3g} where the step has {n} "
        "samples: each micro-batch's len(y), added up) - sum each micro-batch's losses "
        "(reduction='sum'), divide by the step's sample "
        "count over every rank, and multiply by the world size (DDP's average divides by it): "
        f"nothing else ({TOKENS_TEACHES})"
    )


def _own_collectives(records: list[Record]) -> str | None:
    """The learner's collectives for the count: waited on, and one per step."""
    if any(n > 0 for r in records for n in r["unwaited"]):
        return ("the count's all_reduce(..., async_op=True) was never waited on: it returns "
                "before the sum has arrived, so the losses were divided by whatever the count "
                "held then - call .wait() on what it returns before the forwards (or call it "
                f"without async_op) ({TOKENS_TEACHES})")  # fmt: skip
    names = {n for r in records for n in r.get("names", ())}
    if "reduce" in names and "broadcast" not in names:
        return ("dist.reduce leaves the summed count on its dst rank only: the other ranks "
                "divided their losses by their own count - dist.all_reduce the count, so that "
                f"every rank divides by the same total ({TOKENS_TEACHES})")  # fmt: skip
    own = max(c for r in records for c in r["own_calls"])
    if own > 1:
        return (f"{own} collectives of your own per step: the step's sample count needs one "
                "all_reduce of the count over ALL its micro-batches, before the forwards (one "
                "per micro-batch weighs each by its own count; a second all_reduce of the same "
                "count doubles it; a reduce then a broadcast sends it twice where one "
                f"all_reduce does) ({TOKENS_TEACHES})")  # fmt: skip
    return None


def judge_accumulate(records: list[Record]) -> str | None:
    T = torch.tensor
    first = records[0]
    start, ref = T(first["params"][0]), [T(p) for p in first["reference"]]
    if all(torch.equal(T(r["params"][-1]), start) for r in records):
        return ("the weights did not change: no backward ran, so optimizer.step() had no "
                "gradient - run forward and backward on every micro-batch")  # fmt: skip
    if mistake := _judge_passes(records):
        return mistake
    stepped = max(max(r["steps_per_call"]) for r in records)
    if stepped > 1:
        return (
            f"optimizer.step() ran {stepped} times in one accumulation_step of {K} or fewer "
            "micro-batches: step once, after the last micro-batch's backward - until then the "
            "gradients only add up (and inside no_sync() each rank's are its own)"
        )
    for rank, rec in enumerate(records):
        if 0 in rec["calls_per_step"]:
            return (
                f"rank {rank}'s step {rec['calls_per_step'].index(0)} made no all_reduce: every "
                "micro-batch ran under no_sync(), the last one too (its forward: DDP decides "
                "in the forward whether the backward after it sends), so the ranks never "
                "averaged their gradients and now hold different weights - run the last "
                "micro-batch, forward and backward, outside no_sync()"
            )
    for rank, rec in enumerate(records[1:], start=1):
        if not torch.equal(T(rec["params"][-1]), T(first["params"][-1])):
            return f"rank {rank}'s weights differ from rank 0's: were the gradients averaged?"
    if mistake := _own_collectives(records):
        return mistake
    step1, ref1 = T(first["params"][1]) - start, ref[1] - start
    if mistake := _weighting(step1, first["rules"], start) or _misscaled(step1, ref1, len(records)):
        return mistake
    first_right = torch.allclose(T(first["params"][1]), ref[1], rtol=1e-4, atol=1e-5)
    if first_right and not torch.allclose(T(first["params"][2]), ref[2], rtol=1e-4, atol=1e-5):
        return ("the first step was right, the second was not: the sample count is the step's "
                "own, counted (and all_reduced) at each call - a number that fits one call is "
                f"wrong for the next ({TOKENS_TEACHES})")  # fmt: skip
    if not torch.allclose(T(first["params"][-1]), ref[-1], rtol=1e-4, atol=1e-5):
        gap = (T(first["params"][-1]) - ref[-1]).abs().max().item()
        return (
            f"after {STEPS} steps the weights differ from one process trained on the global "
            f"batch (max |diff| {gap:.2e}): zero the gradients once, add up every micro-batch's "
            "gradients (its summed loss x world / the step's count over every rank), then one "
            "optimizer.step()"
        )
    calls = max(c for r in records for c in r["calls_per_step"])
    if calls > 1:
        return (
            f"{calls} all_reduces of the gradients per step for {K} micro-batches: the weights "
            f"are right, but {calls - 1} of them are wasted communication - run the forward and "
            "the backward of all but the last micro-batch inside `with model.no_sync():` (the "
            "forward too: DDP decides in forward whether the backward sends)"
        )
    return None


EXERCISES = [
    Exercise(
        name="04_accumulate_no_sync", lesson="04", run=run_accumulate, judge=judge_accumulate,
        title="gradient accumulation over micro-batches of unequal sizes: the large batch's step",
        teaches=ACCUM_TEACHES,
        errors=(("Expected parameter `tensor` of type torch.Tensor",
                 "dist.all_reduce takes a tensor, not a Python number: count = torch.tensor("
                 f"float(n)), then dist.all_reduce(count) ({TOKENS_TEACHES})"),
                ("can't be cast to the desired output type Long", "an integer count divided "
                 "in place (by ReduceOp.AVG, or a /=): an int64 tensor cannot hold the "
                 "quotient - count in a float tensor (torch.tensor(float(n))), added up with "
                 f"SUM ({TOKENS_TEACHES})")),
        hidden=(  # helper 174: right for this check's 2 ranks only
            # (helper 177: also 2 * loss, loss *= 2, world = 2)
            (DIVIDED_BY_2 + r"|(?<!\*)\*=?\s*2(?![\w.])|(?<![\w.*])2\s*\*(?![*=])|"
             + ranks_written_as(2), "the number of ranks is written as 2, "
             "this check's: DDP averages the gradients over the ranks, so the loss is "
             "multiplied by the world size - on 4 GPUs a 2 makes every step half the large "
             "batch's - use dist.get_world_size()"),
        ),
        proves=(
            "one gradient all_reduce and one optimizer step per accumulation step, the sample "
            "count counted once; the weights equal one process's on every sample of every rank, "
            "on every rank"
        ),
    ),
]  # fmt: skip
