"""Lesson 02's second exercise, ``02_macro_f1``: a metric that is not a sum (macro F1) from
every rank's shard, computed from the ranks' added per-class counts (the first, exact
accuracy: ``lesson02``). ``run_f1`` records what the learner's function returned on its rank;
``judge_f1`` names the first mistake.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import torch

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.lesson01 import watched
from ddp_tutorial.exercises.lesson02 import _COUNTS_ERRORS, _number, start_late

# 02_macro_f1: each rank's shard of predictions and labels (4 classes). The shards differ in
# size and class mix: class 3 is never predicted or labelled on rank 1, so its F1 there is 0/0;
# class 2 is on no rank at all: it scores 0 and still counts in the mean. A class that is not
# the last is the absent one, and class 3's FP and FN differ (0 and 1), so that a loop that
# misses the last class, or precision or recall in F1's place, is seen.
SHARDS = (
    ([0, 0, 0, 3, 3, 1, 0, 1], [0, 1, 1, 3, 3, 3, 0, 0]),
    ([1, 0, 1, 1, 0], [1, 0, 0, 1, 1]),
)
CLASSES = 4
ABSENT = 2  # the class on no rank
F1_TOL = 1e-6  # float32 arithmetic (int64 counts divided) is right too


def f1_counts(pred: list[int], target: list[int]) -> torch.Tensor:
    """[3, CLASSES]: TP, FP, FN per class."""
    p, t = torch.tensor(pred), torch.tensor(target)
    return torch.stack(
        [
            torch.stack(
                [
                    ((p == c) & (t == c)).sum(),
                    ((p == c) & (t != c)).sum(),
                    ((p != c) & (t == c)).sum(),
                ]
            )
            for c in range(CLASSES)
        ]  # fmt: skip
    ).T.double()


def f1_of(counts: torch.Tensor, macro: bool = True, present_only: bool = False) -> float:
    tp, fp, fn = counts if macro else counts.sum(dim=1, keepdim=True)
    denominator = 2 * tp + fp + fn
    f1 = 2 * tp / denominator.clamp(min=1)
    return (f1[denominator > 0] if present_only else f1).mean().item()


def _shard(rank: int) -> tuple[list[int], list[int]]:
    return SHARDS[rank % len(SHARDS)]


def run_f1(module: ModuleType, ctx: Context) -> Record:
    calls: list[tuple[str, Any]] = []
    asyncs: list[str] = []
    pred, target = (torch.tensor(v) for v in _shard(ctx.rank))
    start_late(ctx)
    with watched(calls, module, asyncs=asyncs):
        got = module.macro_f1(pred.clone(), target.clone(), CLASSES)
    # one class more, on no rank (helper 156: classes counted from the data passed)
    wider = _number(module.macro_f1(pred.clone(), target.clone(), CLASSES + 1))
    return {"got": _number(got), "calls": [name for name, _ in calls], "async": len(asyncs),
            "wider": wider}  # fmt: skip


def judge_f1(records: list[Record]) -> str | None:
    n = len(records)
    shards = [_shard(r) for r in range(n)]
    every = f1_counts([p for s in shards for p in s[0]], [t for s in shards for t in s[1]])
    truth = f1_of(every)
    own = [f1_of(f1_counts(*s)) for s in shards]
    sizes = [len(s[0]) for s in shards]
    weighted = sum(f * k for f, k in zip(own, sizes, strict=True)) / sum(sizes)
    wrong = [*_wrong_f1s(every, sum(own) / n), *_combined_per_rank(shards, weighted)]
    numbers = [rec["got"] if isinstance(rec["got"], int | float) else None for rec in records]
    right = [r for r, got in enumerate(numbers) if got is not None and abs(got - truth) < F1_TOL]
    # a reduce, then a broadcast of the score (helper 147) or broadcast_object_list (174): right
    calls = set(records[0]["calls"])
    if "reduce" in calls and not calls & {"all_reduce", "broadcast"} and len(right) < n:
        return (
            "dist.reduce leaves the added counts on its dst rank only; every rank must "
            "return the F1 - dist.all_reduce the counts (or broadcast the score from dst)"
        )
    for rank, rec in enumerate(records):
        got = rec["got"]
        if not isinstance(got, int | float):
            return f"rank {rank}'s macro_f1 returned {got}, not a number"
        if abs(got - truth) < F1_TOL:
            continue
        if got != got:  # nan
            return (f"rank {rank} returned nan: class {ABSENT} is on no rank, and 0 / 0 is "
                    "nan - a class with 2·TP + FP + FN = 0 scores 0 (divide by the denominator "
                    "clamped to at least 1)")  # fmt: skip
        if right and abs(own[rank] - got) >= F1_TOL:
            return (f"rank {rank} returned {got:.4f}, rank {right[0]} the F1 of the whole set: "
                    "every rank must compute it from the added counts (is the score under an "
                    "`if rank == 0`?)")  # fmt: skip
        if abs(got - own[rank]) < F1_TOL and rec.get("async"):
            return (f"rank {rank} returned {got:.4f}, the F1 of its own shard, though it called "
                    "all_reduce(..., async_op=True): the counts were read before the .wait() "
                    "on what it returned - the sum is in the tensor only once wait() returns "
                    "(or call it without async_op)")  # fmt: skip
        if abs(got - own[rank]) < F1_TOL:
            return (
                f"rank {rank} returned {got:.4f}, the F1 of its own shard only: add the ranks' "
                "per-class TP, FP, FN counts (dist.all_reduce) before computing F1"
            )
        if partly := _partly_added(got, every, f1_counts(*shards[rank])):
            return f"rank {rank} returned {got:.4f}, {partly}; the macro F1 is {truth:.4f}"
        for value, what in wrong:
            if abs(got - value) < F1_TOL:
                return f"rank {rank} returned {got:.4f}, {what}; the macro F1 is {truth:.4f}"
        return f"rank {rank} returned {got}, expected the macro F1 of the whole set, {truth!r}"
    wide = truth * CLASSES / (CLASSES + 1)  # the extra class scores 0 and counts in the mean
    if any(not isinstance(w := rec.get("wider"), float) or abs(w - wide) >= F1_TOL
           for rec in records):  # fmt: skip
        w = records[0].get("wider")
        w = f"{w:.4f}" if isinstance(w, float) else w
        return (f"macro_f1(pred, target, num_classes={CLASSES + 1}) returned {w}, not "
                f"{wide:.4f}: the classes are the num_classes given, not the ones the data "
                f"shows - class {CLASSES} is on no rank, scores 0 and counts in the "
                "mean")  # fmt: skip
    return None


def _partly_added(got: float, every: torch.Tensor, mine: torch.Tensor) -> str | None:
    """If ``got`` is the F1 of counts some of which were added over the ranks and the others
    this rank's own (one row all_reduced, or TP and FP in separate tensors, one forgotten)."""
    names = ("TP", "FP", "FN")
    for added in itertools.product((True, False), repeat=3):
        mix = torch.stack([every[i] if a else mine[i] for i, a in enumerate(added)])
        if any(added) and not all(added) and abs(f1_of(mix) - got) < F1_TOL:
            summed = ", ".join(n for n, a in zip(names, added, strict=True) if a)
            own = ", ".join(n for n, a in zip(names, added, strict=True) if not a)
            return (f"the F1 of counts only partly added over the ranks ({summed} added; {own} "
                    "this rank's own): all_reduce every count - TP, FP and FN in one tensor "
                    "(torch.stack), one call")  # fmt: skip
    return None


def _combined_per_rank(shards: list[Any], weighted: float) -> list[tuple[float, str]]:
    """Scores made on each rank and combined after: F1s weighted by shard size, and the ranks'
    per-class precision and recall averaged before F1 - neither is the F1 of the added counts."""
    pr = []
    for shard in shards:
        tp, fp, fn = f1_counts(*shard)
        pr.append(torch.stack([tp / (tp + fp).clamp(min=1), tp / (tp + fn).clamp(min=1)]))
    p, r = torch.stack(pr).mean(0)
    from_pr = (2 * p * r / (p + r).clamp(min=1e-12)).mean().item()
    return [
        (weighted, "the ranks' own F1s weighted by their shard sizes: still a mean of F1s, and "
         "F1 is not a sum - all_reduce the per-class TP, FP, FN counts, then compute F1 once"),
        (from_pr, "the F1 of the ranks' precisions and recalls averaged per class: a ratio is "
         "not a sum either - all_reduce the per-class TP, FP, FN counts, then compute "
         "precision, recall and F1 from the totals"),
    ]  # fmt: skip


def _wrong_f1s(every: torch.Tensor, mean_of_own: float) -> list[tuple[float, str]]:
    """The numbers plausible mistakes return, each with its name (checked in this order)."""
    tp, fp, fn = every
    per_class = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
    return [
        (mean_of_own, "the mean of the ranks' own F1s: F1 is not a sum - all_reduce the "
         "per-class TP, FP, FN counts, then compute F1 once from the totals"),
        (f1_of(every, present_only=True), "the mean over the classes that occur; a class nobody "
         "predicted or labelled (2·TP + FP + FN = 0) scores 0 and still counts: the mean is over "
         "all num_classes"),
        (f1_of(every, macro=False), "the micro F1 (counts summed over classes first); macro F1 "
         "is the mean of the per-class F1s"),
        ((tp / (tp + fp).clamp(min=1)).mean().item(), "the macro precision, TP / (TP + FP) (is "
         "FN counted as FP: (pred != c) & (target == c)?); F1 = 2·TP / (2·TP + FP + FN)"),
        ((tp / (tp + fn).clamp(min=1)).mean().item(), "the macro recall, TP / (TP + FN) (is FP "
         "counted as FN: (pred == c) & (target != c)?); F1 = 2·TP / (2·TP + FP + FN)"),
        (per_class[:-1].sum().item() / CLASSES, f"as if the last class ({CLASSES - 1}) were "
         "never counted: the loop must go over range(num_classes), every class"),
        ((per_class * (tp + fn)).sum().item() / (tp + fn).sum().clamp(min=1).item(), "the F1s "
         "weighted by each class's support (TP + FN: sklearn's 'weighted'); macro F1 weighs "
         "every class alike - the plain mean of the per-class F1s"),
        ((tp / (tp + fp + fn).clamp(min=1)).mean().item(), "the Jaccard index (IoU), TP / "
         "(TP + FP + FN): F1 counts TP twice, 2·TP / (2·TP + FP + FN)"),  # helper 147
        ((2 * tp / (tp + fp + fn).clamp(min=1)).mean().item(), "2·TP / (TP + FP + FN): the "
         "denominator counts TP once; F1 = 2·TP / (2·TP + FP + FN)"),
        ((2 * tp // (2 * tp + fp + fn).clamp(min=1)).float().mean().item(), "each class's F1 by "
         "integer division (//: 0 unless perfect): divide with /, on floats"),
        (torch.where(2 * tp + fp + fn > 0, per_class, 1.0).mean().item(), "a class nobody "
         "predicted or labelled scored 1 (zero_division=1); this exercise scores it 0, as "
         "2·TP / (2·TP + FP + FN).clamp(min=1) does"),
    ]  # fmt: skip


_UNEVEN = (
    "the ranks passed tensors of different sizes (or dtypes) to one collective (gloo refuses): "
    "each rank's own predictions (8 and 5), or counts for only the classes a rank saw "
    "- add a [3, num_classes] count (TP, FP, FN of every class) with dist.all_reduce, "
    "the same shape on every rank"
)
_SHORT_BINCOUNT = (  # helper 139: torch's raw "shape '[4, 4]' is invalid for input of size 14"
    "a count shorter than the classes: torch.bincount is as long as the largest value it saw, "
    "so a rank whose samples miss the last classes gets fewer counts than k*k (or k) - "
    "torch.bincount(..., minlength=k * k), the same length on every rank, then reshape"
)
_F1_ERRORS = (*_COUNTS_ERRORS, ("Received data size", _UNEVEN), ("EnforceNotMet", _UNEVEN),
              ("is invalid for input of size", _SHORT_BINCOUNT))  # fmt: skip

EXERCISES = [
    Exercise(
        name="02_macro_f1", lesson="02", run=run_f1, judge=judge_f1,
        title="macro F1 over ranks: add the counts, then compute",
        teaches='lesson 02, "A metric that is not a sum: gather, drop the padding, compute once"',
        shapes_hint="a count per class for only the classes a rank saw, or each rank's own "
        "predictions, whose numbers differ", errors=_F1_ERRORS,
        proves=(
            "every rank returned the macro F1 of the whole set (not the mean of the ranks' F1s, "
            "not its own shard's, not the micro F1)"
        ),
    ),
]  # fmt: skip
