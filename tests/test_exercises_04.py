"""Lesson 04's exercises: plausible wrong answers, each a small edit of the reference solution,
and the mistake each must be named with (checked in one batched launch, conftest)."""

from __future__ import annotations

import pytest
from exercise_cases import BY_NAME, Case, assert_verdict, register

ACCUM, BUFFERS = "04_accumulate_no_sync", "04_average_buffers"
FLAT = """\
    flat = torch.cat([b.reshape(-1) for b in stats])  # a copy: one tensor, every statistic
    dist.all_reduce(flat)  # SUM over the ranks: one collective for every layer
    flat /= world
    for b, piece in zip(stats, flat.split([b.numel() for b in stats]), strict=True):
        b.copy_(piece.view_as(b))  # back into the model's own tensor, in place
"""
LOOP = """\
    for buffer in model.buffers():
        if buffer.is_floating_point():  # running_mean, running_var; not num_batches_tracked
            dist.all_reduce(buffer)  # SUM over the ranks, in place
            buffer /= world
"""
# the lesson's version, one all_reduce per buffer: the wrong answers below that edit it are
# named for their own mistake first (the values are checked before the collectives counted)
PER_BUFFER = (FLAT, LOOP)
WAITS, DIVIDE = (
    "    for work in works:\n        work.wait()\n",
    "    for b in stats:\n        b /= world\n",
)
ASYNC_LOOP = (
    "    stats = [b for b in model.buffers() if b.is_floating_point()]\n"
    "    works = [dist.all_reduce(b, async_op=True) for b in stats]\n" + WAITS + DIVIDE
)
INNER = '            (loss_fn(model(x), y, reduction="sum") * world / count).backward()'
LAST = ('    (loss_fn(model(x), y, reduction="sum") * world / count).backward()  # outside: one '
        "all_reduce")  # fmt: skip
NO_SYNC = (
    "        with model.no_sync():  # forward and backward in here: the gradients add up, unsent\n"
)
COUNT = (
    "    count = torch.tensor(float(sum(len(y) for _, y in micro_batches)), device=device)\n"
    "    dist.all_reduce(count)  # the step's samples over every rank, before the forwards\n"
)


def both(old: str, new: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The same change to every micro-batch's loss: the loop's line and the last one's."""
    return ((INNER, INNER.replace(old, new)), (LAST, LAST.replace(old, new)))


CASES = register(
    [
        # helper 174: right for this check's 2 ranks only
        Case(BUFFERS, "divided-by-2", "the sum is divided by 2, this check's number of ranks",
             edits=(("    flat /= world\n", "    flat /= 2  # two ranks\n"),)),
        Case(ACCUM, "two-times-the-loss", "the number of ranks is written as 2",
             edits=(('(loss_fn(model(x), y, reduction="sum") * world / count).backward()\n',
                     '(2 * loss_fn(model(x), y, reduction="sum") / count).backward()\n'),)),
        Case(ACCUM, "world-written-as-2", "the number of ranks is written as 2",
             edits=(("    world = dist.get_world_size()", "    world = 2"),)),
        Case(ACCUM, "times-2", "the number of ranks is written as 2",
             edits=(("* world / count).backward()\n", "* 2 / count).backward()\n"),
                    ("* world / count).backward()  #", "* 2 / count).backward()  #"))),
        # helper 146: a hang whose cause the learner's lines show, named (it read: "is one
        # under `if rank == ...`, or in a loop ..., or ... tensors of different shapes?")
        Case(BUFFERS, "all-reduce-on-rank-0-only", "dist.all_reduce() is under `if rank == 0`",
             edits=(("    dist.all_reduce(flat)  #",
                     "    if dist.get_rank() == 0:\n        dist.all_reduce(flat)  #"),)),
        # the exercise since the twelfth session: micro-batches of unequal sizes, ranks with
        # unequal totals (the lesson's accumulate, each mean / k, is a mean of means there)
        Case(ACCUM, "the-lessons-accumulate", "a mean of means",
             edits=both('loss_fn(model(x), y, reduction="sum") * world / count',
                        "loss_fn(model(x), y) / len(micro_batches)")),
        # from a twenty-fifth-session learner review
        Case(ACCUM, "count-reduced-to-rank-0", "dist.reduce leaves the summed count on its dst",
             edits=(("    dist.all_reduce(count)  # the step's",
                     "    dist.reduce(count, dst=0)  #"),)),
        Case(BUFFERS, "chunked-in-equal-pieces", "the pieces must be the buffers' own sizes",
             edits=(("flat.split([b.numel() for b in stats])", "flat.chunk(len(stats))"),)),
        Case(BUFFERS, "zipped-with-the-flat-tensor", "pairs each buffer with a single element",
             edits=(("zip(stats, flat.split([b.numel() for b in stats]), strict=True)",
                     "zip(stats, flat)"),
                    ("b.copy_(piece.view_as(b))", "b.copy_(piece)"))),
        Case(ACCUM, "each-rank-its-own-count", "each rank divided by its own sample count",
             edits=(("    dist.all_reduce(count)  # the step's samples over every rank, before "
                     "the forwards\n", ""),)),
        Case(ACCUM, "mean-loss-over-the-count", "already a mean over the micro-batch's samples",
             edits=both(', reduction="sum"', "")),
        Case(ACCUM, "not-times-the-world-size", "multiply by the world size",
             edits=both(" * world / count", " / count")),
        Case(ACCUM, "loss-summed-never-divided", "the loss is scaled wrong",
             edits=both(" * world / count", "")),
        Case(ACCUM, "count-hard-coded", "the first step was right, the second was not",
             edits=((COUNT, "    count = torch.tensor(24.0)  # 10 + 14 samples\n"),)),
        Case(ACCUM, "count-reduced-twice", "a second all_reduce of the same count doubles it",
             edits=((COUNT, COUNT + "    dist.all_reduce(count)\n"),)),
        # from a learner review of the new exercise (helper 55)
        Case(ACCUM, "count-async-never-waited", "was never waited on",
             edits=(("    dist.all_reduce(count)  #",
                     "    dist.all_reduce(count, async_op=True)  #"),)),
        Case(ACCUM, "count-async-waited", None,
             edits=(("    dist.all_reduce(count)  #",
                     "    dist.all_reduce(count, async_op=True).wait()  #"),)),
        Case(ACCUM, "count-a-python-int", "takes a tensor, not a Python number",
             edits=((COUNT, "    count = sum(len(y) for _, y in micro_batches)\n"
                            "    dist.all_reduce(count)\n"),)),
        Case(ACCUM, "count-gathered-as-objects", None,
             edits=((COUNT, "    counts = [None] * world\n"
                            "    mine = sum(len(y) for _, y in micro_batches)\n"
                            "    dist.all_gather_object(counts, mine)\n"
                            "    count = sum(counts)\n"),)),
        Case(ACCUM, "mean-times-its-share", None,  # right: a mean x len(y) is the sum
             edits=both('loss_fn(model(x), y, reduction="sum")', "loss_fn(model(x), y) * len(y)")),
        Case(ACCUM, "no-sync-on-every-micro-batch", "made no all_reduce",
             edits=((LAST, "    with model.no_sync():\n    " + LAST),)),
        Case(ACCUM, "no-no-sync-at-all", "wasted communication",
             edits=((NO_SYNC, "        if True:\n"),)),
        Case(ACCUM, "forward-outside-no-sync", "the forward too",
             edits=((NO_SYNC + INNER,
                     '        loss = loss_fn(model(x), y, reduction="sum") * world / count\n'
                     "        with model.no_sync():\n            loss.backward()"),)),
        Case(ACCUM, "a-step-per-micro-batch", "optimizer.step() ran",
             edits=((INNER + "\n", INNER + "\n            optimizer.step()\n"),)),
        Case(ACCUM, "forward-past-the-wrapper", "model.module(x) bypasses DDP's forward",
             edits=both("model(x)", "model.module(x)")),
        Case(ACCUM, "sync-on-the-first-micro-batch", "not the last",
             edits=(("    for x, y in micro_batches[:-1]:\n",
                     "    x, y = micro_batches[0]\n" + LAST.split("  #")[0] + "\n"
                     "    for x, y in micro_batches[1:-1]:\n"),
                    (LAST, "    with model.no_sync():\n    " + LAST))),
        Case(ACCUM, "one-backward-for-all", "ran one backward for its",
             edits=((NO_SYNC + INNER + "\n", "        pass\n"),
                    ("    x, y = micro_batches[-1]\n" + LAST,
                     '    (sum(loss_fn(model(x), y, reduction="sum") for x, y in micro_batches)'
                     " * world / count).backward()"))),
        Case(ACCUM, "every-forward-first", "run each micro-batch's forward and backward together",
             edits=(("    for x, y in micro_batches[:-1]:\n" + NO_SYNC + INNER + "\n"
                     "    x, y = micro_batches[-1]\n" + LAST,
                     "    losses = []\n    with model.no_sync():\n"
                     "        for x, y in micro_batches[:-1]:\n"
                     '            loss = loss_fn(model(x), y, reduction="sum")\n'
                     "            losses.append(loss * world / count)\n"
                     '    x, y = micro_batches[-1]\n'
                     '    losses.append(loss_fn(model(x), y, reduction="sum") * world / count)\n'
                     "    for loss in losses:\n        loss.backward()"),)),
        # helper 98: the parameters through the all_reduce too came back the same and passed
        # helper 102: the output of a gather is world x what a rank sends: right, one call
        Case(BUFFERS, "gathered-into-one-tensor-then-averaged", None,
             edits=(("    dist.all_reduce(flat)  # SUM over the ranks: one collective for every "
                     "layer\n    flat /= world\n",
                     "    parts = torch.empty(world * flat.numel(), dtype=flat.dtype,\n"
                     "                        device=flat.device)\n"
                     "    dist.all_gather_into_tensor(parts, flat)\n"
                     "    flat = parts.view(world, -1).mean(0)\n"),)),
        Case(BUFFERS, "state-dict-averaged-parameters-too", "the parameters too",
             edits=(("model.buffers() if b.is_floating_point()",
                     "model.state_dict().values() if b.is_floating_point()"),)),
        Case(BUFFERS, "forgot-running-var", "running_var still differ",
             edits=(PER_BUFFER,
                    ("    for buffer in model.buffers():",
                     "    for name, buffer in model.named_buffers():"),
                    ("        if buffer.is_floating_point():",
                     '        if name.endswith("running_mean"):'))),
        Case(BUFFERS, "num-batches-tracked-divided", "integer counter",
             edits=(PER_BUFFER,
                    ("        if buffer.is_floating_point():  # running_mean, running_var; "
                     "not num_batches_tracked", "        if True:"),)),
        Case(BUFFERS, "only-on-rank-0", "waited",
             edits=(PER_BUFFER,
                    ("    for buffer in model.buffers():",
                     "    for buffer in model.buffers() if dist.get_rank() == 0 else []:"),)),
        Case(BUFFERS, "summed-not-averaged", "divide by the world size",
             edits=(PER_BUFFER,
                    ("            buffer /= world\n", ""),)),
        Case(BUFFERS, "divided-out-of-place", "makes a new tensor, which the model never sees",
             edits=(PER_BUFFER,
                    ("            buffer /= world\n", "            buffer = buffer / world\n"),)),
        Case(BUFFERS, "rank-0s-broadcast", "computed from rank 0's batches alone",
             edits=(PER_BUFFER,
                    ("            dist.all_reduce(buffer)  # SUM over the ranks, in place\n"
                     "            buffer /= world\n",
                     "            dist.broadcast(buffer, src=0)\n"),)),
        Case(BUFFERS, "async-imported-by-name-never-waited", "was never waited on",
             edits=(PER_BUFFER,
                    BY_NAME,
                    ("dist.all_reduce(buffer)", "all_reduce(buffer, async_op=True)"))),
        Case(BUFFERS, "async-never-waited", "was never waited on",
             edits=(PER_BUFFER,
                    ("dist.all_reduce(buffer)", "dist.all_reduce(buffer, async_op=True)"),)),
        # helper 116: the copy back under a rank branch: rank 1 kept its own, not the sum
        Case(BUFFERS, "copied-back-on-rank-0-only", "rank 1's statistics never changed",
             edits=(("    for b, piece in zip(stats, flat.split([b.numel() for b in stats]), "
                     "strict=True):\n",
                     "    for b, piece in zip(stats if dist.get_rank() == 0 else [], "
                     "flat.split([b.numel() for b in stats]), strict=False):\n"),)),
        # from a learner review
        Case(BUFFERS, "only-rank-0-divides", "every rank divides by the world size",
             edits=(PER_BUFFER,
                    ("            buffer /= world", "            if dist.get_rank() == 0:\n"
                     "                buffer /= world"),)),
        Case(BUFFERS, "parameters-not-buffers", "the statistics are buffers",
             edits=(PER_BUFFER,
                    ("    for buffer in model.buffers():", "    for buffer in model.parameters():"),)),  # noqa: E501
        # from a fifth learner review: k fitted to one call; every forward first
        # from a learner review: async sends, each tensor divided before its wait (a race
        # that passed one check in two); the same sends waited on first are right
        Case(BUFFERS, "divided-before-the-wait", "before the .wait()",
             edits=(PER_BUFFER,
                    (LOOP, ASYNC_LOOP), (WAITS + DIVIDE, DIVIDE + WAITS))),
        Case(BUFFERS, "async-all-then-wait-then-divide", "4 collectives on each rank",
             edits=(PER_BUFFER, (LOOP, ASYNC_LOOP))),
        # from a seventh learner review: waited through futures (right); AVG, then divided
        Case(BUFFERS, "waited-through-futures", "4 collectives on each rank",
             edits=(PER_BUFFER,
                    (LOOP, ASYNC_LOOP.replace(
                 WAITS, "    torch.futures.wait_all([w.get_future() for w in works])\n")),
                 ("import torch.distributed as dist\n",
                  "import torch\nimport torch.distributed as dist\n"))),
        Case(BUFFERS, "futures-taken-never-waited", "never waited on",
             edits=(PER_BUFFER,
                    (LOOP, ASYNC_LOOP.replace(
                 WAITS, "    futures = [w.get_future() for w in works]  # and nothing waits\n")),)),
        Case(BUFFERS, "averaged-twice", "averaged twice",
             edits=(PER_BUFFER,
                    ("            dist.all_reduce(buffer)  #",
                     "            dist.all_reduce(buffer, op=dist.ReduceOp.AVG)  #"),)),
        # the exercise since the twelfth session: one collective (the lesson shows one per buffer)
        Case(BUFFERS, "all-gather-per-buffer", "4 collectives on each rank",
             edits=((FLAT, "    for b in stats:\n"
                           "        gathered = [torch.empty_like(b) for _ in range(world)]\n"
                           "        dist.all_gather(gathered, b)\n"
                           "        b.copy_(torch.stack(gathered).mean(0))\n"),)),
        Case(BUFFERS, "reduce-then-broadcast", "2 collectives on each rank",
             edits=(("    dist.all_reduce(flat)  #", "    dist.reduce(flat, dst=0)\n"
                     "    dist.broadcast(flat, src=0)  #"),)),
        Case(BUFFERS, "the-lessons-version", "4 collectives on each rank for 4 statistics",
             edits=(PER_BUFFER,)),
        Case(BUFFERS, "flat-never-copied-back", "torch.cat (like .clone()) makes",
             edits=(("        b.copy_(piece.view_as(b))  # back into the model's own tensor, "
                     "in place\n", "        pass\n"),)),
        Case(BUFFERS, "flat-assigned-not-copied", "copy each piece of the reduced one back",
             edits=(("b.copy_(piece.view_as(b))", "b = piece.view_as(b)"),)),
        # helper 68: the offset never advanced; the verdict sent the learner after a variance
        Case(BUFFERS, "flat-copied-back-from-its-start", "an offset that advances",
             edits=(("    for b, piece in zip(stats, flat.split([b.numel() for b in stats]), "
                     "strict=True):\n        b.copy_(piece.view_as(b))",
                     "    offset = 0\n    for b in stats:\n"
                     "        b.copy_(flat[offset : offset + b.numel()].view_as(b))"),)),
        Case(BUFFERS, "flat-not-divided", "divide by the world size",
             edits=(("    flat /= world\n", ""),)),
        Case(BUFFERS, "flat-async-waited", None,
             edits=(("    dist.all_reduce(flat)  #",
                     "    dist.all_reduce(flat, async_op=True).wait()  #"),)),
        Case(BUFFERS, "flat-with-the-counter", None,  # int64 promoted; the same counts copied back
             edits=(("for b in model.buffers() if b.is_floating_point()]",
                     "for b in model.buffers()]"),)),
        # helper 155: named another mistake, or torch's raw error
        Case(BUFFERS, "reduced-not-all-reduced", "dist.reduce leaves the sum on its dst",
             edits=(("    dist.all_reduce(flat)  #", "    dist.reduce(flat, dst=0)  #"),)),
        Case(BUFFERS, "reduced-then-broadcast", "2 collectives on each rank",  # helper 157
             edits=(("    dist.all_reduce(flat)  #",
                     "    dist.reduce(flat, dst=0)\n    dist.broadcast(flat, src=0)  #"),)),
        # helper 161: collectives the check did not count passed; a read before the wait
        Case(BUFFERS, "per-buffer-through-distributed-c10d", "through a call this check does not",
             edits=(("    dist.all_reduce(flat)  #",
                     "    from torch.distributed import distributed_c10d as c10d\n\n"
                     "    c10d.all_reduce(flat)  #"),)),
        Case(BUFFERS, "copied-back-before-the-wait", "before its .wait()",
             edits=(("    dist.all_reduce(flat)  # SUM over the ranks: one collective for every "
                     "layer\n    flat /= world\n", "    work = dist.all_reduce(flat, "
                     "async_op=True)\n"),
                    ("        b.copy_(piece.view_as(b))  # back into the model's own tensor, in "
                     "place\n", "        b.copy_(piece.view_as(b) / world)\n    work.wait()\n"))),
        Case(ACCUM, "count-made-on-the-cpu", "a tensor made without device=",
             edits=((", device=device)\n    dist.all_reduce(count)",
                     ")\n    dist.all_reduce(count)"),)),
        Case(ACCUM, "count-moved-with-to", None,  # helper 166: .to(a tensor), no "device"
             edits=((", device=device)\n    dist.all_reduce(count)",
                     ")\n    count = count.to(micro_batches[0][0])\n    dist.all_reduce(count)"),)),
        Case(BUFFERS, "reduced-a-clone-async-waited", "was handed a new tensor",  # helper 166
             edits=(("    dist.all_reduce(flat)  #",
                     "    dist.all_reduce(flat.clone(), async_op=True).wait()  #"),)),
        Case(ACCUM, "integer-count-averaged", "an integer count divided in place",
             edits=(("count = torch.tensor(float(sum(len(y) for _, y in micro_batches)), "
                     "device=device)\n    dist.all_reduce(count)",
                     "count = torch.tensor(sum(len(y) for _, y in micro_batches))\n"
                     "    dist.all_reduce(count, op=dist.ReduceOp.AVG)"),)),
        Case(ACCUM, "count-from-the-first-micro-batch", "a count of 30 where the step has 24",
             edits=(("count = torch.tensor(float(sum(len(y) for _, y in micro_batches)), "
                     "device=device)",
                     "count = torch.tensor(float(len(micro_batches)\n"
                     "                                * len(micro_batches[0][1])))"),)),
    ]
)  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
