"""Lesson 08's exercise: wrong ways to stop on SIGTERM, each named (edits of the solution)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "08_preempt_save_exit"
HANDLER = "signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))"
SAVE = """                if rank == 0:
                    save_snapshot("""
# a handler that saves on rank 0 (helper 117): it runs between any two bytecodes
SAVING_HANDLER = (
    "def on_term(signum, frame):\n        stop['signal'] = signum\n"
    "        if rank == 0:\n"
    '            save_snapshot(out / "snapshot.pt", {"step": 0})\n\n'
    "    signal.signal(signal.SIGTERM, on_term)"
)
CASES = register([
    # helper 171: one rank signalled first here; a scheduler signals every rank
    Case(EX, "vote-sum-equal-to-one", "the vote tested as a sum equal to 1",
         edits=(("            flag = torch.tensor(float(stop[\"signal\"]))\n"
                 "            dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n"
                 "            if flag.item():",
                 "            flag = torch.tensor(1.0 if stop[\"signal\"] else 0.0)\n"
                 "            dist.all_reduce(flag)\n            if flag.item() == 1:"),)),
    # helper 146: named, as lesson 05 names its barrier (it read "for a peer that never came")
    Case(EX, "barrier-under-rank-0", "dist.barrier() is under `if rank == 0`",
         edits=(("                dist.barrier()\n                status = PREEMPTED",
                 "                    dist.barrier()\n                status = PREEMPTED"),)),
    # from a twenty-fifth-session learner review (helper 127)
    Case(EX, "broadcast-from-the-signalled-rank", "broadcast from the rank this check signals",
         edits=(("dist.all_reduce(flag, op=dist.ReduceOp.MAX)",
                 "dist.broadcast(flag, src=args.preempt_rank)"),)),
    Case(EX, "flag-compared-to-one", "not `== 1`",
         edits=(("            if flag.item():", "            if flag.item() == 1:"),)),
    Case(EX, "local-flag-after-the-reduce", "not on the rank's own stop['signal']",
         edits=(("            if flag.item():", "            if stop[\"signal\"]:"),)),
    Case(EX, "no-agreement", "all_reduce the flag (MAX)",
         edits=(("            dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n", ""),)),
    Case(EX, "saves-in-the-handler", "saved inside the signal handler",
         edits=(("lambda signum, frame: stop.update(signal=signum))",
                 "lambda signum, frame: (stop.update(signal=signum), save_snapshot(\n"
                 '        out / "snapshot.pt",\n'
                 '        {"model": model.module.state_dict(), "step": step})))'),)),
    Case(EX, "every-rank-saves", "only global rank 0 saves",
         edits=((SAVE, SAVE.replace("if rank == 0:", "if True:")),)),
    Case(EX, "stops-without-saving", "no snapshot of step",
         edits=((SAVE, SAVE.replace("if rank == 0:", "if False:")),)),
    Case(EX, "no-barrier-after-the-save", "waits at dist.barrier() after rank 0's save",
         edits=(("                dist.barrier()\n", ""),)),
    Case(EX, "exits-in-the-loop", "set status = PREEMPTED and break",
         edits=(("                status = PREEMPTED\n                break\n",
                 "                raise SystemExit(PREEMPTED)\n"),)),
    Case(EX, "no-break-after-the-save", "the loop trained on after the preemption",
         edits=(("                status = PREEMPTED\n                break\n",
                 "                status = PREEMPTED\n"),)),
    Case(EX, "rank-0-decides-alone", "which reached rank 1 only",
         edits=(("dist.all_reduce(flag, op=dist.ReduceOp.MAX)", "dist.broadcast(flag, src=0)"),)),
    Case(EX, "flag-checked-once-per-epoch", "check the flag every few steps",
         edits=(('            flag = torch.tensor(float(stop["signal"]))\n',
                 "            if step % len(loader):  # once an epoch\n                continue\n"
                 '            flag = torch.tensor(float(stop["signal"]))\n'),)),
    Case(EX, "exits-in-the-handler", "exited inside its SIGTERM handler",
         edits=(("    signal.signal(signal.SIGTERM, lambda signum, frame: "
                 "stop.update(signal=signum))",
                 "    def on_sigterm(signum, frame):\n        stop.update(signal=signum)\n"
                 "        raise SystemExit(PREEMPTED)\n\n"
                 "    signal.signal(signal.SIGTERM, on_sigterm)"),)),
    Case(EX, "flag-reduced-by-the-signalled-rank-only", "called different collectives",
         edits=(("            dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n",
                 '            if stop["signal"]:\n'
                 "                dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n"),)),
    # from a learner review
    Case(EX, "snapshot-of-the-wrapper", "the snapshot's model keys start with 'module.'",
         edits=(('{"model": model.module.state_dict(),', '{"model": model.state_dict(),'),)),
    Case(EX, "status-never-set", "set status = PREEMPTED before the break",
         edits=(("                status = PREEMPTED\n                break\n",
                 "                break\n"),)),
    Case(EX, "return-inside-the-loop", "not `return`",
         edits=(("                status = PREEMPTED\n                break\n",
                 "                return PREEMPTED\n"),)),
    Case(EX, "snapshot-written-by-hand", "without save_snapshot",
         edits=(('                    save_snapshot(out / "snapshot.pt", ',
                 '                    torch.save(dict(step=step, optimizer=optimizer.state_dict(), '
                 'model=model.module.state_dict()), out / "snapshot.tmp")\n'
                 '                    os.replace(out / "snapshot.tmp", out / "snapshot.pt")\n'
                 '                    dict('),)),
    Case(EX, "handler-raises", "handler raised (a KeyboardInterrupt",
         edits=(("signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))",
                 "signal.signal(signal.SIGTERM, signal.default_int_handler)"),)),
    Case(EX, "the-signalled-rank-saves", "rank 1 saved the snapshot",
         edits=(("                if rank == 0:\n                    save_snapshot(",
                 "                if rank == 1:\n                    save_snapshot("),)),
    # from a second learner review: a handler on some ranks only; status on rank 0 only
    Case(EX, "handler-on-the-signalled-rank-only", "rank 0 installed no SIGTERM handler",
         edits=(("    " + HANDLER,
                 "    if rank == args.preempt_rank:  # the rank the SIGTERM goes to\n"
                 "        " + HANDLER),)),
    Case(EX, "handler-on-rank-0-only", "rank 1 installed no SIGTERM handler",
         edits=(("    " + HANDLER,
                 "    if rank == 0:  # rank 0 is the one that saves\n        " + HANDLER),)),
    Case(EX, "status-set-on-rank-0-only", "status = PREEMPTED set on every rank",
         edits=(("                dist.barrier()\n                status = PREEMPTED\n",
                 "                    status = PREEMPTED\n                dist.barrier()\n"),)),
    # helper 99: a save under LOCAL_RANK == 0 passed (each rank of the check is a node)
    Case(EX, "local-rank-0-saves", "Who writes checkpoints",
         edits=(("                if rank == 0:\n                    save_snapshot",
                 '                if int(os.environ["LOCAL_RANK"]) == 0:\n'
                 "                    save_snapshot"),)),
    Case(EX, "handler-sets-no-flag", "left stop['signal'] at 0",
         edits=(("lambda signum, frame: stop.update(signal=signum))",
                 "lambda signum, frame: print('SIGTERM: will stop soon'))"),)),
    # helper 117: the check signalled rank 1 alone, so a handler that saved on rank 0 passed
    Case(EX, "handler-saves-on-rank-0", "rank 0 saved inside the signal handler",
         edits=((HANDLER, SAVING_HANDLER),)),
    Case(EX, "handler-alone-saves-on-rank-0", "rank 0 saved inside the signal handler",
         edits=((HANDLER, SAVING_HANDLER),
                (SAVE, "                if False:\n                    save_snapshot("))),
    # helper 162: rank 0's late SIGTERM came at dist.barrier only (a save in its handler passed
    # with monitored_barrier); an os._exit in the handler read "failed before your code ran";
    # three right answers failed or were told another mistake
    Case(EX, "handler-saves-monitored-barrier", "rank 0 saved inside the signal handler",
         edits=((HANDLER, SAVING_HANDLER),
                ("                dist.barrier()\n                status = PREEMPTED",
                 "                dist.monitored_barrier()\n                status = PREEMPTED"))),
    Case(EX, "handler-saves-all-reduce-waits", "rank 0 saved inside the signal handler",
         edits=((HANDLER, SAVING_HANDLER),
                ("                dist.barrier()\n                status = PREEMPTED",
                 "                dist.all_reduce(torch.zeros(1))  # wait for rank 0's save\n"
                 "                status = PREEMPTED"))),
    Case(EX, "os-exit-in-the-handler", "exited inside its SIGTERM handler",
         edits=((HANDLER, "signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(75))"),)),
    Case(EX, "local-rank-read-for-a-print", None,
         edits=(("    rank = dist.get_rank()\n", "    rank = dist.get_rank()\n"
                 '    local_rank = int(os.environ.get("LOCAL_RANK", 0))\n'
                 '    print(f"rank {rank}, local rank {local_rank}")\n'),)),
    Case(EX, "flag-waited-with-wait-all", None,
         edits=(("            dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n",
                 "            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)\n"
                 "            torch.futures.wait_all([work.get_future()])\n"),)),
    Case(EX, "periodic-saves-and-the-preemptions", None,
         edits=(("            flag = torch.tensor(float(stop[\"signal\"]))\n",
                 "            if rank == 0 and step % 4 == 0:\n"
                 '                save_snapshot(out / "snapshot.pt", {"model": '
                 'model.module.state_dict(),\n'
                 '                              "optimizer": optimizer.state_dict(), '
                 '"step": step})\n'
                 "            flag = torch.tensor(float(stop[\"signal\"]))\n"),)),
    # helper 166: `rank=` inside a print's f-string read as a name set from LOCAL_RANK; a
    # periodic save at the stop step told "trained on after the preemption"
    Case(EX, "rank-and-local-rank-printed", None,
         edits=(("                dist.barrier()\n                status = PREEMPTED",
                 "                print(f\"stopping at step {step}: {rank=}, LOCAL_RANK="
                 "{os.environ.get('LOCAL_RANK')}\")\n"
                 "                dist.barrier()\n                status = PREEMPTED"),)),
    Case(EX, "periodic-save-at-the-stop-step", "saved step 5 2 times",
         edits=(("            flag = torch.tensor(float(stop[\"signal\"]))\n",
                 "            if rank == 0 and step % 5 == 0:\n"
                 '                save_snapshot(out / "snapshot.pt", {"model": '
                 "model.module.state_dict(),\n"
                 '                              "optimizer": optimizer.state_dict(), '
                 '"step": step})\n'
                 "            flag = torch.tensor(float(stop[\"signal\"]))\n"),)),
    Case(EX, "local-rank-through-a-variable", "where LOCAL_RANK is 0",
         edits=((SAVE, '                is_writer = int(os.environ["LOCAL_RANK"]) == 0\n'
                       "                if is_writer:\n                    save_snapshot("),)),
    Case(EX, "async-flag-never-waited", "async_op=True and was never waited on",
         edits=(("dist.all_reduce(flag, op=dist.ReduceOp.MAX)",
                 "dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)"),)),
    # helper 134: two wrong answers passed (a collective in the handler met the flag's
    # all_reduce by luck; a sleep outlasted the held save), a right one failed (the
    # sys.exit(main()) its own message recommends), an async barrier was named the flag's
    Case(EX, "collective-in-the-handler", "called a collective inside its SIGTERM handler",
         edits=(("    signal.signal(signal.SIGTERM, lambda signum, frame: "
                 "stop.update(signal=signum))",
                 "    def on_sigterm(signum, frame):\n        stop.update(signal=signum)\n"
                 "        dist.all_reduce(torch.ones(1))\n\n"
                 "    signal.signal(signal.SIGTERM, on_sigterm)"),)),
    Case(EX, "sleep-instead-of-barrier", "sleep instead of waiting at dist.barrier()",
         edits=(("                dist.barrier()\n",
                 "                else:\n                    __import__('time').sleep(1.0)\n"),)),
    Case(EX, "sys-exit-main", None,
         edits=(("        status = main()", "        raise SystemExit(main())"),)),
    # twenty-seventh session: os._exit(75) in the loop was "the launch failed before your code ran"
    Case(EX, "os-exit-in-the-loop", "os._exit stops a process on the spot",
         edits=(("                status = PREEMPTED\n                break\n",
                 "                os._exit(PREEMPTED)\n"),)),
    Case(EX, "async-barrier-never-waited", "the barrier: it holds no rank back",
         edits=(("                dist.barrier()\n",
                 "                dist.barrier(async_op=True)\n"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
