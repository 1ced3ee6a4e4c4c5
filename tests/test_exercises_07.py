"""Lesson 07's exercise: plausible wrong answers, each a small edit of the reference solution,
and the mistake each must be named with (checked in one batched launch, conftest)."""

from __future__ import annotations

import pytest
from exercise_cases import BY_NAME, Case, assert_verdict, register

TIMING = "07_honest_timing"
REDUCE = "    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)"
APP = "            times.append(time.perf_counter() - start)\n"
OWN_SYNC = "        if torch.cuda.is_available():\n            torch.cuda.synchronize()\n"

CASES = register(
    [
        # helper 171: right for this check's numbers only
        Case(TIMING, "the-slowest-calls-dropped", "the slowest calls dropped, not the first ones",
             edits=(("        if i >= warmup:  # the first calls are warm-up: not the speed "
                     "you keep\n" + APP,
                     "        times.append(time.perf_counter() - start)\n"
                     "    times = sorted(times)[:steps]  # the warm-up calls: the slow ones\n"),)),
        Case(TIMING, "the-warm-up-written-in", "the warm-up's 2 calls (or the 5 steps)",
             edits=(("        if i >= warmup:", "        if i >= 2:"),)),
        Case(TIMING, "the-last-steps-sliced", "the warm-up's 2 calls (or the 5 steps)",
             edits=(("        if i >= warmup:  # the first calls are warm-up: not the speed "
                     "you keep\n" + APP,
                     "        times.append(time.perf_counter() - start)\n"
                     "    times = times[-5:]\n"),)),
        Case(TIMING, "one-process-needs-no-collective", None,  # helper 177: world > 1 flagged
             edits=((REDUCE, "    world = dist.get_world_size()\n    if world > 1:\n"
                     "        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)"),)),
        Case(TIMING, "two-ranks-gathered", "the 2 ranks written in (a list of 2 outputs)",
             edits=((REDUCE, "    mine, other = torch.zeros_like(slowest), "
                     "torch.zeros_like(slowest)\n"
                     "    dist.all_gather([mine, other], slowest)\n"
                     "    slowest = torch.maximum(mine, other)"),)),
        # helper 148: named as something else before
        # helper 164: "the slowest rank's time" read as the slowest step; the lesson's own
        # GPU-guarded synchronize on the check's device (told "call synchronize()")
        Case(TIMING, "the-longest-step", "longest timed step, not its total",
             edits=((APP, APP + "    times = [max(times)]\n"),)),
        Case(TIMING, "the-longest-step-times-steps", "longest step x 5, not its total",
             edits=((APP, APP + "    times = [max(times)] * steps\n"),)),
        Case(TIMING, "own-cuda-synchronize-guarded", "a torch.cuda call of yours",
             edits=(("        synchronize()  # start with nothing queued\n",
                     OWN_SYNC),
                    ("        synchronize()  # the step's work has run, not only been queued\n",
                     OWN_SYNC))),
        Case(TIMING, "own-cpu-tensor-like-the-stubs", None,  # helper 166: 07 gets no tensor
             edits=((REDUCE, "    mine = torch.tensor([sum(times)], dtype=torch.float64)\n"
                     "    dist.all_reduce(mine, op=dist.ReduceOp.MAX)\n    slowest = mine"),)),
        Case(TIMING, "mean-of-gathered-times", "max() of the gathered times",
             edits=((REDUCE,
                     "    gathered = [torch.zeros_like(slowest) for _ in range(dist.get_world_size())]\n"  # noqa: E501
                     "    dist.all_gather(gathered, slowest)\n"
                     "    slowest = torch.stack(gathered).mean()  #"),)),
        Case(TIMING, "barriers-for-synchronize", "a dist.barrier() does not drain it",
             edits=(("        synchronize()  # start", "        dist.barrier()  #"),
                    ("        synchronize()  # the step's", "        dist.barrier()  #"))),
        # helper 153: the barrier aside, printed where no barrier was called
        Case(TIMING, "no-synchronize-after-the-step", "was still queued - call synchronize()",
             edits=(("        synchronize()  # the step's work has run, not only been queued\n",
                     ""),)),
        # helper 156: passed while every timed step cost the same
        Case(TIMING, "steps-times-the-median-step", "times a typical step",
             edits=((REDUCE,
                     "    slowest[0] = steps * sorted(times)[len(times) // 2]\n" + REDUCE),)),
        Case(TIMING, "clock-readings-appended", "the clock's readings themselves were added up",
             edits=(("times.append(time.perf_counter() - start)",
                     "times.append(time.perf_counter())"),)),
        # from an eighth learner review: the GPU's synchronize, not the one given
        Case(TIMING, "torch-cuda-synchronize", "call the synchronize that time_steps is given",
             edits=(("        synchronize()  # start with nothing queued",
                     "        torch.cuda.synchronize()  # start with nothing queued"),)),
        Case(TIMING, "no-synchronize", "still queued",
             edits=(("        synchronize()  # start with nothing queued\n", ""),
                    ("        synchronize()  # the step's work has run, not only been queued\n",
                     ""))),
        Case(TIMING, "warm-up-timed", "the warm-up was timed",
             edits=(("        if i >= warmup:", "        if True:"),)),
        Case(TIMING, "no-reduction", "the ranks reported different times",
             edits=((REDUCE, "    pass"),)),
        Case(TIMING, "sum-over-ranks", "adds up the ranks' times",
             edits=((REDUCE, "    dist.all_reduce(slowest)"),)),
        Case(TIMING, "rank-0s-time", "report the max over the ranks",
             edits=((REDUCE, "    dist.broadcast(slowest, src=0)"),)),
        Case(TIMING, "synchronize-only-after-warm-up-unsynced", "still queued when the clock",
             edits=(("        synchronize()  # start with nothing queued\n", ""),
                    ("        synchronize()  # the step's work has run, not only been queued\n",
                     "        if i >= warmup:\n            synchronize()\n"))),
        # helper 105: the warm-up untimed in a loop of its own, and no synchronize() after it
        Case(TIMING, "warm-up-loop-never-drained", "still queued when the clock",
             edits=(("    for i in range(warmup + steps):\n        synchronize()  # start with "
                     "nothing queued\n", "    for _ in range(warmup):\n        step()\n"
                     "    for i in range(warmup, warmup + steps):\n"),)),
        Case(TIMING, "one-timed-step-short", "an off-by-one",
             edits=(("        if i >= warmup:", "        if i > warmup:"),)),
        Case(TIMING, "one-timed-step-too-many", "the warm-up was timed",  # the second call's
             edits=(("        if i >= warmup:", "        if i >= warmup - 1:"),)),  # rebuild
        Case(TIMING, "cpu-time-clock", "time.perf_counter()",
             edits=(("        start = time.perf_counter()\n",
                     "        start = time.process_time()\n"),
                    ("times.append(time.perf_counter() - start)",
                     "times.append(time.process_time() - start)"))),
        Case(TIMING, "async-max-never-waited", "was never waited on",
             edits=(("dist.all_reduce(slowest, op=dist.ReduceOp.MAX)",
                     "dist.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=True)"),)),
        Case(TIMING, "sum-imported-by-name", "adds up the ranks' times",  # the spy sees it too
             edits=(BY_NAME,
                    (REDUCE, "    all_reduce(slowest)"))),
        Case(TIMING, "clock-started-once", "added up from one start",
             edits=(("    for i in range(warmup + steps):\n",
                     "    start = time.perf_counter()\n    for i in range(warmup + steps):\n"),
                    ("        start = time.perf_counter()\n", ""))),
        # from a twenty-fifth-session review: started after the warm-up, the sum of readings
        # from one start stays below 2.5 x all the work, and was told "the warm-up was timed"
        Case(TIMING, "clock-started-once-after-the-warm-up", "added up from one start",
             edits=(("        start = time.perf_counter()\n",
                     "        if i == warmup:\n            start = time.perf_counter()\n"),)),
        Case(TIMING, "clock-read-once-around-the-timed-steps", None,  # right: one difference
             edits=(("        start = time.perf_counter()\n",
                     "        if i == warmup:\n            start = time.perf_counter()\n"),
                    ("            times.append(time.perf_counter() - start)",
                     "            times = [time.perf_counter() - start]"))),
        # from a learner review
        Case(TIMING, "max-of-a-copy", "it reduced a copy",
             edits=((REDUCE, "    worst = slowest.clone()\n"
                             "    dist.all_reduce(worst, op=dist.ReduceOp.MAX)"),)),
        Case(TIMING, "milliseconds", "that is milliseconds",
             edits=(("times.append(time.perf_counter() - start)",
                     "times.append((time.perf_counter() - start) * 1000)"),)),
        Case(TIMING, "mean-step", "one step's work",
             edits=((REDUCE, REDUCE + "\n    slowest /= steps"),)),
        Case(TIMING, "rank-0-times-alone", "every rank times its own steps",
             edits=(("        if i >= warmup:", "        if i >= warmup and dist.get_rank() == 0:"),)),  # noqa: E501
        # from a sixth learner review: the MAX on rank 0 alone
        Case(TIMING, "reduce-then-broadcast", None,  # right: the MAX sent on from dst
             edits=(("    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)",
                     "    dist.reduce(slowest, dst=0, op=dist.ReduceOp.MAX)\n"
                     "    dist.broadcast(slowest, src=0)"),)),
        Case(TIMING, "reduce-not-all-reduce", "dist.reduce leaves the result on its dst rank",
             edits=(("    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)",
                     "    dist.reduce(slowest, dst=0, op=dist.ReduceOp.MAX)"),)),
    ]
)  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)


def test_readings_from_one_start_are_told_from_a_step_short_by_their_shape():
    """A loaded CI host: one timed step short (4 steps of about 0.1 s) matched "readings
    added up from one start" through two cumulative readings of 2 steps each (~ twice 2).
    Only every reading after one start, STEPS or more of them, adds up to that verdict."""
    from ddp_tutorial.exercises.lesson07 import STEPS, _from_one_start

    # the case the sum of two readings matched (r[6] - r[3]) + (r[7] - r[3]) ~ own: not it
    short = [0.00014, 0.44762, 0.80562, 0.91249, 0.99893, 0.99937, 1.11687, 1.1171, 1.20888,
             1.20928, 1.32255]  # fmt: skip
    own = sum(short[k + 1] - short[k] for k in (3, 5, 7, 9))
    assert not _from_one_start({"readings": short, "sent": [own]})
    start = 0.5  # the clock read once, then after each of the STEPS timed steps
    ends = [start + 0.08 * (k + 1) for k in range(STEPS)]
    own = sum(e - start for e in ends)
    assert _from_one_start({"readings": [0.1, start, *ends], "sent": [own]})
    assert not _from_one_start({"readings": [start, *ends[:-1]], "sent": [own]})


def test_the_warm_up_pattern_spares_right_lines():
    """The check calls with warmup=2, steps=5: those numbers written in pass its run only."""
    import re

    from ddp_tutorial.exercises.lesson07 import WARMUP_WRITTEN

    wrong = [
        "if i >= 2:",
        "if step > 1:",
        "if i < 2: continue",
        "times = times[2:]",
        "times[-5:]",
        "del times[:2]",
        "for _ in range(2):",
        "for i in range(2, 7):",
        "for i in range(7):",
    ]
    right = [
        "if i >= warmup:",
        "for _ in range(warmup):",
        "times[warmup:]",
        "if len(x) >= 20:",
        "for i in range(warmup + steps):",
        "x = 2.5 > 1.5",
        "if world > 1:",
        "if dist.get_world_size() > 1:",
        "if i >= 2 * warmup:",
    ]
    assert all(re.search(WARMUP_WRITTEN, line) for line in wrong)
    assert not any(re.search(WARMUP_WRITTEN, line) for line in right)
