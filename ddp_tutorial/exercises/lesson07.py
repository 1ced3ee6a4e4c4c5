"""Lesson 07's exercise: time a DDP step honestly.

``07_honest_timing``: the learner's ``time_steps(step, steps, warmup, synchronize)`` returns
the seconds the slowest rank took for ``steps`` calls of ``step()`` after ``warmup`` untimed
ones, the same number on every rank. The check gives each rank a device in miniature, as a
GPU behaves: ``step()`` only *queues* its work and returns at once; the work runs on the
device's own clock, and ``synchronize()`` waits until it is done. The first call queues a long
warm-up (what allocation, kernel choice and DDP's bucket building cost a real first step), the
second a shorter one (DDP's buckets rebuilt), and rank 1's device is slower than rank 0's, so
each habit of the lesson changes the number: warm-up untimed, synchronise before reading the
clock, the slowest rank (all_reduce MAX).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.spies import is_async, reduce_op, spying

STEPS, WARMUP = 5, 2
WORK_S = (0.005, 0.08)  # one step's device work on rank 0, on rank 1 (and beyond): a slower rank
# (4 steps against 5 of rank 1: 80 ms apart, 50 under the 95 % bound: a host's delay only adds)
# the first calls' extra work: a real first step allocates, picks kernels and builds DDP's
# buckets; the second rebuilds them in the order backward made the gradients (one step more
# timed, from either end of the warm-up, stands out)
WARMUP_S = (0.3, 0.2)
# one timed step is slower (a data-loading stall, a garbage collection): steps x the median
# (or the fastest) step estimates the total, it does not measure it (helper 156)
HICCUP_AT, HICCUP_S = WARMUP + 3, 0.2  # apart: 5 typical steps 400 ms, 4 steps and it 520
CPU_CLOCKS = ("process_time", "thread_time")  # the time this process computed, not waited
WALL_CLOCKS = ("perf_counter", "monotonic", "time")  # their readings by the learner are noted
_now = time.perf_counter  # the device's own clock: never one of the learner's readings
# the check's WARMUP (2) or STEPS (5) written in where the arguments belong (i >= 2, i > 1,
# times[2:], del times[:2], range(2) of warm-up calls, range(7)): right for this check's call
# only (not `world > 1`: helper 177)
WARMUP_WRITTEN = (
    r"\b(?!(?:world|world_size|nprocs?|ranks?)\b)\w+\s*(?:>=\s*2|>\s*1|<\s*2)(?![\w.]|\s*[*+])|"
    r"\[\s*-?[25]\s*:|\[\s*:\s*-?[25]\s*\]|range\(\s*(?:[25]|[25]\s*,\s*7|7)\s*\)"
)


def work_s(rank: int) -> float:
    return WORK_S[min(rank, len(WORK_S) - 1)]


def timed_work(rank: int) -> float:
    """The device work of a rank's STEPS timed steps: what an honest timing cannot go below."""
    return work_s(rank) * STEPS + HICCUP_S


class QueuedDevice:
    """A device in miniature: ``step()`` queues work and returns; ``synchronize()`` waits for it.

    ``busy_until`` is the moment (``time.perf_counter``) the queued work will have run: work
    queued while the device is busy starts when the work before it ends, as on a CUDA stream.
    """

    def __init__(self, rank: int) -> None:
        self.work, self.calls, self.syncs = work_s(rank), 0, 0
        self.synced_after_warmup = False  # a synchronize() between warm-up and timed calls
        self.busy_until = _now()

    def step(self) -> None:
        self.calls += 1
        extra = WARMUP_S[self.calls - 1] if self.calls <= len(WARMUP_S) else 0.0
        extra += HICCUP_S if self.calls == HICCUP_AT else 0.0
        self.busy_until = max(_now(), self.busy_until) + self.work + extra

    def synchronize(self) -> None:
        self.syncs += 1
        self.synced_after_warmup |= self.calls == WARMUP
        left = self.busy_until - _now()
        if left > 0:
            time.sleep(left)


@contextmanager
def noted_calls(notes: dict[str, Any], module: ModuleType) -> Iterator[None]:
    """Note the op of every ``dist.all_reduce`` the learner's ``module`` makes, its async calls
    and their waits, every read of a CPU-time clock (which does not count waiting), and the
    readings of a wall clock that the module's own code takes (``readings``)."""
    clocks = {n: getattr(time, n) for n in CPU_CLOCKS + WALL_CLOCKS}
    bound = [(a, n) for a, v in vars(module).items() for n, c in clocks.items() if v is c]
    own = vars(module)

    def note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Callable[[], None] | None:  # fmt: skip
        if name in ("reduce", "broadcast", "all_gather", "barrier"):  # reduce: on dst alone
            notes[name] += 1
            return None
        notes["ops"].append(reduce_op(args, kwargs))
        tensor = args[0] if args else kwargs.get("tensor")
        notes["sent"].append(float(tensor.sum()) if hasattr(tensor, "sum") else None)
        if not is_async(args, kwargs):
            return None
        notes["async"] += 1
        return lambda: notes.update(waits=notes["waits"] + 1)

    def clock(name: str) -> Any:
        def read() -> float:
            value = clocks[name]()
            if name in CPU_CLOCKS:
                notes["cpu_clock"] = name
            elif sys._getframe(1).f_globals is own:
                notes["readings"].append(value)
            return value

        return read

    places = [(time, n, n) for n in clocks] + [(module, a, n) for a, n in bound]
    for place, attr, name in places:
        setattr(place, attr, clock(name))
    try:
        with spying(("all_reduce", "reduce", "broadcast", "all_gather", "barrier"), note, module):
            yield
    finally:
        for place, attr, name in places:
            setattr(place, attr, clocks[name])


def run_timing(module: ModuleType, ctx: Context) -> Record:
    device = QueuedDevice(ctx.rank)
    notes: dict[str, Any] = {"ops": [], "async": 0, "waits": 0, "cpu_clock": None, "sent": [],
                             "reduce": 0, "broadcast": 0, "all_gather": 0, "barrier": 0,
                             "readings": []}  # fmt: skip
    with noted_calls(notes, module):
        got = module.time_steps(device.step, STEPS, WARMUP, device.synchronize)
    try:
        seconds = float(got)
    except (TypeError, ValueError):
        seconds = None
    return {"seconds": seconds, "returned": repr(got)[:80], "calls": device.calls,
            "syncs": device.syncs, "synced_after_warmup": device.synced_after_warmup,
            **notes}  # fmt: skip


def _judge_habits(records: list[Record]) -> str | None:
    """A CPU-time clock, an all_reduce never waited for: named before the numbers they skew."""
    for rank, rec in enumerate(records):
        if rec["cpu_clock"]:
            return (f"rank {rank} read time.{rec['cpu_clock']}(), the CPU time this process "
                    "used: it does not count the time spent waiting in synchronize() or for the "
                    "device - time a step by the wall clock, time.perf_counter()")  # fmt: skip
        if rec["async"] > rec["waits"]:
            return (f"rank {rank}'s all_reduce(..., async_op=True) was never waited on: it "
                    "returns before the other ranks' times have arrived, so the tensor may "
                    "still hold this rank's own - call it without async_op (or .wait() on "
                    "what it returns before reading the tensor)")  # fmt: skip
    return None


def _estimated(value: float, slowest: float) -> str | None:
    """STEPS times a typical step (the median's, the fastest's) instead of their sum."""
    typical = (slowest - HICCUP_S) / STEPS  # a step without the stall
    if -0.03 <= value / (STEPS * typical) - 1 <= 0.2:  # a host's delays only add (helper 157)
        return (f"{value * 1e3:.0f} ms: {STEPS} times a typical step, but one timed step took "
                f"{HICCUP_S * 1e3:.0f} ms longer (a stall, as data loading or a garbage "
                "collection makes): add up every timed step's time (or read the clock once "
                "around them all) - steps x the median or the fastest step estimates the "
                "total, it does not measure it")  # fmt: skip
    return None


def _longest(value: float, slowest: float) -> str | None:
    """The slowest rank's longest step (the stalled one), alone or times the steps."""
    longest = (slowest - HICCUP_S) / STEPS + HICCUP_S
    for times, said in ((1, "longest timed step"), (STEPS, f"longest step x {STEPS}")):
        if -0.03 <= value / (times * longest) - 1 <= 0.2:  # a host's delays only add
            return (f"{value * 1e3:.0f} ms: the slowest rank's {said}, not its total - each "
                    f"rank adds up its own {STEPS} timed steps, and the largest of those totals "
                    "(MAX over the ranks) is the job's time")  # fmt: skip
    return None


def _judge_value(value: float, mine: list[float], maxed: bool, drained: bool) -> str | None:
    """The reported time against each rank's device work: what each habit skipped adds or
    removes (``mine``: each rank's timed work, at least; ``maxed``: every rank reduced MAX;
    ``drained``: every rank synchronized between its warm-up and its first timed call)."""
    slowest = max(mine)
    everything = sum(WARMUP_S) + (STEPS + WARMUP) * slowest / STEPS  # all its work, warm-up too
    for unit, scale in (("milliseconds", 1e3), ("microseconds", 1e6), ("nanoseconds", 1e9)):
        if 0.95 * slowest <= value / scale <= 2.5 * everything:
            return (f"{value:.4g} for {STEPS} steps of at least {slowest:.2f} s of work: that "
                    f"is {unit} - time_steps returns seconds (time.perf_counter())")  # fmt: skip
    if value < 0.4 * min(mine):
        return (f"{value * 1e3:.1f} ms for {STEPS} steps whose work takes at least "
                f"{min(mine) * 1e3:.0f} ms: the clock was read while the work was still queued "
                "- call synchronize() before each clock reading (the one time_steps is given: "
                "it waits for the device the steps run on, a torch.cuda call of yours does "
                "not)")  # fmt: skip
    if value > 2.5 * everything:  # readings added up from one start: 3.5 s here; the warm-up
        # timed (0.78 s) stays below even with a CPU-bound job delaying every wake-up
        return (
            f"{value * 1e3:.0f} ms: more than the slowest device's whole work, warm-up "
            f"included ({everything * 1e3:.0f} ms) - were the clock's readings added up from "
            "one start? Read the clock at the start of each timed step (after synchronize()), "
            "or once around all the timed steps"
        )
    if value > slowest + 0.5 * WARMUP_S[0] and not drained:  # the clock untouched by it
        return (
            f"{value * 1e3:.0f} ms for {STEPS} steps of at most {slowest * 1e3:.0f} ms of work: "
            f"the {WARMUP} warm-up calls' work was timed: still queued when the clock started "
            "(no synchronize() after them), or the clock started before them - "
            "the warm-up calls first, then synchronize(), then start the clock"
        )
    if value > slowest + 0.5 * WARMUP_S[0]:  # one step more timed: + WARMUP_S[1]
        return (
            f"{value * 1e3:.0f} ms for {STEPS} steps of at most {slowest * 1e3:.0f} ms of work: "
            f"the warm-up was timed - run the first {WARMUP} calls untimed, and synchronize() "
            "before starting the clock, so that no warm-up work is still queued"
        )
    if maxed and 0.7 * (slowest - HICCUP_S) / STEPS <= value < 2 * slowest / STEPS:  # busy host
        return (f"{value * 1e3:.0f} ms: one step's work, not {STEPS} - report the total of the "
                f"{STEPS} timed steps (not their mean, nor the longest)")  # fmt: skip
    if value < 0.5 * slowest and maxed:
        return (f"{value * 1e3:.0f} ms, though every rank reduced with MAX; the slowest "
                f"rank's {STEPS} steps take at least {slowest * 1e3:.0f} ms: does every rank "
                "time its own steps (not only rank 0)?")  # fmt: skip
    if value < 0.5 * slowest:
        return (
            f"{value * 1e3:.0f} ms, but the slowest rank's {STEPS} steps take at least "
            f"{slowest * 1e3:.0f} ms: report the max over the ranks (all_reduce with "
            "op=ReduceOp.MAX), not one rank's time"
        )
    if maxed and (mistake := _estimated(value, slowest)):
        return mistake
    if value < 0.95 * slowest:  # the device's work only adds time: a right answer is >= it
        timed = value / (slowest / STEPS)
        return (
            f"{value * 1e3:.0f} ms: about {timed:.0f} steps' work, not {STEPS} - the clock "
            f"must cover every one of the {STEPS} calls after the {WARMUP} warm-up ones "
            "(an off-by-one: i >= warmup, not i > warmup)"
        )
    return None


def _from_one_start(rec: Record) -> bool:
    """Did this rank add up clock readings all taken from one start? Its own total (what it
    handed to the all_reduce) equals sum(r[i] - r[j]) over every reading after one r[j],
    STEPS or more of them: each step's time counted again in every later one. Only that
    shape: sums of shorter runs match other answers by chance (one timed step short, its
    4 steps ~ twice 2; seen on a loaded host), and a right answer reads the clock twice per
    step, or once around all the timed steps (one difference)."""
    r, own = rec.get("readings", []), rec["sent"][-1] if rec.get("sent") else None
    return own is not None and any(
        abs((total := sum(x - r[j] for x in r[j + 1 :])) - own) <= 1e-6 * max(total, 1e-3)
        for j in range(len(r) - STEPS)
    )


def _raw_readings(rec: Record) -> bool:
    """Did this rank add up the clock's readings themselves (times since some start: the
    machine's boot for perf_counter), not durations? Its own total is then at least STEPS
    of its smallest reading, which no sum of durations of these steps comes near (helper 148)."""
    r, own = rec.get("readings", []), rec["sent"][-1] if rec.get("sent") else None
    return own is not None and bool(r) and min(r) > 0 and own >= 0.999 * STEPS * min(r)


def _judge_records(records: list[Record], values: list[float], mine: list[float],
                   maxed: bool) -> str | None:  # fmt: skip
    """What each rank's own readings and calls show (helper 148): the clock's readings added
    up, a gathered time that is not the largest, every rank's clock read before its work."""
    slowest = max(mine)
    if any(_raw_readings(rec) for rec in records):
        return (f"{values[0]:.4g} s: the clock's readings themselves were added up - "
                "time.perf_counter() gives a time since some start, not a duration: append "
                "end - start for each timed step (or read it once before and once after "
                "them all)")  # fmt: skip
    gathered = any(rec.get("all_gather") for rec in records)
    if gathered and not maxed and values[0] < 0.95 * slowest:
        return (f"{values[0] * 1e3:.0f} ms, less than the slowest rank's work alone "
                f"({slowest * 1e3:.0f} ms): you gathered every rank's time, then reported "
                "something else than the largest - the job moves at its slowest rank's pace: "
                "max() of the gathered times (or all_reduce with op=ReduceOp.MAX)")  # fmt: skip
    own = [rec["sent"][-1] if rec.get("sent") else None for rec in records]
    low = values[0] < 0.4 * min(mine)  # what was returned too: a mean sent, x STEPS, is right
    if low and maxed and all(o is not None and o < 0.4 * m for o, m in zip(own, mine, strict=True)):
        barrier = any(rec.get("barrier") for rec in records)  # the aside, where one was called
        return (f"{values[0] * 1e3:.1f} ms for {STEPS} steps whose work takes at least "
                f"{min(mine) * 1e3:.0f} ms on every rank: each rank read the clock while its "
                "work was still queued"
                + (" (a dist.barrier() does not drain it either: it waits for the ranks, not "
                   "for the device)" if barrier else "")
                + " - call synchronize() before each clock reading (the one time_steps "
                "is given: a torch.cuda call of yours does not wait for the check's "
                "device)")  # fmt: skip
    return None


def judge_timing(records: list[Record]) -> str | None:
    n = len(records)
    for rank, rec in enumerate(records):
        if rec["seconds"] is None:
            return f"rank {rank}'s time_steps returned {rec['returned']}, not a number of seconds"
        if rec["calls"] != STEPS + WARMUP:
            return (f"rank {rank} called step() {rec['calls']} times: {WARMUP} untimed warm-up "
                    f"calls, then {STEPS} timed ones")  # fmt: skip
    if mistake := _judge_habits(records):
        return mistake
    if any(rec.get("reduce") and not rec.get("broadcast") for rec in records):
        return ("dist.reduce leaves the result on its dst rank alone, and the other ranks keep "
                "their own time: every rank must return the slowest time - "
                "dist.all_reduce(..., op=ReduceOp.MAX) (or broadcast it from dst after the "
                "reduce)")  # fmt: skip
    idle = [rank for rank, rec in enumerate(records) if rec["sent"] and rec["sent"][-1] == 0]
    if idle and len(idle) < n:  # what a rank handed to the all_reduce: it timed nothing
        return (f"rank {idle[0]} timed no step (it reduced 0 s): every rank times its own "
                "steps, not only rank 0 - the MAX then finds the slowest")  # fmt: skip
    values = [rec["seconds"] for rec in records]
    mine = [timed_work(r) for r in range(n)]  # each rank's timed device work, at least
    slowest = max(mine)
    if values[0] <= 0:
        return f"time_steps returned {values[0]}: no step was timed"
    maxed = all("MAX" in rec["ops"] for rec in records)
    if any(v != values[0] for v in values):
        said = ", ".join(f"rank {r} {v * 1e3:.1f} ms" for r, v in enumerate(values))
        if maxed:
            return (f"the ranks reported different times ({said}), though each called "
                    "all_reduce with MAX: it reduced a copy - reduce the tensor you return, "
                    "in place")  # fmt: skip
        return (f"the ranks reported different times ({said}): report the slowest rank's on "
                "every rank - all_reduce it with op=ReduceOp.MAX")  # fmt: skip
    wrong_ops = sorted({op for rec in records for op in rec["ops"]} - {"MAX"})
    if wrong_ops:
        what = {
            "SUM": "adds up the ranks' times (or averages them, once divided)",
            "AVG": "averages the ranks' times",
        }
        return (f"all_reduce with {wrong_ops[0]} {what.get(wrong_ops[0], 'is not the slowest')}"
                f" (you reported {values[0] * 1e3:.0f} ms; the slowest rank's work alone takes "
                f"at least {slowest * 1e3:.0f} ms): the job moves at its slowest rank's pace - "
                "op=ReduceOp.MAX")  # fmt: skip
    if mistake := _judge_records(records, values, mine, maxed):
        return mistake
    if any(_from_one_start(rec) for rec in records):
        return (f"{values[0] * 1e3:.0f} ms: the clock's readings were added up from one start "
                "- each step's time counted again in every later one. Read the clock at the "
                "start of each timed step (after synchronize()), or once around all the timed "
                "steps")  # fmt: skip
    drained = all(rec["synced_after_warmup"] for rec in records)
    if maxed and (mistake := _longest(values[0], slowest)):  # h. 164: "the slowest" misread
        return mistake
    return _judge_value(values[0], mine, maxed, drained)


def measured(records: list[Record]) -> str:
    """On a pass, the time reported against the slowest rank's own work."""
    slowest = max(timed_work(r) for r in range(len(records)))
    return (f"you reported {records[0]['seconds'] * 1e3:.0f} ms for {STEPS} steps; the slowest "
            f"rank's work alone takes {slowest * 1e3:.0f} ms")  # fmt: skip


EXERCISES = [
    Exercise(
        name="07_honest_timing", lesson="07", run=run_timing, judge=judge_timing,
        title="an honest DDP step time: warm-up untimed, synchronised clocks, the slowest rank",
        teaches='lesson 07, "Timing a step honestly"', report=measured,
        hidden=(  # helper 171: right for this check's numbers only
            (r"sorted\([^\n]*\)\s*\[\s*:", "the slowest calls dropped, not the first ones: "
             "a stall longer than the warm-up's extra time is dropped and a warm-up call kept "
             "- time only the calls after the warm-up (times[warmup:], or i >= warmup)"),
            (WARMUP_WRITTEN, f"the warm-up's {WARMUP} calls (or the {STEPS} steps) written "
             "in, this check's numbers: called with warmup=10 or steps=20, the wrong calls "
             "would be timed - use the arguments (i >= warmup, times[warmup:])"),
            (r"all_gather\(\s*\[\s*\w+\s*,\s*\w+\s*\]", "the 2 ranks written in (a list of "
             "2 outputs): on 4 ranks all_gather refuses it - all_reduce(slowest, "
             "op=dist.ReduceOp.MAX) takes any number of ranks"),
        ),
        errors=(("Found no NVIDIA driver", "torch.cuda.synchronize() on a machine without a "
                 "GPU: call the synchronize that time_steps is given - it waits for whatever "
                 "device the steps run on (the check's is the CPU; on a GPU, pass lambda: "
                 "torch.cuda.synchronize(device))"),),
        proves=(
            "the wall clock read after synchronize(), the warm-up untimed, the slowest rank's "
            "time (MAX) on every rank, no less than the slowest rank's work"
        ),
    ),
]  # fmt: skip
