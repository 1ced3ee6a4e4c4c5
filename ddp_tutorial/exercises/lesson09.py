"""Lesson 09's exercise: a training script that hangs, found and fixed (run as torchrun runs it).

``09_find_the_hang``: two hangs a real script meets, one after the other: ranks with different
numbers of batches (rank 0's last backward all-reduces with nobody), then rank 0 evaluating the
DDP model alone (its forward broadcasts the BatchNorm buffers: a collective the other rank never
joins). The check runs the learner's file with a short collective timeout, so a hang that is
still there ends in seconds and is named: the rank that waited, the line it waited at, and the
lesson's section for that kind of hang. A file that no longer hangs must still train every
sample in every epoch, keep the replicas equal and report the trained model's accuracy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms import Join

from ddp_tutorial.exercises.core import Context, Exercise, Record

SAMPLES, UNLABELLED_EVERY, VAL_SAMPLES, EPOCHS = 30, 6, 64, 2  # the stub's defaults
LABELLED = [i for i in range(SAMPLES) if i % UNLABELLED_EVERY]


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stub's data (its ``make_data``, without the indexes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    return x, y


def trained_accuracy(state: dict[str, list]) -> float:
    """The validation accuracy of the weights a rank saved, evaluated as it should be."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    model.eval()
    x, y = make_data(VAL_SAMPLES, seed=2)
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@contextmanager
def noting_join(ctx: Context) -> Iterator[None]:
    """Around the learner's file: a ``joined-RANK`` file in ``ctx.out`` once it enters torch's
    ``Join``, the lesson's other fix for uneven inputs (the ranks may then differ in batches)."""
    real = Join.__enter__

    def enter(self: Join) -> Any:
        (ctx.out / f"joined-{ctx.rank}").touch()
        return real(self)

    Join.__enter__ = enter  # type: ignore[method-assign]
    try:
        yield
    finally:
        Join.__enter__ = real  # type: ignore[method-assign]


def run_hang(_: ModuleType | None, ctx: Context) -> Record:
    """On rank 0: every process's report, and the accuracy its saved weights really have."""
    if ctx.rank != 0:
        return {}
    reports = [json.loads(p.read_text()) for p in sorted(ctx.out.glob("report-*.json"))]
    record: Record = {"reports": [{k: r[k] for k in ("rank", "seen", "accuracy")}
                                  for r in reports]}  # fmt: skip
    record["joined"] = any(ctx.out.glob("joined-*"))
    if reports:
        # the weights, not BatchNorm's running statistics (each rank's own, from its last batch)
        weights = [{k: v for k, v in r["state"].items() if "running" not in k and
                    "batches_tracked" not in k} for r in reports]  # fmt: skip
        record["replicas_equal"] = all(w == weights[0] for w in weights)
        record["true_accuracy"] = trained_accuracy(reports[0]["state"])  # rank 0's, as it ran
    return record


def judge_hang(records: list[Record]) -> str | None:
    first, n = records[0], len(records)
    reports = sorted(first["reports"], key=lambda r: r["rank"])
    if [r["rank"] for r in reports] != list(range(n)):
        ranks = [r["rank"] for r in reports]
        return f"reports from ranks {ranks}, not 0..{n - 1}: keep the lines that write the reports"
    for epoch in range(EPOCHS):
        seen = [i for r in reports for i in r["seen"][epoch]]
        if any(i % UNLABELLED_EVERY == 0 for i in seen):
            return (f"epoch {epoch} trained on unlabelled samples (label -1): keep only the "
                    "labelled ones, then split them")  # fmt: skip
        shared = set(reports[0]["seen"][epoch]).intersection(*(r["seen"][epoch] for r in reports))
        if shared >= set(LABELLED):  # every rank trained on every labelled sample
            return (f"in epoch {epoch} every rank trained on all {len(LABELLED)} labelled "
                    "samples: the ranks' work is not split - after keeping the labelled "
                    "ones, give each rank its own part, "
                    "[labelled[j] for j in DistributedSampler(labelled)] "
                    '(lesson 09, "7 · Uneven inputs")')  # fmt: skip
        extra = len(seen) - len(LABELLED)
        if extra >= n:  # DistributedSampler repeats at most world_size - 1 samples
            return (f"epoch {epoch} trained {len(seen)} samples for {len(LABELLED)} labelled "
                    f"ones: {extra} repeats - pad as DistributedSampler does, the list of "
                    "labelled samples to a multiple of world_size (at most world_size - 1 "
                    'repeats), then deal it out (lesson 09, "7 · Uneven inputs")')  # fmt: skip
        if len(shared) >= n:  # padding repeats at most world_size - 1 samples
            return (f"in epoch {epoch} every rank trained on sample {min(shared)} ({len(shared)} "
                    "shared): the ranks' shards overlap - every rank must order the labelled "
                    "samples alike (the same seed on every rank), then take its own part "
                    '(lesson 09, "7 · Uneven inputs")')  # fmt: skip
        missed = sorted(set(LABELLED) - set(seen))
        if missed:
            return (f"sample {missed[0]} was never trained on in epoch {epoch} ({len(missed)} "
                    "missed): cutting the shards to the same length (or drop_last=True) drops "
                    "samples; pad the short one instead, as DistributedSampler does with its "
                    'default drop_last=False (lesson 09, "7 · Uneven inputs")')  # fmt: skip
    counts = [len(r["seen"][0]) for r in reports]
    if len(set(counts)) > 1 and not first["joined"]:
        return (f"the ranks trained {counts} samples an epoch: as many batches of 5 here by luck "
                "(with 21 labelled samples, 11 and 10 make 3 and 2 batches, and the ranks hang) - "
                "pad the labelled list to a multiple of world_size as DistributedSampler does, "
                'then deal it out (lesson 09, "7 · Uneven inputs")')  # fmt: skip
    if not first["replicas_equal"]:
        return "the ranks ended with different weights: every rank must train through DDP"
    accuracy = reports[0]["accuracy"]
    if len(accuracy) != EPOCHS:
        return f"rank 0 reported {len(accuracy)} accuracies in {EPOCHS} epochs: keep the evaluation"
    if abs(accuracy[-1] - first["true_accuracy"]) > 1e-6:
        return (f"rank 0 reported accuracy {accuracy[-1]:.4f}, but the trained model has "
                f"{first['true_accuracy']:.4f} on the validation set: evaluate the plain model "
                "(model.module) in eval mode")  # fmt: skip
    if any(r.get("left_group_open") for r in records):
        return "the process group was left open: end with dist.destroy_process_group()"
    return None


ERRORS = (
    ("Target -1 is out of bounds", "the loss met a sample without a label (-1): keep only the "
     "labelled samples, then split them between the ranks - and a sampler over a list of "
     "labelled samples yields positions in that list (0, 1, 2, ...), not sample numbers: map "
     "them back, [labelled[j] for j in sampler]"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="09_find_the_hang", lesson="09", kind="script", run=run_hang, judge=judge_hang,
        title="a training script that hangs: find it, fix it",
        teaches='lesson 09, "6 · Rank 0 evaluates alone" and "7 · Uneven inputs"',
        collective_timeout_s=8.0, errors=ERRORS, around=noting_join,
        hidden=((r"broadcast_buffers[\"']?\s*[=:]\s*(?:False|0)\b",  # helper 160: 0, a dict
                 "broadcast_buffers=False stops the hang by "
                 "turning off DDP's buffer sync in forward, so the ranks' BatchNorm statistics "
                 "drift apart and rank 0 evaluates with its own (this check leaves the running "
                 "statistics out) - keep the sync, and let rank 0 evaluate model.module, which "
                 "calls no collective"),  # helper 139
                (r"(?:\brank\s*(?:==|!=|<=?|>=?)\s*(?:\d|\w*world\w*\s*-\s*\d)|\blen\(\s*\w+\s*\)\s*(?:==|!=|<=?|>=?)\s*[1-9])"
                 r"[^\n]*(?:\n[^\n]*)?\b(?:shard|labelled)\s*(?:\+?=|\.(?:append|extend|insert)\()",
                 "padding that names a rank or a length (rank == 1, len(shard) < 13) fits "
                 "this run's 25 labelled samples on 2 ranks only: which ranks are short, and by "
                 "how many, depends on the count and the world (24: none; 25 on 3 ranks: two "
                 "of them) - pad the "
                 "labelled list to a multiple of world_size computed from len(labelled), as "
                 'DistributedSampler does (lesson 09, "7 · Uneven inputs")'),
                (r"(?<!-\s1\)\s)(?<!-1\)\s)(?<!-\s1\))(?<!-1\))//\s*[\w.()]*world\w*(?:\(\))?\s*\+\s*1\b(?!\s+if\b)",
                 "len // world_size + 1 is the share rounded up only when the count does not "
                 "divide: with 24 labelled samples (--num-samples 29) every rank pads one that "
                 "no rank needed - round up with -(-len(labelled) // world_size) or math.ceil "
                 '(lesson 09, "7 · Uneven inputs")'),),
        proves=(
            "no hang; each epoch trained every labelled sample (at most world_size - 1 twice); "
            "the replicas agree, and rank 0's accuracy is the trained model's"
        ),
    ),
]  # fmt: skip
