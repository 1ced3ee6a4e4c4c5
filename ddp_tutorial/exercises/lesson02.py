"""Lesson 02's exercises: evaluation over ranks that reports the number one process would.

``02_exact_accuracy``: (correct, count) over a validation set that does not divide by the
ranks, every sample counted exactly once (the second exercise, macro F1: ``lesson02_f1``).
``run_accuracy`` records what the learner's function returned on its rank and which samples
it evaluated; ``judge_accuracy`` names the first mistake.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_tutorial.exercises.core import Context, Exercise, Record, ranks_written_as
from ddp_tutorial.exercises.lesson01 import watched

VAL_LENGTH = 11  # odd: 2 ranks cannot split it evenly, so a padded sampler repeats one sample
FEATURES = 3
LATE_S = 0.3  # the other ranks start this late (both exercises)
# the collectives that can add the ranks' counts (a reduce: on its dst only, unless broadcast)
ADDING = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce"}
EVAL_BATCH = 5  # the ranks' 6 and 5 samples make 2 and 1 batches: a collective per batch hangs


def val_data(flipped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation set every rank builds: features, and labels the model gets 7 of 11 right
    (``flipped``: the other 4, so that a sample counted twice shows in one of the two sets)."""
    x = torch.linspace(-1.0, 1.0, VAL_LENGTH * FEATURES).reshape(VAL_LENGTH, FEATURES)
    x = x[torch.randperm(VAL_LENGTH, generator=torch.Generator().manual_seed(2))]
    labels = predictor()(x).argmax(dim=1)
    wrong = torch.zeros(VAL_LENGTH, dtype=torch.bool)
    wrong[[1, 4, 6, 9]] = True  # four wrong, none of them 0
    wrong = ~wrong if flipped else wrong
    labels[wrong] = (labels[wrong] + 1) % FEATURES
    return x, labels


class Predictor(nn.Linear):
    """A fixed model: the class is the largest feature (no training, the same on every rank).
    Each forward notes whether it ran in training mode and with gradients on: neither changes
    this model's numbers, and both matter on the learner's (dropout, BatchNorm, memory)."""

    def __init__(self) -> None:
        super().__init__(FEATURES, FEATURES, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.eye(FEATURES))
        self.modes: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.modes.add("train")
        if torch.is_grad_enabled():
            self.modes.add("grad")
        return super().forward(x)


def predictor() -> Predictor:
    return Predictor()


class WatchedSet(Dataset):
    """The validation set, remembering which indices this rank read (so the judge can see
    repeats and gaps). With DataLoader workers the reads happen elsewhere and are not seen."""

    def __init__(self, flipped: bool = False) -> None:
        self.x, self.y = val_data(flipped)
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


def start_late(ctx: Context) -> None:
    """Every rank but 0 calls the learner's function LATE_S late: rank 0's sum cannot arrive
    before it reads its tensor, so a read before the wait reads its own counts, every time."""
    if ctx.rank > 0:
        time.sleep(LATE_S)


def run_accuracy(module: ModuleType, ctx: Context) -> Record:
    calls: list[tuple[str, Any]] = []
    unwaited: list[int] = []
    data = WatchedSet()
    start_late(ctx)
    model = predictor()
    with watched(calls, module, unwaited=unwaited):  # batches of 5: 6 and 5 samples: 2 and 1
        got = module.exact_accuracy(model, data, batch_size=EVAL_BATCH)
    if isinstance(got, tuple | list) and len(got) == 2:
        got = [_number(v) for v in got]
    else:
        got = repr(got)
    ops = [op for name, op in calls if name == "all_reduce"]
    # on every rank alike: the same function on the set with the other predictions right
    flipped = module.exact_accuracy(predictor(), WatchedSet(flipped=True), EVAL_BATCH)
    flipped = [_number(v) for v in flipped] if isinstance(flipped, tuple | list) else None
    return {"got": got, "read": data.read, "calls": [name for name, _ in calls], "ops": ops,
            "unwaited": len(unwaited), "flipped": flipped,
            "modes": sorted(model.modes)}  # fmt: skip


def right_per_sample(flipped: bool = False) -> torch.Tensor:
    """Whether the predictor gets each validation sample right (True/False per sample)."""
    x, y = val_data(flipped)
    return predictor()(x).argmax(dim=1) == y


def truth_correct(flipped: bool = False) -> int:
    return int(right_per_sample(flipped).sum())


def _judge_reads(records: list[Record]) -> str | None:
    """What the samples each rank read say (seen when the DataLoader has no workers)."""
    n, reads = len(records), [set(rec["read"]) for rec in records]
    whole = [r for r, seen in enumerate(reads) if len(seen) == VAL_LENGTH]
    if n > 1 and len(whole) == n:
        return (
            "every rank evaluated the whole set: the right numbers for N times the work - "
            "give rank r the samples r, r + N, r + 2N, ..., and add the ranks' counts"
        )
    if n > 1 and whole and not any(reads[r] for r in range(n) if r not in whole):
        return (f"rank {whole[0]} evaluated the whole set alone, the others none of it: the "
                "right numbers, one rank doing every rank's work - split it (rank r takes r, "
                "r + N, r + 2N, ...) and add the ranks' counts with dist.all_reduce")  # fmt: skip
    missing = sorted(set(range(VAL_LENGTH)) - set().union(*reads))
    if any(reads) and missing:
        return (f"samples {missing} were never evaluated: drop_last=True (or a split that stops "
                f"at {VAL_LENGTH} // N per rank) skips the remainder - every sample must count "
                "once")  # fmt: skip
    return None


def _judge_repeats(records: list[Record], got: list[Any]) -> str | None:
    """A sample evaluated on two ranks: its prediction counted twice, whatever the count says
    (a count set to len(dataset) afterwards hides the repeat, not its prediction)."""
    n = len(records)
    reads = Counter(i for rec in records for i in set(rec["read"]))
    twice = sorted(i for i, k in reads.items() if k > 1)
    if not twice:
        return None
    ranks = [r for r, rec in enumerate(records) if twice[0] in rec["read"]]
    return (
        f"returned {got}: sample {twice[0]} was evaluated twice (on ranks {ranks}): "
        f"a DistributedSampler pads {VAL_LENGTH} samples to a multiple of {n} by repeating "
        "some, and the sums count the repeats - split without padding (rank r takes r, "
        "r + N, r + 2N, ...)"
    )


def _judge_count(records: list[Record], count: int) -> str | None:
    """A total count other than the set's length: why."""
    n = len(records)
    if other := {"MAX", "MIN", "PRODUCT"} & {str(op) for op in records[0]["ops"]}:
        return (f"counted {count} samples, not {VAL_LENGTH}: the counts were combined with "
                f"ReduceOp.{sorted(other)[0]} - counts add up: use the default SUM")  # fmt: skip
    if "AVG" in records[0]["ops"] or count in (VAL_LENGTH // n, round(VAL_LENGTH / n)):
        return (f"counted {count} samples, not {VAL_LENGTH}: the ranks' counts were averaged "
                "(ReduceOp.AVG) or divided by the world size after the all_reduce - counts add "
                "up: add them with the default SUM, and divide nothing")  # fmt: skip
    if count == VAL_LENGTH + (-VAL_LENGTH % n):
        return (f"counted {count} samples, not {VAL_LENGTH}: a padded DistributedSampler counts "
                "its repeats twice - split without padding")  # fmt: skip
    if not any(rec["read"] for rec in records):
        return f"counted {count} samples, expected {VAL_LENGTH}: every sample exactly once"
    return (
        f"counted {count} samples, expected {VAL_LENGTH}, though every sample was read once: "
        "count len(y) per batch (the last one is short, not batch_size), and all_reduce "
        "the totals once, after the loop (not the running sums in it)"
    )


def judge_accuracy(records: list[Record]) -> str | None:
    got = [rec["got"] for rec in records]
    for rank, g in enumerate(got):
        if not isinstance(g, list):
            return f"rank {rank}'s exact_accuracy returned {g}, not a pair (correct, count)"
    if mistake := _judge_reads(records):
        return mistake
    calls = set(records[0]["calls"])
    called = ADDING & calls
    if "broadcast" in calls and not called:
        return (f"every rank returned {got[0]}: dist.broadcast hands one rank's counts to "
                "every rank, it adds nothing - add the ranks' [correct, count] with "
                "dist.all_reduce (the default SUM)")  # fmt: skip
    # helper 174: a reduce, then broadcast_object_list (or any way of sharing): right when
    # every rank holds the totals
    differ = len({tuple(g) for g in got}) > 1
    if "reduce" in calls and not called - {"reduce"} and "broadcast" not in calls and differ:
        return (f"the ranks returned {got}: dist.reduce leaves the added counts on its dst "
                "rank only; every rank must return them - dist.all_reduce the counts (or "
                "broadcast them from dst after the reduce)")  # fmt: skip
    if len({tuple(g) for g in got}) > 1:
        if called and any(rec.get("unwaited") for rec in records):
            return (f"the ranks returned different results {got}: the all_reduce(..., "
                    "async_op=True) was not waited on before the counts were read - call "
                    ".wait() on what it returns first (or call it without async_op)")  # fmt: skip
        if called:
            return _added_unequally(records, got, sorted(called)[0])
        return (
            f"the ranks returned different results {got}: each rank counted only its own shard - "
            "add the ranks' [correct, count] with dist.all_reduce, so every rank holds the total"
        )
    if not called:
        return (
            f"every rank returned {got[0]} without a collective: add the ranks' [correct, count] "
            "with dist.all_reduce"
        )
    got_correct, count = got[0]
    if count != VAL_LENGTH or got_correct != truth_correct():  # a repeat first: it explains both
        if mistake := _judge_repeats(records, got[0]):  # (deduplicated: right, and not here)
            return mistake
    if count != VAL_LENGTH:
        return _judge_count(records, count)
    if got_correct != truth_correct():
        return f"counted {got_correct} correct predictions, expected {truth_correct()}"
    if (flipped := records[0]["flipped"]) != [truth_correct(True), VAL_LENGTH]:
        # the first set's answer was right by luck: its repeats were wrong predictions
        return _judge_repeats(records, flipped) or (
            f"on the same set with the other {truth_correct(True)} predictions right it "
            f"returned {flipped}: count every sample once, its own prediction"
        )
    return _judge_modes(records)


def _added_unequally(records: list[Record], got: list[Any], name: str) -> str:
    """Ranks that called a collective and still disagree: each kept its own counts (added
    before the loop), or one added its own twice (a gathered list plus its own sums)."""
    right = right_per_sample()
    own = [[int(right[sorted(set(rec["read"]))].sum()), len(set(rec["read"]))] for rec in records]
    total = [sum(c) for c in zip(*own, strict=True)]
    if got == own:
        return (f"the ranks returned different results {got}, their own counts, though they "
                f"called dist.{name}: add the totals once every batch is counted, after the "
                "loop (a sum made before it adds zeros)")  # fmt: skip
    for r, g in enumerate(got):  # a sum of the ranks' counts, some taken twice or never?
        for times in itertools.product(range(3), repeat=len(own)):
            made = [sum(k * o[i] for k, o in zip(times, own, strict=True)) for i in (0, 1)]
            if g != total and g == made:
                said = ", ".join(f"rank {i}'s {('never', 'once', 'twice')[k]}"
                                 for i, k in enumerate(times))  # fmt: skip
                return (f"rank {r} returned {g}, not the total {total}: it added {said} - "
                        "every rank's counts are added exactly once, its own included once "
                        "(a gathered list already holds them)")  # fmt: skip
    return (f"the ranks returned different results {got}, though they called dist.{name}: "
            f"every rank must end with the same total, {total} - each rank's counts added "
            "once")  # fmt: skip


def _judge_modes(records: list[Record]) -> str | None:
    """The right counts from a model left in training mode, or with autograd on: right here
    only (this model has no dropout, no BatchNorm), wrong or wasteful on the learner's."""
    modes = {m for rec in records for m in rec.get("modes", ())}
    if "train" in modes:
        return ("the model evaluated in training mode: model.eval() first - here the counts "
                "are right, but dropout and BatchNorm change a real model's predictions "
                "(lesson 02, exact evaluation)")  # fmt: skip
    if "grad" in modes:
        return (
            "the forward ran with gradients on: evaluate under torch.no_grad() - autograd "
            "keeps every activation for a backward that never comes (memory, time)"
        )
    return None


_COUNTS_ERRORS = (
    ("can't be cast to the desired output type Long", "the counts are integers, and their "
     "mean is not one: ReduceOp.AVG (gloo computes it as a sum, then a division in place) "
     "cannot write it back - all_reduce them with the default SUM, and compute from the totals"),
)  # fmt: skip
EXERCISES = [
    Exercise(
        name="02_exact_accuracy", lesson="02", run=run_accuracy, judge=judge_accuracy,
        title="exact validation on a set that does not divide by the ranks",
        teaches='lesson 02, "Validation: count every sample once"', errors=_COUNTS_ERRORS,
        hidden=(  # the check runs 2 ranks: a 2 written for the number of ranks passes there
            (ranks_written_as(2), "the number of ranks is written as 2, this "
             "check's: on 4 or 8 GPUs the ranks' shares overlap (samples counted twice or more) "
             "or a sampler refuses rank 2 - use dist.get_world_size() (`world`)"),
            # helper 164; not `// world` (166), nor a block's size or bounds: ceil(len / world)
            # (174), int(rank * n / world), len(dataset) / world (177)
            (r"ReduceOp\.AVG|(?m:^)(?![^\n]*(?:ceil\(|len\(|\brank\b))[^\n]*?(?<!/)/(?!/)=?\s*"
             r"world\b",
             "the ranks' accuracies averaged: a rank of 5 samples weighs like one of 6, and "
             "the mean is right here only after rounding - add up the counts (SUM), then "
             "divide once, by the whole set's count"),
        ),
        proves=(
            "a set that does not divide by the ranks: every sample counted once (none twice, "
            "none dropped); every rank returned the whole set's (correct, count)"
        ),
    ),
]  # fmt: skip
