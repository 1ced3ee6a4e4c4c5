"""Lesson 04's exercises: gradient accumulation under DDP, and BatchNorm buffers before evaluating.

``04_accumulate_no_sync``: one optimizer step over k micro-batches of a DDP model, all but the
last under ``model.no_sync()``, each loss divided by k. Checked against one process trained on
the global batch, and by counting the all_reduces each step makes (DDP's reduction goes through
``dist.all_reduce`` here: a comm hook that is DDP's own, so the count sees every sync).
``04_average_buffers``: every rank's BatchNorm buffers made the same before evaluating, in one
collective. Each rank's model has run its own batches, so its running statistics differ; after
the learner's function every rank must hold their mean over the ranks, and it must have made
one collective (the lesson shows one per buffer: the exercise is the flat version).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.spies import is_async, spying

ACCUM_TEACHES = 'lesson 04, "`no_sync()`: gradient accumulation without wasted all_reduces"'
BUFFERS_TEACHES = 'lesson 04, "BatchNorm where SyncBatchNorm cannot run"'

K, MICRO, STEPS, LR, FEATURES, CLASSES = 3, 4, 2, 0.5, 8, 3
KS = (K, 2)  # micro-batches per step: k is len(micro_batches), not a number fitted to one call


@contextmanager
def counted(names: tuple[str, ...], calls: list[str], module: ModuleType,
            asyncs: dict[str, int] | None = None,
            touched: list[str] | None = None) -> Iterator[None]:  # fmt: skip
    """Append the name of each ``dist.<name>`` call made inside the block to ``calls`` (and
    with ``asyncs``: count the calls with async_op=True and the waits on what they returned;
    ``touched``: those whose tensor the learner changed before the wait)."""

    def note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
        calls.append(name)
        if asyncs is None or not is_async(args, kwargs):  # all_reduce's and broadcast's 4th
            return None
        asyncs["sent"] += 1
        return lambda: asyncs.update(waited=asyncs["waited"] + 1)

    with spying(names, note, module, touched=touched):
        yield


def _mlp() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: world x KS[step] micro-batches of MICRO
    rows."""
    gen = torch.Generator().manual_seed(40 + step)
    x = torch.randn(world * KS[step] * MICRO, FEATURES, generator=gen)
    return x, torch.randint(0, CLASSES, (x.shape[0],), generator=gen)


def _flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def run_accumulate(module: ModuleType, ctx: Context) -> Record:
    """STEPS steps of the learner's accumulation_step on a DDP model; the one-process reference."""
    model = DDP(_mlp())
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own, via dist.all_reduce
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _mlp()  # one process, the whole global batch, a plain SGD step
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    params, ref_params, calls_per_step = [_flat(model.module)], [_flat(reference)], []
    stepped: list[int] = []  # optimizer.step() calls in this accumulation_step
    optimizer.register_step_pre_hook(lambda *_: stepped.append(1))
    steps_per_call, passes = [], []
    forwards: list[int] = []  # through the wrapper (model(x), not model.module(x))
    backwards: list[int] = []  # backward passes: the first layer's weight gets its gradient
    reduced_at: list[int] = []  # for each all_reduce: the forwards run before it
    started: list[int] = []  # backward passes begun (the model's output got its gradient)
    in_backward: list[int] = []  # for each all_reduce: which backward it ran in (1, 2, ...)
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    model.module.register_full_backward_pre_hook(lambda *_: started.append(1))
    model.module[0].weight.register_post_accumulate_grad_hook(lambda _: backwards.append(1))
    for step in range(STEPS):
        x, y = _global_batch(step, ctx.world_size)
        k = KS[step]
        rows = slice(ctx.rank * k * MICRO, (ctx.rank + 1) * k * MICRO)  # this rank's shard
        micro = list(zip(x[rows].split(MICRO), y[rows].split(MICRO), strict=True))
        calls: list[str] = []
        at = spying(
            ("all_reduce",),
            lambda *_: (reduced_at.append(len(forwards)), in_backward.append(len(started)))[-1],
            module,
        )
        with counted(("all_reduce",), calls, module), at:
            module.accumulation_step(model, optimizer, micro, F.cross_entropy)
        passes.append({"forwards": len(forwards), "backwards": len(backwards), "k": k,
                       "reduced_at": list(reduced_at),
                       "in_backward": list(in_backward)})  # fmt: skip
        forwards.clear(), backwards.clear(), reduced_at.clear(), started.clear()
        in_backward.clear()
        calls_per_step.append(len(calls))
        steps_per_call.append(len(stepped))
        stepped.clear()
        params.append(_flat(model.module))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_params.append(_flat(reference))
    return {"params": params, "reference": ref_params, "calls_per_step": calls_per_step,
            "steps_per_call": steps_per_call, "passes": passes}  # fmt: skip


def _judge_passes(records: list[Record]) -> str | None:
    """The forwards, backwards and all_reduces of each accumulation step, on each rank."""
    for rank, rec in enumerate(records):
        for one in rec["passes"]:
            k = one["k"]
            if one["forwards"] < k:
                return (f"rank {rank} ran {one['forwards']} of its {k} forwards through the DDP "
                        "wrapper: model.module(x) bypasses DDP, which decides in its forward "
                        "whether this backward sends - call model(x) "
                        '(lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
            if one["backwards"] == 1 and k > 1:
                return (f"rank {rank} ran one backward for its {k} micro-batches: every "
                        "micro-batch's graph was kept until then, which accumulation exists "
                        "to avoid - backward each micro-batch's loss / k after its "
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


def _misscaled(step1: torch.Tensor, ref1: torch.Tensor, world: int) -> str | None:
    """What a first update that is a multiple of one process's says about the loss's scale."""
    if torch.allclose(step1, K * ref1, rtol=1e-3, atol=1e-6):
        return (
            f"the first update is {K} times one process's on the global batch: the {K} "
            f"micro-batches' gradients add up, so divide each micro-batch's loss by k = {K}"
        )
    if world > 1 and torch.allclose(step1 * world, ref1, rtol=1e-3, atol=1e-6):
        return (
            f"the first update is 1/{world} of one process's on the global batch: each loss was "
            f"divided by the {world} ranks as well, but DDP already averages the gradients over "
            f"the ranks - divide each micro-batch's loss by k = {K} only"
        )
    scale = float(step1 @ ref1 / (ref1 @ ref1))  # SGD's first update is linear in the loss
    if abs(scale - 1) < 1e-3 or not torch.allclose(step1, scale * ref1, rtol=1e-3, atol=1e-6):
        return None
    factor = f"1/{1 / scale:.3g} of" if scale < 1 else f"{scale:.3g} times"
    return (
        f"the first update is {factor} one process's on the global batch: the loss is scaled "
        "wrong - loss_fn is already a mean over the micro-batch's samples (do not divide by "
        f"len(x)) and DDP already averages over the ranks: divide each micro-batch's loss by "
        f"k = {K}, and by nothing else"
    )


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
                "micro-batch ran under no_sync(), the last one too, so the ranks never averaged "
                "their gradients and now hold different weights - run the last micro-batch "
                "outside no_sync()"
            )
    for rank, rec in enumerate(records[1:], start=1):
        if not torch.equal(T(rec["params"][-1]), T(first["params"][-1])):
            return f"rank {rank}'s weights differ from rank 0's: were the gradients averaged?"
    step1, ref1 = T(first["params"][1]) - start, ref[1] - start
    misscaled = _misscaled(step1, ref1, len(records))
    if misscaled:
        return misscaled
    gap = (T(first["params"][-1]) - ref[-1]).abs().max().item()
    first_right = torch.allclose(T(first["params"][1]), ref[1], rtol=1e-4, atol=1e-5)
    step2, ref2 = T(first["params"][2]) - T(first["params"][1]), ref[2] - ref[1]
    if first_right and torch.allclose(step2, KS[1] / K * ref2, rtol=1e-3, atol=1e-6):
        return (f"the first step ({KS[0]} micro-batches) was right, the second ({KS[1]}) was "
                "not: k is len(micro_batches), counted at each call - a number that fits one "
                "call is wrong for the next")  # fmt: skip
    if not torch.allclose(T(first["params"][-1]), ref[-1], rtol=1e-4, atol=1e-5):
        return (
            f"after {STEPS} steps the weights differ from one process trained on the global "
            f"batch (max |diff| {gap:.2e}): zero the gradients once, add up the {K} "
            "micro-batches' gradients (each loss / k), then one optimizer.step()"
        )
    calls = max(c for r in records for c in r["calls_per_step"])
    if calls > 1:
        return (
            f"{calls} all_reduces per step for {K} micro-batches: the weights are right, but "
            f"{calls - 1} of them are wasted communication - run the forward and the backward "
            "of all but the last micro-batch inside `with model.no_sync():` (the forward too: "
            "DDP decides in forward whether the backward sends)"
        )
    return None


# -- 04_average_buffers ------------------------------------------------------------------------

BN_ROWS, BN_BATCHES = 8, 3


def bn_net() -> nn.Module:
    """Two BatchNorm layers (1-D and 2-D): every one of them must be made the same."""
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, CLASSES),
    )  # fmt: skip


def _rank_images(rank: int, batch: int) -> torch.Tensor:
    """Rank r's images: brighter and wider-spread the higher the rank (its own statistics)."""
    gen = torch.Generator().manual_seed(100 * rank + batch)
    return torch.randn(BN_ROWS, 1, 6, 6, generator=gen) * (1 + rank) + 2.0 * rank


def _buffers(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {name: {"dtype": str(b.dtype), "values": b.detach().reshape(-1).tolist()}
            for name, b in model.named_buffers()}  # fmt: skip


def run_buffers(module: ModuleType, ctx: Context) -> Record:
    """Each rank trains BatchNorm on its own images, then calls the learner's function."""
    model = bn_net()
    for batch in range(BN_BATCHES):  # train mode: the running statistics follow this rank's data
        model(_rank_images(ctx.rank, batch))
    before = _buffers(model)
    params = copy.deepcopy(list(model.parameters()))
    calls: list[str] = []
    asyncs, touched = {"sent": 0, "waited": 0}, []
    with counted(("all_reduce", "broadcast"), calls, module, asyncs, touched):
        module.average_buffers(model)
    model.eval()
    with torch.no_grad():
        probe = model(torch.linspace(-1, 3, 2 * 36).reshape(2, 1, 6, 6))
    same_params = all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    return {"before": before, "after": _buffers(model), "probe": probe.tolist(),
            "calls": calls, "params_unchanged": same_params,
            "unwaited": asyncs["sent"] - asyncs["waited"], "touched": touched}  # fmt: skip


def _only_rank_0_divided(records: list[Record], differ: list[str]) -> bool:
    """Whether rank 0's buffers are the mean over the ranks and every other rank's the sum."""
    for name in differ:
        total = torch.stack([torch.tensor(r["before"][name]["values"]) for r in records]).sum(0)
        for rank, r in enumerate(records):
            after = torch.tensor(r["after"][name]["values"])
            mean = torch.allclose(after, total / len(records), rtol=1e-5, atol=1e-6)
            if mean != (rank == 0):
                return False
    return True


def _raced(records: list[Record]) -> str | None:
    """An async all_reduce never waited on, or its buffer changed before the wait."""
    raced = next((r["touched"][0] for r in records if r.get("touched")), None)
    if raced:
        return (f"a buffer was changed (divided?) after its {raced}(..., async_op=True) and "
                "before the .wait() on what it returned: the reduction reads and writes that "
                "buffer in the background, so the result depends on which came first - wait on "
                "every Work, then divide")  # fmt: skip
    if any(r["unwaited"] for r in records):
        return ("an all_reduce(..., async_op=True) was never waited on: it returns before the "
                "sum has arrived - call .wait() on what it returns before dividing (or call it "
                "without async_op)")  # fmt: skip
    return None


def _judge_means(records: list[Record], stats: list[str]) -> str | None:
    """Each statistic, the same on every rank: the mean over the ranks, or which wrong one."""
    T, n = torch.tensor, len(records)
    for name in stats:
        before = torch.stack([T(r["before"][name]["values"]) for r in records])
        after = T(records[0]["after"][name]["values"])
        if torch.allclose(after, before.mean(0), rtol=1e-5, atol=1e-6):
            continue
        if torch.allclose(after, before[0], rtol=1e-6, atol=1e-7):
            return (f"{name} is rank 0's on every rank (a broadcast): the same everywhere, but "
                    "computed from rank 0's batches alone - average over the ranks (all_reduce, "
                    "then divide by the world size), which all ranks' data go into")  # fmt: skip
        if torch.allclose(after, before.sum(0), rtol=1e-5, atol=1e-6):
            return (f"{name} is the sum over the {n} ranks: all_reduce adds, so divide by the "
                    "world size for the mean, in place (buffer /= world): `buffer = buffer / "
                    "world` makes a new tensor, which the model never sees")  # fmt: skip
        if torch.allclose(after, before.mean(0) / n, rtol=1e-5, atol=1e-6):
            return (f"{name} is the mean over the ranks divided by {n} again: averaged twice - "
                    "ReduceOp.AVG divides already; with it, no `buffer /= world` (or SUM, then "
                    "divide once)")  # fmt: skip
        pooled = " (not a pooled variance: each statistic as it is)" if "var" in name else ""
        return (f"{name} is the same on every rank but neither the mean over the ranks nor "
                f"rank 0's: the plain mean of each buffer{pooled} - all_reduce (SUM), wait if "
                "async, then divide by the world size")  # fmt: skip
    return None


def judge_buffers(records: list[Record]) -> str | None:
    T = torch.tensor
    names = list(records[0]["before"])
    stats = [k for k in names if not k.endswith("num_batches_tracked")]
    if all(r["after"] == r["before"] for r in records):
        if any(r["calls"] for r in records):
            return ("the statistics were reduced, but the model's buffers never changed: "
                    "torch.cat (like .clone() or .flatten()) makes a new tensor - copy each "
                    "piece of the reduced one back into its buffer, in place "
                    "(buffer.copy_(piece.view_as(buffer)))")  # fmt: skip
        return ("the buffers were not touched: each rank still holds the running statistics of "
                "its own batches, so the ranks would evaluate different models")  # fmt: skip
    for name in names:
        if name.endswith("num_batches_tracked"):
            dtypes = {r["after"][name]["dtype"] for r in records}
            if dtypes != {"torch.int64"}:
                return (
                    f"{name} became {sorted(dtypes)[0]}: it is an integer counter (int64), the "
                    "same on every rank - average only the floating-point buffers "
                    "(running_mean, running_var) and leave the counter alone"
                )
            if any(r["after"][name] != r["before"][name] for r in records):
                return (f"{name} changed ({records[0]['before'][name]['values']} -> "
                        f"{records[0]['after'][name]['values']}): it counts the batches each "
                        "rank saw, the same on every rank - leave it alone")  # fmt: skip
    differ = [k for k in stats if any(r["after"][k] != records[0]["after"][k] for r in records)]
    if race := _raced(records):  # the numbers then depend on who won: a pass would be luck
        return race
    if differ:
        if _only_rank_0_divided(records, differ):
            return ("rank 0 holds the mean over the ranks, the others the sum: every rank "
                    "divides by the world size after the all_reduce, not only rank 0")  # fmt: skip
        kinds = sorted({k.rsplit(".", 1)[-1] for k in differ})
        layers = sorted({k.rsplit(".", 1)[0] for k in differ})
        return (
            f"{' and '.join(kinds)} still differ{'s' if len(kinds) == 1 else ''} between the "
            f"ranks (layer(s) {', '.join(layers)}): "
            "every BatchNorm statistic of every layer must be made the same - running_mean "
            "and running_var (loop over model.buffers() or named_buffers())"
        )
    mistake = _judge_means(records, stats)
    if mistake:
        return mistake
    if not all(r["params_unchanged"] for r in records):
        return ("the parameters changed: only the buffers should - DDP keeps the parameters "
                "equal already")  # fmt: skip
    probes = [T(r["probe"]) for r in records]
    if not all(torch.equal(p, probes[0]) for p in probes):
        return "the ranks' models still give different outputs in eval mode"
    calls = max(len(r["calls"]) for r in records)
    if calls > 1:
        return (f"{calls} collectives on each rank for {len(stats)} statistics: the values are "
                "right, but every collective pays a fixed cost before each evaluation (a "
                "ResNet-50 has 106 such buffers; lesson 07 measures the cost) - one tensor of "
                "every statistic (torch.cat of each .reshape(-1)), one all_reduce, then each "
                "piece copied back into its buffer")  # fmt: skip
    return None


_INT_DIVIDE = (
    "num_batches_tracked is an integer counter (int64): dividing it in place raises - average "
    "only the floating-point buffers (running_mean, running_var; `buffer.is_floating_point()`) "
    "and leave the counter, which is the same on every rank, alone"
)

EXERCISES = [
    Exercise(
        name="04_accumulate_no_sync", lesson="04", run=run_accumulate, judge=judge_accumulate,
        title="gradient accumulation: k micro-batches, one all_reduce, the large batch's step",
        teaches=ACCUM_TEACHES,
        proves=(
            "one all_reduce and one optimizer step per accumulation step; the weights equal one "
            "process's on the global batch, on every rank"
        ),
    ),
    Exercise(
        name="04_average_buffers", lesson="04", run=run_buffers, judge=judge_buffers,
        title="BatchNorm buffers made the same on every rank before evaluating, in one collective",
        teaches=BUFFERS_TEACHES, collective_timeout_s=5.0,
        errors=(("can't be cast to the desired output type Long", _INT_DIVIDE),
                ("a leaf Variable that requires grad", "an in-place change of a parameter: "
                 "those are model.parameters(), which DDP keeps equal; the statistics are "
                 "buffers - loop over model.buffers()")),
        proves=(
            "every BatchNorm running_mean and running_var is the mean over the ranks on every "
            "rank, in one collective; num_batches_tracked and the parameters untouched; the "
            "ranks' models agree in eval mode"
        ),
    ),
]  # fmt: skip
