"""Lesson 08's exercise: SIGTERM -> every rank stops at one step -> rank 0 saves -> exit 75.

``08_preempt_save_exit`` (a script): the learner's file trains, and after step 5 the process of
rank 1 sends itself SIGTERM, as a cluster does when it preempts a job (only where a handler is
installed: without one SIGTERM ends the process at once, and the check would lose the rank).
Each rank reports where it stopped, what it saved (and whether from inside the handler), and
the status it would exit with; ``run`` adds the snapshot rank 0 left. A rank left alone in a
collective by one that stopped fails on the group's timeout, in ``loss.backward()``: named.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ddp_tutorial.exercises.core import Context, Exercise, Record

PREEMPT_AT, PREEMPT_RANK, EVERY = 5, 1, 10  # the stub's defaults; EVERY: the latest stop allowed
PREEMPTED = 75
HOLD_S = 0.5  # rank 0's torch.save is held this long: a rank that does not wait returns first


IN_HANDLER = "exited inside its SIGTERM handler"  # the error a wrapped handler's exit becomes
RAISED_IN_HANDLER = "raised inside its SIGTERM handler"  # ... and anything else it raised


COLLECTIVE_IN_HANDLER = "called a collective inside its SIGTERM handler"
HANDLER_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "reduce",
    "all_gather_object",
    "broadcast_object_list",
    "monitored_barrier",
)


class _CollectiveInHandler(RuntimeError):
    """A collective the learner's handler called: refused, so that it never meets a peer's
    collective of the loop by luck (helper 134: the handler's all_reduce met the other rank's
    flag all_reduce, and the run passed)."""


def _refused(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> None:
        raise _CollectiveInHandler(f"rank {COLLECTIVE_IN_HANDLER} (dist.{name})")

    return call


def _exit_raises(code: int) -> None:
    """os._exit inside the handler: a SystemExit there, named like sys.exit (it ended the rank
    with no trace: "the launch failed before your code ran")."""
    raise SystemExit(code)


def _wrapped(handler: Any) -> Any:
    """The learner's SIGTERM handler, with an exit from inside it turned into a named error
    (its frame stays on the stack under the learner's, so the stub still sees a save in it),
    and its collectives refused."""

    def sigterm(signum: int, frame: Any) -> Any:
        names = [n for n in HANDLER_COLLECTIVES if hasattr(dist, n)]
        try:
            with ExitStack() as stack:
                for name in names:
                    stack.enter_context(mock.patch.object(dist, name, _refused(name)))
                stack.enter_context(mock.patch.object(os, "_exit", _exit_raises))  # helper 162
                return handler(signum, frame)
        except _CollectiveInHandler:
            raise
        except SystemExit as stop:
            raise RuntimeError(f"rank {IN_HANDLER} (SystemExit {stop.code})") from stop
        except BaseException as exc:  # KeyboardInterrupt (default_int_handler), anything
            raise RuntimeError(f"rank {RAISED_IN_HANDLER} ({type(exc).__name__})") from exc

    return sigterm


@contextmanager
def preempt_watch(ctx: Context) -> Iterator[None]:
    """Around the learner's file: rank 0's first torch.save starts HOLD_S late (the others must
    still be waiting for it), and a SIGTERM handler's exit from inside itself is named. Rank 0
    gets the scheduler's SIGTERM too, later than rank 1 - at its first barrier (or all_reduce
    once its save has begun), if it has a handler (not in the middle of its own save: a
    handler's save there writes over the same temporary file): one that saves is then seen
    saving inside the handler (helper 117: signalled on rank 1 alone, a handler that saved on
    rank 0 passed)."""
    real_save, real_signal = torch.save, signal.signal
    real_barrier, real_monitored = dist.barrier, dist.monitored_barrier
    real_all_reduce = dist.all_reduce

    held: list[int] = []
    late: list[int] = []

    def signal_rank_0() -> None:
        if not late and callable(signal.getsignal(signal.SIGTERM)):
            late.append(1)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line

    def save(*args: Any, **kwargs: Any) -> None:
        if not held:  # the first save (the preemption's): a loop that saves on is named anyway
            held.append(1)
            time.sleep(HOLD_S)
        real_save(*args, **kwargs)

    def barrier(*args: Any, **kwargs: Any) -> Any:
        signal_rank_0()
        return real_barrier(*args, **kwargs)

    def monitored(*args: Any, **kwargs: Any) -> Any:  # helper 162: it waits too
        signal_rank_0()
        return real_monitored(*args, **kwargs)

    def all_reduce(*args: Any, **kwargs: Any) -> Any:  # helper 178: a wait by all_reduce
        if held:  # after the first save began: not the step's vote before it
            signal_rank_0()
        return real_all_reduce(*args, **kwargs)

    def install(signum: Any, handler: Any) -> Any:
        wrap = signum == signal.SIGTERM and callable(handler)
        return real_signal(signum, _wrapped(handler) if wrap else handler)

    with (mock.patch.object(torch, "save", save) if ctx.rank == 0 else nullcontext(),
          mock.patch.object(dist, "barrier", barrier) if ctx.rank == 0 else nullcontext(),
          mock.patch.object(dist, "monitored_barrier", monitored) if ctx.rank == 0
          else nullcontext(),
          mock.patch.object(dist, "all_reduce", all_reduce) if ctx.rank == 0 else nullcontext(),
          mock.patch.object(signal, "signal", install)):  # fmt: skip
        yield


def run_preempt(_: ModuleType | None, ctx: Context) -> Record:
    """This rank's report; on rank 0 also the snapshot's step."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the learner's file left installed
    path = ctx.out / f"report-rank{ctx.rank}.json"
    record: Record = {"report": json.loads(path.read_text()) if path.is_file() else None}
    snapshot = ctx.out / "snapshot.pt"
    if ctx.rank == 0 and snapshot.is_file():
        try:
            state = torch.load(snapshot, map_location="cpu", weights_only=True)
            model = state.get("model")
            record["snapshot"] = {"step": state.get("step"), "keys": sorted(state),
                                  "written_at": snapshot.stat().st_mtime,
                                  "wrapper": isinstance(model, dict) and any(
                                      k.startswith("module.") for k in model)}  # fmt: skip
        except Exception as exc:
            record["snapshot"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return record


def _judge_snapshot(records: list[Record], stop: int) -> str | None:
    """Rank 0's snapshot: it loads, holds the step the ranks stopped at, and nobody left early."""
    snapshot = records[0].get("snapshot")
    if not snapshot or "error" in snapshot:
        return f"rank 0's snapshot.pt does not load: {(snapshot or {}).get('error', 'missing')}"
    if snapshot.get("step") != stop:
        return (f"the snapshot says step {snapshot.get('step')}, but the ranks stopped at step "
                f"{stop}: save the step you stop at")  # fmt: skip
    if not {"model", "optimizer"} <= set(snapshot["keys"]):
        return (f"the snapshot holds {snapshot['keys']}: a resume needs the model and the "
                "optimizer's state too")  # fmt: skip
    if snapshot.get("wrapper"):
        return ("the snapshot's model keys start with 'module.' (DDP's wrapper): save "
                "model.module.state_dict(), the plain model inside "
                '(lesson 05, "4 · `module.` and `_orig_mod.`")')  # fmt: skip
    # with the barrier a rank returns after the write; without, about HOLD_S before it (0.1 s
    # spares the file system's coarser clock, and leaves a loaded host 0.4 s to tell them apart)
    early = [r["report"]["rank"] for r in records
             if r["returned_at"] < snapshot["written_at"] - 0.1]  # fmt: skip
    if early:
        return (f"rank {early[0]} left the loop (and the script) while rank 0 was still writing "
                "the snapshot: every rank waits at dist.barrier() after rank 0's save - a rank "
                "that exits first lets torchrun stop the job, rank 0 in mid-save")  # fmt: skip
    return None


def _judge_saves(records: list[Record], stop: int) -> str | None:
    """Who called save_snapshot, and how often: rank 0, once."""
    reports = [r["report"] for r in records]
    writers = [rep["rank"] for rep in reports if rep["saves"]]
    if len(writers) > 1:
        return (f"ranks {writers} each saved a snapshot: only global rank 0 saves (`if rank == "
                "0`); the others wait for it")  # fmt: skip
    if writers and writers != [0]:
        return (f"rank {writers[0]} saved the snapshot: only global rank 0 saves (`if rank == "
                "0`), after every rank has agreed to stop")  # fmt: skip
    if writers != [0] and records[0].get("snapshot"):
        return ("rank 0 wrote snapshot.pt without save_snapshot: call save_snapshot(out / "
                '"snapshot.pt", {...}) - it writes atomically, and the check counts its '
                "calls")  # fmt: skip
    if writers != [0]:
        return (f"no snapshot of step {stop}: rank 0 must save (save_snapshot) before the "
                "ranks exit, or the work since the last snapshot is lost")  # fmt: skip
    saved = [s["step"] for s in reports[0]["saves"] if s["step"] >= PREEMPT_AT]  # periodic
    if len(saved) > 1:  # saves before the signal are no mistake (helper 162)
        unset = " - set status = PREEMPTED before the break: the epoch loop ends on it" if all(
            rep["status"] != PREEMPTED for rep in reports) else ""  # fmt: skip
        if len(set(saved)) == 1:  # helper 166: a periodic save and the preemption's
            return (f"rank 0 saved step {saved[0]} {len(saved)} times: a periodic save and the "
                    "preemption's at the same step - save once (the periodic save only when "
                    "the flag does not already stop the loop)")  # fmt: skip
        return (f"rank 0 saved {len(saved)} snapshots (steps {saved[0]} to {saved[-1]}): the "
                "loop trained on after the preemption - break out of it right after the "
                f"save, with status PREEMPTED{unset}")  # fmt: skip
    return None


def _no_report(records: list[Record]) -> str:
    """A rank without its report: it exited 75 from the loop, or left it another way."""
    if any(r.get("exit_code") == PREEMPTED for r in records):
        return ("the file exited with 75 from inside the loop: right for a job on a cluster, "
                "but this file reports first - set status = PREEMPTED and break, and main() "
                "returns it (on a cluster, end the script with sys.exit(main()))")  # fmt: skip
    return ("a rank wrote no report-rank*.json: keep the lines that write it, after the "
            "loop - leave the loop with `break`, not `return`")  # fmt: skip


def judge_preempt(records: list[Record]) -> str | None:
    reports = [r["report"] for r in records]
    if any(rep is None for rep in reports):
        return _no_report(records)
    if not any(rep["handler"] for rep in reports):
        return (f"no SIGTERM handler: on a cluster, rank {PREEMPT_RANK} would have died at once "
                f"at step {PREEMPT_AT}, losing everything since the last snapshot - install one "
                "with signal.signal(signal.SIGTERM, ...) that sets stop['signal']")  # fmt: skip
    bare = [rep["rank"] for rep in reports if not rep["handler"]]
    if bare:  # the check signals rank 1 first (rank 0 at its barrier); a scheduler: every one
        return (f"rank {bare[0]} installed no SIGTERM handler: a scheduler sends SIGTERM to "
                f"every process of the job, and without one rank {bare[0]} dies at once, with "
                "the save or the barrier it owes - install it on every rank, before the "
                "loop")  # fmt: skip
    for rep in reports:
        if any(s["in_handler"] for s in rep["saves"]):
            return (
                f"rank {rep['rank']} saved inside the signal handler: a handler runs between "
                "any two Python bytecodes - in the middle of a save, between two collectives "
                "of a step - so it must only set a flag; save at the step boundary, after "
                "every rank has agreed to stop"
            )
    stops, total = [rep["stopped_at"] for rep in reports], reports[0]["total"]
    if len(set(stops)) > 1:
        return (
            f"the ranks stopped at steps {stops}: a SIGTERM reaches one process; all_reduce "
            "the flag (MAX) at a step boundary, so that every rank stops at the same step"
        )
    stop = stops[0]
    if stop >= total and not reports[PREEMPT_RANK].get("flag"):
        return (f"every rank trained to the end (step {total}): the SIGTERM at step {PREEMPT_AT} "
                f"reached rank {PREEMPT_RANK}, and its handler left stop['signal'] at 0 - the "
                "handler's one job is to set it (stop.update(signal=signum)), for the loop to "
                "read at the next step boundary")  # fmt: skip
    if stop >= total:
        return (f"every rank trained to the end (step {total}) after the SIGTERM at step "
                f"{PREEMPT_AT}, which reached rank {PREEMPT_RANK} only: at each step boundary "
                "every rank must learn whether ANY rank was signalled - all_reduce the flag "
                f"with op=MAX (a broadcast from rank 0, or MIN, misses rank {PREEMPT_RANK}'s) - "
                "then stop the loop when it is non-zero (it holds the signal's number, 15 for "
                "SIGTERM: `if flag.item():`, not `== 1`)")  # fmt: skip
    if mistake := _judge_saves(records, stop):
        return mistake
    if stop - PREEMPT_AT >= EVERY:
        return (
            f"the ranks stopped at step {stop}, {stop - PREEMPT_AT} steps after the signal: "
            "torchrun and SLURM wait 30 s before SIGKILL - check the flag every few steps"
        )
    if mistake := _judge_snapshot(records, stop):
        return mistake
    statuses = [rep["status"] for rep in reports]
    if any(s != PREEMPTED for s in statuses):
        return (
            f"the ranks return statuses {statuses} after the preemption's save: "
            f"{PREEMPTED} (EX_TEMPFAIL, 'try again') on every rank - set status = PREEMPTED"
        )
    if any(r.get("left_group_open") for r in records):
        return "the process group was left open: end with dist.destroy_process_group()"
    return None


ERRORS = (  # matched against each failing rank's error and the line of the file it failed at
    (RAISED_IN_HANDLER, "a rank's SIGTERM handler raised (a KeyboardInterrupt, say) in the "
     "middle of the step it interrupted: nothing was saved, and the other rank was left "
     "waiting - the handler only sets the flag (stop['signal'] = signum); the loop saves and "
     "stops at the step boundary"),
    (IN_HANDLER, "a rank exited inside its SIGTERM handler: nothing was saved, and the other "
     "rank was left waiting in the next all_reduce - the handler only sets the flag "
     "(stop['signal'] = signum); the loop saves and stops at the step boundary"),
    (COLLECTIVE_IN_HANDLER, "a rank called a collective inside its SIGTERM handler: the "
     "handler runs between two lines of the loop, wherever the signal lands, so the other "
     "ranks meet it with whatever collective they are in (the flag's all_reduce, backward's "
     "gradients) - right by luck, a wrong sum or a hang; the handler only sets the flag "
     "(stop['signal'] = signum), and the loop's all_reduce of it, at the step boundary, is the "
     "one collective that decides"),
    ("loss.backward()", "a rank went on into the next step and waited in backward's gradient "
     "all_reduce for a rank that had stopped: the SIGTERM reached one process only - all_reduce "
     "the flag (MAX) at the step boundary, so that every rank stops at the same step, and "
     "decide on the reduced flag (flag.item()), not on the rank's own stop['signal']; if it "
     "is, did every rank leave the epoch loop too (status = PREEMPTED set on every rank, not "
     "only on rank 0)?"),
)  # fmt: skip

# an async all_reduce of the flag never waited on: a hang when the read comes first, a pass by
# luck when the sum arrived in time (a fresh CI clone passed it once; a busy host hangs it)
UNWAITED = (
    r"(?s)\A(?!.*(?:\.wait|\bwait_all)\().*async_op\s*=\s*True",  # helper 162: wait_all
    "a collective ran with async_op=True and was never waited on - the flag's all_reduce: "
    "flag.item() may read it before the sum arrives, and the ranks then disagree on stopping; "
    "the barrier: it holds no rank back, and one may exit while rank 0 still writes - call "
    ".wait() on the Work it returns (or drop async_op)",
)
# a sleep where the barrier belongs: long enough here, too short on a slow file system
SLEPT = (
    r"(?s)\A(?!.*barrier\().*\bsleep\(",
    "the ranks sleep instead of waiting at dist.barrier() for rank 0's save: a sleep guesses "
    "how long the save takes - long enough here, too short on a slow file system, where "
    "torchrun stops the job with rank 0 in mid-save; dist.barrier() after the save, on every "
    "rank",
)

# the save under an `if` that reads LOCAL_RANK, itself or through a name set from it (helper 117);
# not a local_rank read for a print beside a save under the global rank (helper 162)
_UNDER = (
    r"[^\n]*:[ \t]*(?:[^\n]*save_snapshot\(|\n(?:(?P=i) +[^\n]*\n|[ \t]*\n)*?(?P=i) +"
    r"[^\n]*save_snapshot\()"
)
LOCAL_GUARDS = (
    rf"(?m)^(?P<i> *)if\b[^\n]*(?:LOCAL_RANK|\blocal_rank\b){_UNDER}",
    rf"(?ms)^[ \t]*(?P<v>\w+)\s*=(?!=)[^\n]*LOCAL_RANK.*^(?P<i> *)if\b[^\n]*\b(?P=v)\b{_UNDER}",
)
LOCAL_SAVER = (
    "the snapshot is saved where LOCAL_RANK is 0: on several nodes each node's local "
    "rank 0 writes the same file - global rank 0 saves (`rank == 0`, "
    'dist.get_rank()) (lesson 10, "Who writes checkpoints: global rank 0, not local '
    'rank 0")'
)

EXERCISES = [
    Exercise(
        name="08_preempt_save_exit", lesson="08", kind="script", run=run_preempt,
        # LOCAL_RANK read before the save (in the if, or through a variable: helper 117)
        hidden=(*((g, LOCAL_SAVER) for g in LOCAL_GUARDS),
                (r"broadcast\([^)\n]*src\s*=\s*(?:args\.preempt_rank|1\b)", "the flag is "
                 "broadcast from the rank this check signals: on a cluster any rank can get the "
                 "SIGTERM first, or only some of them - all_reduce the flag with op=MAX, so "
                 "that a signal on any rank stops every rank"),
                (r"\.item\(\)\s*==\s*1(?:\.0)?\b|\b(?:flag|stop\w*)\s*==\s*1\b", "the vote "
                 "tested as a sum equal to 1: this check signals one rank first, but a "
                 "scheduler (and torchrun) signal every rank - the sum is then the world size, "
                 "and the job never stops - test > 0, or all_reduce with op=MAX"),  # h. 171
                UNWAITED, SLEPT),  # a run that won the race passes: named all the same
        when_hung=(UNWAITED,),
        judge=judge_preempt, errors=ERRORS, collective_timeout_s=12.0, around=preempt_watch,
        exit_codes=(PREEMPTED,),  # sys.exit(main()) after the report: what a cluster job does
        title="SIGTERM: every rank stops at one step, rank 0 saves, every rank exits 75",
        teaches='lesson 08, "4 · Preemption: save on SIGTERM, exit 75, resume when requeued"',
        proves=(
            "a SIGTERM reached rank 1 (and rank 0 later, at its barrier); every rank stopped at "
            "the same step soon after, rank 0 alone saved one snapshot outside the handler, and "
            "every rank returned 75"
        ),
    ),
]  # fmt: skip
