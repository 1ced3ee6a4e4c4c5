"""Lesson 04's second exercise: BatchNorm buffers made the same on every rank before evaluating,
in one collective.

``04_average_buffers``: each rank's model has run its own batches, so its running statistics
differ; after the learner's function every rank must hold their mean over the ranks, and it must
have made one collective (the lesson shows one per buffer: the exercise is the flat version).
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ddp_tutorial.exercises.core import DIVIDED_BY_2, Context, Exercise, Record
from ddp_tutorial.exercises.lesson04 import CLASSES, EVERY, counted

BUFFERS_TEACHES = 'lesson 04, "BatchNorm where SyncBatchNorm cannot run"'

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
    asyncs, touched, sizes = {"sent": 0, "waited": 0}, [], []
    with counted(EVERY, calls, module, asyncs, touched, sizes, late_s=0.2):
        module.average_buffers(model)
    model.eval()
    with torch.no_grad():
        probe = model(torch.linspace(-1, 3, 2 * 36).reshape(2, 1, 6, 6))
    same_params = all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    # the most numbers one kind of collective carried (a reduce, then a broadcast: once)
    sent = max((sum(n for kind, n in sizes if kind == name) for name, _ in sizes), default=0)
    return {"before": before, "after": _buffers(model), "probe": probe.tolist(),
            "calls": calls, "params_unchanged": same_params, "sent": sent,
            "unwaited": asyncs["sent"] - asyncs["waited"], "touched": touched,
            "asyncs": asyncs["sent"]}  # fmt: skip


RANK_0_ALONE = {  # what the other ranks hold when rank 0 alone holds the mean
    "sum": "rank 0 holds the mean over the ranks, the others the sum: every rank divides by "
    "the world size after the all_reduce, not only rank 0",
    "own": "rank 0 holds the mean over the ranks, but rank 1's statistics never changed: the "
    "copy back into the model's buffers (or all of it) ran under a rank branch - every rank "
    "writes the mean into its own buffers",
}


def _only_rank_0_averaged(records: list[Record], differ: list[str]) -> str | None:
    """ "sum" when rank 0's buffers are the mean over the ranks and every other rank's the sum,
    "own" when the others kept their own (a copy back under a rank branch); else None."""
    found = set()
    for name in differ:
        before = [torch.tensor(r["before"][name]["values"]) for r in records]
        total = torch.stack(before).sum(0)
        for rank, r in enumerate(records):
            after = torch.tensor(r["after"][name]["values"])
            if torch.allclose(after, total / len(records), rtol=1e-5, atol=1e-6) != (rank == 0):
                return None
            if rank:
                summed = torch.allclose(after, total, rtol=1e-5, atol=1e-6)
                found.add("sum" if summed else "own" if torch.equal(after, before[rank]) else "?")
    return found.pop() if len(found) == 1 and "?" not in found else None


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


def _misplaced(after: torch.Tensor, records: list[Record], stats: list[str]) -> str | None:
    """Where in the means of every statistic, laid end to end as a flat all_reduce holds them,
    ``after`` sits, when that is not its own place (a copy back whose offset never moved)."""
    T = torch.tensor
    means = [torch.stack([T(r["before"][k]["values"]) for r in records]).mean(0) for k in stats]
    flat, n = torch.cat(means), after.numel()
    if n > 1 and torch.all(after == after[0]):  # one element copied into every one of its
        hit = torch.isclose(flat, after[0], rtol=1e-5, atol=1e-6).nonzero()
        if len(hit):  # zip(stats, flat): each buffer paired with one element
            return (f"one element of the reduced tensor ({int(hit[0])}) in every place - "
                    "zip(stats, flat) pairs each buffer with a single element")  # fmt: skip
    for start in range(flat.numel() - n + 1):
        if torch.allclose(flat[start : start + n], after, rtol=1e-5, atol=1e-6):
            return f"the reduced tensor's elements {start} to {start + n - 1}"
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
        if hit := _misplaced(after, records, stats):
            return (f"{name} holds the mean of other statistics ({hit}): copying back, "
                    "each buffer takes its own piece of the reduced tensor - an offset that "
                    "advances by each buffer's numel(), or flat.split([b.numel() for b in "
                    "stats])")  # fmt: skip
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
                    "torch.cat (like .clone()) makes a new tensor - copy each "
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
        return _still_differ(records, differ)
    mistake = _judge_means(records, stats)
    if mistake:
        return mistake
    if not all(r["params_unchanged"] for r in records):
        return ("the parameters changed: only the buffers should - DDP keeps the parameters "
                "equal already")  # fmt: skip
    if mistake := _judge_sent(records):
        return mistake
    probes = [T(r["probe"]) for r in records]
    if not all(torch.equal(p, probes[0]) for p in probes):
        return "the ranks' models still give different outputs in eval mode"
    calls = max(len(r["calls"]) for r in records)
    if calls == 0:  # helper 161: distributed_c10d.all_reduce, functional collectives
        return ("the buffers are averaged, but through a call this check does not count (it "
                "counts dist.all_reduce, dist.all_gather, dist.broadcast, ...; not the "
                "deprecated all_reduce_coalesced, nor functional collectives): flatten every "
                "statistic into one tensor and dist.all_reduce it once (lesson 04's loop sends "
                "one per buffer; this exercise asks for one in all)")  # fmt: skip
    if calls > 1:
        return (f"{calls} collectives on each rank for {len(stats)} statistics: the values are "
                "right, but every collective pays a fixed cost before each evaluation (a "
                "ResNet-50 has 106 such buffers; lesson 07 measures the cost) - one tensor of "
                "every statistic (torch.cat of each .reshape(-1)), one all_reduce, then each "
                "piece copied back into its buffer")  # fmt: skip
    return None


def _judge_sent(records: list[Record]) -> str | None:
    """More numbers through the collective than the statistics: the parameters went too (they
    come back unchanged when every rank holds the same, so only the count shows it)."""
    floats = [len(b["values"]) for b in records[0]["before"].values() if "float" in b["dtype"]]
    counters = sum(len(b["values"]) for b in records[0]["before"].values()) - sum(floats)
    if (sent := max(r["sent"] for r in records)) > sum(floats) + counters:
        return (f"{sent} numbers went through the collective for {sum(floats)} statistics: the "
                "parameters too (they come back the same only because every rank holds the "
                "same ones; a ResNet-50 sends about 500x the bytes) - average model.buffers(), "
                "the floating-point ones")  # fmt: skip
    return None


def _still_differ(records: list[Record], differ: list[str]) -> str:
    """Statistics that differ between the ranks after the learner's function: why."""
    if alone := RANK_0_ALONE.get(_only_rank_0_averaged(records, differ)):
        return alone
    if any("reduce" in r["calls"] and "broadcast" not in r["calls"] for r in records):
        return ("dist.reduce leaves the sum on its dst rank only, the other ranks' buffers "
                "keep what they held: dist.all_reduce, so that every rank gets the sum, "
                "then divide it by the world size")  # fmt: skip
    own_share = any(
        all(
            torch.allclose(
                torch.tensor(r["after"][k]["values"]),
                torch.tensor(r["before"][k]["values"]) / len(records),
            )
            for k in differ
        )
        for r in records
    )  # rank 0: rank 1 calls it late
    if own_share and any(r.get("asyncs") for r in records):  # helper 161: read, then wait
        return ("a rank's buffers hold its own statistics divided by the world size: the "
                "async all_reduce's tensor was read (into the buffers) before its "
                ".wait(), while the sum was still on its way - wait on the Work first, then "
                "divide and write the buffers")  # fmt: skip
    kinds = sorted({k.rsplit(".", 1)[-1] for k in differ})
    layers = sorted({k.rsplit(".", 1)[0] for k in differ})
    return (
        f"{' and '.join(kinds)} still differ{'s' if len(kinds) == 1 else ''} between the "
        f"ranks (layer(s) {', '.join(layers)}): "
        "every BatchNorm statistic of every layer must be made the same - running_mean "
        "and running_var (loop over model.buffers() or named_buffers())"
    )


_INT_DIVIDE = (
    "num_batches_tracked is an integer counter (int64): dividing it in place raises - average "
    "only the floating-point buffers (running_mean, running_var; `buffer.is_floating_point()`) "
    "and leave the counter, which is the same on every rank, alone"
)

EXERCISES = [
    Exercise(
        name="04_average_buffers", lesson="04", run=run_buffers, judge=judge_buffers,
        title="BatchNorm buffers made the same on every rank before evaluating, in one collective",
        teaches=BUFFERS_TEACHES, collective_timeout_s=5.0,
        errors=(("can't be cast to the desired output type Long", _INT_DIVIDE),
                ("is invalid for input of size", "a piece of the reduced tensor does not fit "
                 "its buffer: the pieces must be the buffers' own sizes - flat.split([b.numel() "
                 "for b in stats]) (chunk cuts equal pieces)"),
                ("a leaf Variable that requires grad", "an in-place change of a parameter: "
                 "those are model.parameters(), which DDP keeps equal; the statistics are "
                 "buffers - loop over model.buffers()")),
        hidden=(  # helper 174: right for this check's 2 ranks only
            (DIVIDED_BY_2, "the sum is divided by 2, this check's number of ranks: on 4 GPUs "
             "every statistic would be twice the mean - divide by dist.get_world_size()"),
        ),
        proves=(
            "every BatchNorm running_mean and running_var is the mean over the ranks on every "
            "rank, in one collective; num_batches_tracked unchanged, the parameters neither "
            "sent nor changed; the ranks' models agree in eval mode"
        ),
    ),
]  # fmt: skip
