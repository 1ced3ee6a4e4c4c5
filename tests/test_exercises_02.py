"""Lesson 02's exercises: plausible wrong answers, each named in the lesson's words.

Each case is a small edit of the reference solution (scripts/exercises/solutions/02_*.py);
the session fixture checks them all in one batched launch per world size.
"""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

ACC, F1 = "02_exact_accuracy", "02_macro_f1"
SPLIT = "shard = Subset(dataset, range(rank, len(dataset), world))"
PADDED = (
    "shard = Subset(dataset, list(torch.utils.data.DistributedSampler(dataset, shuffle=False)))"
)
ALL_REDUCE = "    dist.all_reduce(sums)  # every rank: the totals, each sample counted once\n"
REDUCE_COUNTS = "dist.all_reduce(counts)  # counts add up over ranks; F1 scores do not"
SCORE = "score = per_class.mean().item()"
COUNTS = "counts = torch.zeros(3, num_classes, dtype=torch.float64, device=pred.device)"
F1_FROM_ADDED = (
    REDUCE_COUNTS + "\n    tp, fp, fn = counts\n    per_class = 2 * tp / (2 * tp "
    "+ fp + fn).clamp(min=1)  # 0 for a class nobody has\n    " + SCORE
)
MICRO = "score = (2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum())).item()"

# lesson 02's general route, right here too: a padded sampler, every rank's (index, correct)
# gathered, each index counted once
GATHERED = """import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def exact_accuracy(model, dataset, batch_size=4):
    world = dist.get_world_size()
    # YOUR CODE
    sampler = DistributedSampler(dataset, shuffle=False)
    device = next(model.parameters()).device
    index = torch.tensor(list(sampler), device=device)
    model.eval()
    with torch.no_grad():
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        ok = torch.cat([(model(x).argmax(dim=1) == y).long() for x, y in loader])
    parts = [torch.empty(2, len(index), dtype=torch.int64, device=device)
             for _ in range(world)]
    dist.all_gather(parts, torch.stack([index, ok]))
    first = {int(i): int(k) for i, k in torch.cat(parts, dim=1).T}
    # END YOUR CODE
    return sum(first.values()), len(first)
"""

CASES = register(
    [
    # helper 174: right answers told otherwise; a copy handed to the collective
    Case(ACC, "contiguous-blocks-by-ceil", None,
         edits=((SPLIT, "per_rank = math.ceil(len(dataset) / world)  # blocks, the last shorter\n"
                 "    start = rank * per_rank\n"
                 "    shard = Subset(dataset, range(start, min(start + per_rank, len(dataset))))"),
                ("import torch\n", "import math\n\nimport torch\n"))),
    # helper 177: a block's bounds by int(rank * n / world) were told "accuracies averaged"; an
    # object collective given a CPU copy (pickled: right) was told the copy's result was lost
    Case(ACC, "contiguous-blocks-by-int", None,
         edits=((SPLIT, "n = len(dataset)\n"
                 "    start, end = int(rank * n / world), int((rank + 1) * n / world)\n"
                 "    shard = Subset(dataset, range(start, end))"),)),
    Case(F1, "counts-gathered-as-objects-on-the-cpu", None,
         edits=((REDUCE_COUNTS, "every = [None] * dist.get_world_size()\n"
                 "    dist.all_gather_object(every, counts.cpu())  # pickled: CPU copies\n"
                 "    counts = torch.stack(every).sum(dim=0).to(pred.device)"),)),
    Case(ACC, "reduced-then-broadcast-as-objects", None,
         edits=((ALL_REDUCE, "    dist.reduce(sums, dst=0)  # the totals on rank 0\n"
                 "    box = [sums.tolist()]\n"
                 "    dist.broadcast_object_list(box, src=0)  # rank 0's totals to every rank\n"
                 "    sums = torch.tensor(box[0])\n"),)),
    Case(ACC, "reduced-on-a-cpu-copy", "a collective is given x.cpu()",
         edits=((ALL_REDUCE, "    dist.all_reduce(sums.cpu())  # gloo takes CPU tensors\n"),)),
    Case(F1, "counts-typed-as-the-predictions", None,
         edits=((COUNTS, "counts = torch.zeros(3, num_classes).type_as(pred)"),)),
    Case(F1, "score-broadcast-as-an-object", None,
         edits=((REDUCE_COUNTS, "dist.reduce(counts, dst=0)  # the totals on rank 0"),
                ("    tp, fp, fn = counts\n"
                 "    per_class = 2 * tp / (2 * tp + fp + fn).clamp(min=1)  "
                 "# 0 for a class nobody has\n"
                 "    " + SCORE + "\n",
                 "    box = [None]\n    if dist.get_rank() == 0:\n        tp, fp, fn = counts\n"
                 "        box[0] = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean().item()\n"
                 "    dist.broadcast_object_list(box, src=0)\n    score = box[0]\n"))),
        # the check's own number of ranks written in (passes its 2-rank run)
        # helper 147: a tensor made in the call, reduced, then never read
        Case(ACC, "reduced-a-stacked-copy", "was handed a new tensor: torch.stack(...)",
             edits=(("    dist.all_reduce(sums)  #", "    dist.all_reduce(torch.stack([sums[0], sums[1]]))  #"),)),  # noqa: E501
        Case(ACC, "world-size-written-as-2", "use dist.get_world_size()",
             edits=((SPLIT, "shard = Subset(dataset, range(rank, len(dataset), 2))"),)),
        Case(ACC, "world-set-to-2", "use dist.get_world_size()",
             edits=((SPLIT, "world = 2\n    " + SPLIT),)),
        Case(ACC, "padded-sampler-counts-a-sample-twice", "evaluated twice",
             edits=((SPLIT, PADDED),)),
        Case(ACC, "drop-last-skips-the-remainder", "never evaluated",
             edits=((SPLIT, PADDED.replace("shuffle=False", "shuffle=False, drop_last=True")),)),
        Case(ACC, "no-all-reduce-each-rank-its-own-shard", "each rank counted only its own shard",
             edits=(("dist.all_reduce(sums)", "pass  # dist.all_reduce(sums)"),)),
        # helper 70: the count set right by hand hid the repeat; counts averaged by hand
        Case(ACC, "padded-sampler-count-overwritten", "was evaluated twice",
             edits=((SPLIT, PADDED), (ALL_REDUCE, "    dist.all_reduce(sums)\n"
                                                 "    sums[1] = len(dataset)\n"))),
        Case(ACC, "counts-divided-by-the-world-size", "divided by the world size after",
             edits=((ALL_REDUCE, "    dist.all_reduce(sums)\n    sums //= world\n"),)),
        # helper 164: the ranks' accuracies averaged, rounded back to a count, passed (6.97
        # rounds to 7); the check's 2 ranks written as `% 2` passed
        Case(ACC, "mean-of-the-ranks-accuracies", "the ranks' accuracies averaged",
             edits=((ALL_REDUCE,
                     "    acc = torch.tensor([float(sums[0]) / float(sums[1])], "
                     "dtype=torch.float64, device=device)\n"
                     "    dist.all_reduce(acc, op=dist.ReduceOp.AVG)\n"
                     "    sums[0], sums[1] = round(acc.item() * len(dataset)), len(dataset)\n"),)),
        Case(ACC, "ranks-written-as-modulo-2", "the number of ranks is written as 2",
             edits=((SPLIT, "shard = Subset(dataset, [i for i in range(len(dataset)) "
                            "if i % 2 == rank])"),)),
        Case(ACC, "contiguous-blocks-by-floor-division", None,  # helper 166: `// world`
             edits=((SPLIT, "n = len(dataset)\n"
                            "    shard = Subset(dataset, range(rank * n // world, (rank + 1) * n "
                            "// world))"),)),
        Case(F1, "counts-made-under-a-device-context", None,  # helper 166
             edits=(("    " + COUNTS + "\n", "    with torch.device(pred.device):\n"
                     "        counts = torch.zeros(3, num_classes, dtype=torch.float64)\n"),)),
        Case(ACC, "averaged-integer-counts", "with the default SUM",
             edits=(("dist.all_reduce(sums)", "dist.all_reduce(sums, op=dist.ReduceOp.AVG)"),)),
        # helper 109: the stub's hints, model.eval() and torch.no_grad(), never checked
        Case(ACC, "left-in-training-mode", "evaluated in training mode",
             edits=(("    model.eval()\n", ""),)),
        Case(ACC, "gradients-on", "ran with gradients on",
             edits=(("    with torch.no_grad():\n", "    if True:\n"),)),
        # helper 109: only the TP row added up: FP and FN stay each rank's own
        # helper 147: the sum on rank 0, the score broadcast from it - right
        Case(F1, "right-reduce-then-broadcast-the-score", None,
             edits=(("    dist.all_reduce(counts)  # counts add up over ranks; F1 scores do not\n"
                     "    tp, fp, fn = counts\n"
                     "    per_class = 2 * tp / (2 * tp + fp + fn).clamp(min=1)  "
                 "# 0 for a class nobody has\n"  # noqa: E501
                     "    score = per_class.mean().item()\n",
                     "    dist.reduce(counts, dst=0)\n"
                     "    out = torch.zeros(1, dtype=torch.float64, device=pred.device)\n"
                     "    if dist.get_rank() == 0:\n"
                     "        tp, fp, fn = counts\n"
                     "        out[0] = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean()\n"
                     "    dist.broadcast(out, src=0)\n"
                     "    score = out.item()\n"),)),
        Case(F1, "tp-once-in-the-denominator", "the denominator counts TP once",
             edits=(("2 * tp / (2 * tp + fp + fn).clamp(min=1)", "2 * tp / (tp + fp + fn).clamp(min=1)"),)),  # noqa: E501
        Case(F1, "integer-division", "integer division",
             edits=(("2 * tp / (2 * tp + fp + fn).clamp(min=1)", "2 * tp // (2 * tp + fp + fn).clamp(min=1)"),)),  # noqa: E501
        Case(F1, "only-tp-added", "counts only partly added over the ranks (TP added",
             edits=(("    dist.all_reduce(counts)  #", "    dist.all_reduce(counts[0])  #"),)),
        # helper 139: a confusion matrix from a bincount without minlength (torch's raw error)
        Case(F1, "bincount-without-minlength", "torch.bincount(..., minlength=k * k)",
             edits=(("    " + COUNTS + "\n"
                     "    for c in range(num_classes):\n"
                     "        counts[0, c] = ((pred == c) & (target == c)).sum()  # TP\n"
                     "        counts[1, c] = ((pred == c) & (target != c)).sum()  # FP\n"
                     "        counts[2, c] = ((pred != c) & (target == c)).sum()  # FN\n"
                     "    dist.all_reduce(counts)  # counts add up over ranks; F1 scores do not\n"
                     "    tp, fp, fn = counts\n",
                     "    k = num_classes\n"
                     "    conf = torch.bincount(target.long() * k + pred.long()).reshape(k, k)\n"
                     "    conf = conf.double()\n    dist.all_reduce(conf)\n"
                     "    tp = conf.diagonal()\n"
                     "    fp, fn = conf.sum(0) - tp, conf.sum(1) - tp\n"),)),
        Case(F1, "mean-of-the-ranks-f1", "the mean of the ranks' own F1s",
             edits=((REDUCE_COUNTS, "pass"),
                    (SCORE, "mine = per_class.mean().reshape(1)\n    dist.all_reduce(mine)\n"
                            "    score = mine.item() / dist.get_world_size()"))),
        Case(F1, "no-all-reduce-own-shard-only", "the F1 of its own shard only",
             edits=((REDUCE_COUNTS, "pass"),)),
        Case(F1, "micro-instead-of-macro", "the micro F1",
             edits=((SCORE, MICRO),)),
        Case(ACC, "counted-the-batch-size", "count len(y) per batch",
             edits=(("torch.tensor(len(y), device", "torch.tensor(batch_size, device"),)),
        # from a learner review: each named for what it is
        # helper 116: MAX of 6 and 5 is 6, round(11 / 2): it was named as an average
        Case(ACC, "counts-maxed", "combined with ReduceOp.MAX",
             edits=(("    dist.all_reduce(sums)  #",
                     "    dist.all_reduce(sums, op=dist.ReduceOp.MAX)  #"),)),
        # helper 116: .float() in the call: the verdict sent the learner to move the call
        Case(ACC, "a-copy-reduced", "worked on that copy in place",
             edits=(("    dist.all_reduce(sums)  #", "    dist.all_reduce(sums.float())  #"),)),
        Case(F1, "a-copy-reduced", "worked on that copy in place",
             edits=((REDUCE_COUNTS, REDUCE_COUNTS.replace("(counts)", "(counts.clone())")),)),
        Case(ACC, "float-sums-averaged", "were averaged (ReduceOp.AVG)",
             edits=(("    dist.all_reduce(sums)  #", "    sums = sums.double()\n"
                     "    dist.all_reduce(sums, op=dist.ReduceOp.AVG)  #"),)),
        Case(ACC, "every-rank-the-whole-set", "every rank evaluated the whole set",
             edits=((SPLIT, "shard = dataset"), ("    dist.all_reduce(sums)  #", "    #"))),
        Case(ACC, "rank-0-alone", "evaluated the whole set alone",
             edits=((SPLIT, "shard = dataset if rank == 0 else Subset(dataset, [])"),)),
        Case(ACC, "all-reduce-before-the-loop", "after the loop",
             edits=(("    dist.all_reduce(sums)  #", "    #"),
                    ("    loader = DataLoader(shard", "    dist.all_reduce(sums)\n"
                     "    loader = DataLoader(shard"))),
        Case(ACC, "padded-sampler-gathered-and-deduplicated", None,  # right, the lesson's route
             text=GATHERED),
        # helper 98: shuffled with seed 42, the sampler's repeat is a wrong prediction, so a
        # count set by hand gave the right (correct, count); the pass came from the seed
        Case(ACC, "shuffled-padded-sampler-count-overwritten", "was evaluated twice",
             edits=((SPLIT, PADDED.replace("shuffle=False", "seed=42")),
                    (ALL_REDUCE, "    dist.all_reduce(sums)\n    sums[1] = len(dataset)\n"))),
        # helper 98: gloo aborts an all_gather of tensors of different lengths; was unnamed
        Case(F1, "own-predictions-all-gathered", "tensors of different sizes",
             edits=((REDUCE_COUNTS, "parts = [torch.empty_like(pred) for _ in "
                     "range(dist.get_world_size())]\n    dist.all_gather(parts, pred)"),)),
        Case(F1, "nan-for-the-class-nobody-has", "0 / 0 is nan",
             edits=((".clamp(min=1)", ""),)),
        Case(F1, "reduce-not-all-reduce", "dist.reduce leaves",
             edits=((REDUCE_COUNTS, "dist.reduce(counts, dst=0)"),)),
        Case(F1, "averaged-integer-counts", "with the default SUM",
             edits=(("dtype=torch.float64, device=pred.device)", "dtype=torch.int64)"),
                    (REDUCE_COUNTS, "dist.all_reduce(counts, op=dist.ReduceOp.AVG)"))),
        Case(F1, "score-on-rank-0-only", "every rank must compute it",
             edits=((SCORE, "if dist.get_rank() == 0:\n        " + SCORE),)),
        # from a second learner review: an async all_reduce, its tensor read before the wait
        Case(F1, "counts-read-before-the-wait", "the counts were read before the .wait()",
             edits=(("    dist.all_reduce(counts)  #",
                     "    work = dist.all_reduce(counts, async_op=True)  #"),
                    ("    score = per_class.mean().item()\n",
                     "    score = per_class.mean().item()\n    work.wait()\n"))),
        # from a fifth learner review: a collective per batch; an async sum never waited on
        Case(ACC, "all-reduce-per-batch", "a collective per batch",
             edits=(("            sums += torch.stack([right, torch.tensor(len(y), device=de"
                     "vice)])\n    dist.all_reduce(sums)",
                     "            batch = torch.stack([right, torch.tensor(len(y), device=de"
                     "vice)])\n"
                     "            dist.all_reduce(batch)\n            sums += batch\n"
                     "    pass"),)),
        Case(ACC, "async-sum-never-waited", "was not waited on before the counts were read",
             edits=(("    dist.all_reduce(sums)",
                     "    work = dist.all_reduce(sums, async_op=True)"),)),
        Case(F1, "int64-counts", None,  # right: float32 F1s from integer counts
             edits=((COUNTS,
                     COUNTS.replace("float64", "int64")),)),
        Case(F1, "classes-nobody-has-left-out", "the mean over the classes that occur",
             edits=(("score = per_class.mean().item()",
                     "score = per_class[(2 * tp + fp + fn) > 0].mean().item()"),)),
        # from a seventh learner review: FN counted as FP (macro precision); the last class
        # left out of the loop - both passed while every class had FP == FN and the class on
        # no rank was the last one
        Case(F1, "fn-counted-as-fp", "the macro precision",
             edits=(("counts[2, c] = ((pred != c) & (target == c)).sum()  # FN",
                     "counts[2, c] = ((pred == c) & (target != c)).sum()  # FN"),)),
        # from a twenty-fifth-session learner review: other collectives that add the counts
        # (right), and wrong ones that were told "without a collective" or another mistake
        Case(ACC, "all-gather-object-of-the-pairs", None,
             edits=((ALL_REDUCE,
                     "    pairs = [None] * world\n"
                     "    dist.all_gather_object(pairs, (int(sums[0]), int(sums[1])))\n"
                     "    sums = torch.tensor([sum(p[0] for p in pairs), "
                     "sum(p[1] for p in pairs)])\n"),)),
        Case(ACC, "reduce-then-broadcast", None,
             edits=((ALL_REDUCE,
                     "    dist.reduce(sums, dst=0)\n    dist.broadcast(sums, src=0)\n"),)),
        Case(ACC, "all-gather-into-tensor", None,
             edits=((ALL_REDUCE,
                     "    out = torch.empty(world * 2, dtype=sums.dtype, device=sums.device)\n"
                     "    dist.all_gather_into_tensor(out, sums)\n"
                     "    sums = out.view(world, 2).sum(0)\n"),)),
        Case(ACC, "broadcast-only", "it adds nothing",
             edits=((ALL_REDUCE, "    dist.broadcast(sums, src=0)\n"),)),
        Case(ACC, "reduce-without-broadcast", "dist.reduce leaves the added counts on its dst",
             edits=((ALL_REDUCE, "    dist.reduce(sums, dst=0)\n"),)),
        Case(ACC, "gathered-plus-its-own", "rank 0's never, rank 1's twice",
             edits=((ALL_REDUCE,
                     "    parts = [torch.zeros_like(sums) for _ in range(world)]\n"
                     "    dist.all_gather(parts, sums)\n"
                     "    sums = sums + sum(p for i, p in enumerate(parts) if i != 0)\n"),)),
        Case(F1, "f1s-weighted-by-shard-size", "weighted by their shard sizes",
             edits=((F1_FROM_ADDED,
                     "tp, fp, fn = counts\n"
                     "    mine = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean()\n"
                     "    both = torch.stack([mine * len(pred), torch.tensor(float(len(pred)), "
                     "dtype=torch.float64)])\n"
                     "    dist.all_reduce(both)\n"
                     "    score = (both[0] / both[1]).item()"),)),
        Case(F1, "precision-and-recall-averaged", "precisions and recalls averaged",
             edits=((F1_FROM_ADDED,
                     "tp, fp, fn = counts\n"
                     "    pr = torch.stack([tp / (tp + fp).clamp(min=1), "
                     "tp / (tp + fn).clamp(min=1)])\n"
                     "    dist.all_reduce(pr)\n"
                     "    pr /= dist.get_world_size()\n"
                     "    p, r = pr\n"
                     "    score = (2 * p * r / (p + r).clamp(min=1e-12)).mean().item()"),)),
        Case(F1, "last-class-left-out", "the loop must go over range(num_classes)",
             edits=(("    for c in range(num_classes):", "    for c in range(num_classes - 1):"),)),
        Case(F1, "counts-for-the-classes-seen", "only the classes a rank saw",
             edits=((COUNTS,
                     "seen = int(max(pred.max(), target.max())) + 1  # the classes this rank saw\n"
                     "    counts = torch.zeros(3, seen, dtype=torch.float64)"),
                    ("    for c in range(num_classes):", "    for c in range(seen):"))),
        # helper 133: both got the generic "expected the macro F1"
        Case(F1, "weighted-by-support", "weighted by each class's support",
             edits=(("    score = per_class.mean().item()",
                     "    support = tp + fn\n"
                     "    score = ((per_class * support).sum() / support.sum()).item()"),)),
        Case(F1, "absent-class-scores-1", "zero_division=1",
             edits=(("    per_class = 2 * tp / (2 * tp + fp + fn).clamp(min=1)",
                     "    denom = 2 * tp + fp + fn\n"
                     "    per_class = torch.where(denom > 0, 2 * tp / denom.clamp(min=1), 1.0)"),)),
        # helper 156: passed while the last class occurred in the data
        Case(F1, "classes-counted-from-the-data", "not the ones the data shows",
             edits=(("    " + COUNTS + "\n",
                     "    seen = torch.tensor(int(max(pred.max(), target.max())) + 1)\n"
                     "    dist.all_reduce(seen, op=dist.ReduceOp.MAX)\n"
                     "    num_classes = int(seen)\n"
                     "    " + COUNTS + "\n"),)),
    ]
)  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)


def test_the_ranks_written_as_the_checks_number_are_told_apart():
    """The check runs 2 ranks (lesson 10's, 3): that number written for the world size passes
    its runs; each way of writing it is named, not a 2 that means something else."""
    import re

    from ddp_tutorial.exercises.core import ranks_written_as

    pattern = ranks_written_as(2)
    wrong = [
        "range(rank, len(dataset), 2)",
        "order[rank::2]",
        "if i % 2 == rank",
        "DistributedSampler(ds, num_replicas=2)",
        "world = 2",
        "world_size=2",
    ]
    right = ["range(rank, len(dataset), world)", "x.view(2, -1)", "torch.zeros(2)",
             "round(acc, 2)", "x % 2.5", "batch_size=2"]  # fmt: skip
    assert all(re.search(pattern, text) for text in wrong)
    assert not any(re.search(pattern, text) for text in right)
    assert re.search(ranks_written_as(3), "rest[rank::3]") and not re.search(
        ranks_written_as(3), "rest[rank::world_size]"
    )
