"""Lesson 02's exercises: evaluation over ranks that reports the number one process would.

``02_exact_accuracy``: (correct, count) over a validation set that does not divide by the
ranks, every sample counted exactly once. ``02_macro_f1``: a metric that is not a sum (macro
F1) from every rank's shard, computed from the ranks' added per-class counts. Each ``run``
records what the learner's function returned on its rank (and, for the first, which samples
it evaluated); each ``judge`` names the first mistake.
"""

from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.lesson01 import watched

VAL_LENGTH = 11  # odd: 2 ranks cannot split it evenly, so a padded sampler repeats one sample
FEATURES = 3


def val_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The validation set every rank builds: features, and labels the model gets 7 of 11 right."""
    x = torch.linspace(-1.0, 1.0, VAL_LENGTH * FEATURES).reshape(VAL_LENGTH, FEATURES)
    x = x[torch.randperm(VAL_LENGTH, generator=torch.Generator().manual_seed(2))]
    labels = predictor()(x).argmax(dim=1)
    labels[[1, 4, 6, 9]] = (labels[[1, 4, 6, 9]] + 1) % FEATURES  # four wrong, none of them 0
    return x, labels


def predictor() -> nn.Module:
    """A fixed model: the class is the largest feature (no training, the same on every rank)."""
    model = nn.Linear(FEATURES, FEATURES, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(FEATURES))
    return model


class WatchedSet(Dataset):
    """The validation set, remembering which indices this rank read (so the judge can see
    repeats and gaps). With DataLoader workers the reads happen elsewhere and are not seen."""

    def __init__(self) -> None:
        self.x, self.y = val_data()
        self.read: list[int] = []

    def __len__(self) -> int:
        return VAL_LENGTH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(int(i))
        return self.x[i], self.y[i]


def _number(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if isinstance(x, int | float):
        return x
    return repr(x)


def run_accuracy(module: ModuleType, ctx: Context) -> Record:
    calls: list[tuple[str, Any]] = []
    data = WatchedSet()
    with watched(calls, module):
        got = module.exact_accuracy(predictor(), data)
    if isinstance(got, tuple | list) and len(got) == 2:
        got = [_number(v) for v in got]
    else:
        got = repr(got)
    return {"got": got, "read": data.read, "calls": [name for name, _ in calls]}


def truth_correct() -> int:
    x, y = val_data()
    return int((predictor()(x).argmax(dim=1) == y).sum())


def judge_accuracy(records: list[Record]) -> str | None:
    correct = truth_correct()
    got = [rec["got"] for rec in records]
    for rank, g in enumerate(got):
        if not isinstance(g, list):
            return f"rank {rank}'s exact_accuracy returned {g}, not a pair (correct, count)"
    reads = Counter(i for rec in records for i in set(rec["read"]))
    twice = sorted(i for i, n in reads.items() if n > 1)
    if twice:
        ranks = [r for r, rec in enumerate(records) if twice[0] in rec["read"]]
        return (
            f"sample {twice[0]} was evaluated twice (on ranks {ranks}): a DistributedSampler pads "
            f"{VAL_LENGTH} samples to a multiple of {len(records)} by repeating some, and the sums "
            "count the repeats - split without padding (rank r takes r, r + N, r + 2N, ...)"
        )
    if any(rec["read"] for rec in records):
        missing = sorted(set(range(VAL_LENGTH)) - set(reads))
        if missing:
            return (
                f"samples {missing} were never evaluated: drop_last=True (or a split that stops "
                f"at {VAL_LENGTH} // N per rank) skips the remainder - every sample must count once"
            )
    if len({tuple(g) for g in got}) > 1:
        return (
            f"the ranks returned different results {got}: each rank counted only its own shard - "
            "add the ranks' [correct, count] with dist.all_reduce, so every rank holds the total"
        )
    if "all_reduce" not in records[0]["calls"] and "all_gather" not in records[0]["calls"]:
        return (
            f"every rank returned {got[0]} without a collective: add the ranks' [correct, count] "
            "with dist.all_reduce"
        )
    got_correct, count = got[0]
    if count == VAL_LENGTH + (-VAL_LENGTH % len(records)):
        return (
            f"counted {count} samples, not {VAL_LENGTH}: a padded DistributedSampler counts its "
            "repeats twice - split without padding"
        )
    if count != VAL_LENGTH:
        if not any(rec["read"] for rec in records):
            return f"counted {count} samples, expected {VAL_LENGTH}: every sample exactly once"
        return (
            f"counted {count} samples, expected {VAL_LENGTH}, though every sample was read once: "
            "count len(y) per batch (the last one is short, not batch_size), and all_reduce "
            "the totals once, after the loop (not the running sums in it)"
        )
    if got_correct != correct:
        return f"counted {got_correct} correct predictions, expected {correct}"
    return None


# 02_macro_f1: each rank's shard of predictions and labels (4 classes). The shards differ in
# size and class mix: class 2 is never predicted or labelled on rank 1, so its F1 there is 0/0,
# and class 3 is on no rank at all: it scores 0 and still counts in the mean.
SHARDS = (
    ([0, 0, 1, 2, 2, 1, 0, 2], [0, 1, 1, 2, 2, 2, 0, 0]),
    ([1, 0, 1, 1, 0], [1, 0, 0, 1, 1]),
)
CLASSES = 4
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
    pred, target = (torch.tensor(v) for v in _shard(ctx.rank))
    with watched(calls, module):
        got = module.macro_f1(pred.clone(), target.clone(), CLASSES)
    return {"got": _number(got), "calls": [name for name, _ in calls]}


def judge_f1(records: list[Record]) -> str | None:
    n = len(records)
    shards = [_shard(r) for r in range(n)]
    every = f1_counts([p for s in shards for p in s[0]], [t for s in shards for t in s[1]])
    truth = f1_of(every)
    own = [f1_of(f1_counts(*s)) for s in shards]
    wrong = {
        "mean": sum(own) / n,
        "micro": f1_of(every, macro=False),
        "present": f1_of(every, present_only=True),
    }
    for rank, rec in enumerate(records):
        got = rec["got"]
        if not isinstance(got, int | float):
            return f"rank {rank}'s macro_f1 returned {got}, not a number"
        if abs(got - truth) < F1_TOL:
            continue
        if abs(got - wrong["mean"]) < F1_TOL:
            return (
                f"rank {rank} returned {got:.4f}, the mean of the ranks' own F1s; the F1 of the "
                f"whole set is {truth:.4f}: F1 is not a sum - all_reduce the per-class TP, FP, FN "
                "counts, then compute F1 once from the totals"
            )
        if abs(got - own[rank]) < F1_TOL:
            return (
                f"rank {rank} returned {got:.4f}, the F1 of its own shard only: add the ranks' "
                "per-class TP, FP, FN counts (dist.all_reduce) before computing F1"
            )
        if abs(got - wrong["present"]) < F1_TOL:
            return (
                f"rank {rank} returned {got:.4f}, the mean over the classes that occur; a class "
                "nobody predicted or labelled (2·TP + FP + FN = 0) scores 0 and still counts: "
                f"the mean over all num_classes, {truth:.4f}"
            )
        if abs(got - wrong["micro"]) < F1_TOL:
            return (
                f"rank {rank} returned {got:.4f}, the micro F1 (counts summed over classes "
                f"first); macro F1 is the mean of the per-class F1s: {truth:.4f}"
            )
        return f"rank {rank} returned {got}, expected the macro F1 of the whole set, {truth!r}"
    return None


_COUNTS_ERRORS = (
    ("can't be cast to the desired output type Long", "the counts are integers, and their "
     "mean is not one: ReduceOp.AVG (gloo computes it as a sum, then a division in place) "
     "cannot write it back - all_reduce them with the default SUM, then divide the totals"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="02_exact_accuracy", lesson="02", run=run_accuracy, judge=judge_accuracy,
        title="exact validation on a set that does not divide by the ranks",
        teaches='lesson 02, "Validation: count every sample once"', errors=_COUNTS_ERRORS,
        proves=(
            "a set that does not divide by the ranks: every sample evaluated once (none repeated,"
            " none dropped); every rank returned the whole set's (correct, count)"
        ),
    ),
    Exercise(
        name="02_macro_f1", lesson="02", run=run_f1, judge=judge_f1,
        title="macro F1 over ranks: add the counts, then compute",
        teaches='lesson 02, "A metric that is not a sum: gather, drop the padding, compute once"',
        shapes_hint="a count per class that only the classes a rank saw have",
        proves=(
            "every rank returned the macro F1 of the whole set (not the mean of the ranks' F1s, "
            "not its own shard's, not the micro F1)"
        ),
    ),
]  # fmt: skip
