"""The launcher against the real torchrun: failure, timeout, env, bad input.

A successful launch with rank prefixes and per-rank records is lesson 00's
first cell (notebooks/00_environment.ipynb asserts it on scripts/demos/hello.py);
here one failing launch serves every assertion about failures, and the
scripts import no torch, so that a launch costs only torchrun's own start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import DEMOS, fake_gpu, processes_running
from ddp_tutorial.harness import processes
from ddp_tutorial.harness.failures import (
    LaunchError,
    LaunchTimeout,
    failure_message,
    parse_failures,
)
from ddp_tutorial.harness.launch import (
    LaunchSpec,
    RunResult,
    raise_for_failure,
    run_together,
    start,
    torchrun,
)
from ddp_tutorial.harness.processes import alive

# No torch in the ranks: they start in a fraction of a second.
FAILING = """
import json, os, sys, time
out, rank = sys.argv[-1], os.environ["RANK"]
record = {"rank": int(rank), "pid": os.getpid(), "marker": os.environ.get("DDP_TEST_MARKER")}
path = os.path.join(out, f"rank{rank}.json")
with open(path + ".tmp", "w") as f:  # renamed whole: rank 1 must never read it half-written
    json.dump(record, f)
os.replace(path + ".tmp", path)
print("rank", rank, "wrote its record", flush=True)
if rank == "1":  # wait until rank 0 has finished: the failure is rank 1's alone
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(out, "rank0.json")) and time.time() < deadline:
        time.sleep(0.05)
    with open(os.path.join(out, "rank0.json")) as f:
        pid = json.load(f)["pid"]
    def running(pid):  # rank 0 returns right after writing its record: until it has exited
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
        except OSError:
            return False
    while running(pid) and time.time() < deadline:
        time.sleep(0.05)
    raise ValueError("deliberate failure on rank 1")
"""

# Rank 1 dies by a signal (os.abort: SIGABRT, as a C++ "terminate called" does; or SIGKILL,
# as the OOM killer does) while rank 0 waits: torchrun then terminates rank 0 itself.
DIES_BY = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 about to die by {how}", flush=True)
    os.abort() if "{how}" == "SIGABRT" else os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""

# Every rank exits 75 (EX_TEMPFAIL) though torchrun was not signalled; each attempt appends
# a line, so the test counts the attempts torchrun started.
EXITS_75 = """
import os, sys
with open(os.path.join(sys.argv[-1], "attempts.txt"), "a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
sys.exit(75)
"""

HANGING = """
import json, os, sys, time
path = os.path.join(sys.argv[-1], f"rank{os.environ['RANK']}.json")
with open(path + ".tmp", "w") as f:  # then renamed: the test reads a whole record or none
    json.dump({"rank": int(os.environ["RANK"]), "pid": os.getpid()}, f)
os.replace(path + ".tmp", path)
print("rank", os.environ["RANK"], "hanging", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> tuple[RunResult, float, RunResult, dict[str, RunResult]]:
    """A 2-rank launch in which rank 1 fails (start(), check=False), beside a slower one.

    Beside them, two launches whose rank 1 dies by a signal: what torchrun really
    prints then is what the failure parser must read.
    """
    run_dir = tmp_path_factory.mktemp("failing")
    script = run_dir / "fails.py"
    script.write_text(FAILING)
    sleeper = run_dir / "sleeps.py"
    sleeper.write_text("import time\ntime.sleep(4)\n")
    dying = {}
    for how in ("SIGABRT", "SIGKILL"):
        path = run_dir / f"dies_by_{how}.py"
        path.write_text(DIES_BY.replace("{how}", how))
        dying[how] = start(path, nproc=2, run_dir=run_dir / how, echo=False, check=False)
    (run_dir / "75").mkdir()
    (run_dir / "exits_75.py").write_text(EXITS_75)
    dying["75"] = start(run_dir / "exits_75.py", run_dir / "75", nproc=1, run_dir=run_dir / "75",
                        echo=False, check=False, out_flag=None,
                        torchrun_args=("--max-restarts", "1"))  # fmt: skip
    t0 = time.monotonic()
    launch = start(script, nproc=2, run_dir=run_dir, echo=False, check=False,
                   env={"DDP_TEST_MARKER": "hello-from-parent"})  # fmt: skip
    returned_after = time.monotonic() - t0
    assert launch.proc.poll() is None, "start() returned while torchrun still runs"
    slow = start(sleeper, nproc=1, run_dir=run_dir / "slow", echo=False, out_flag=None)
    slower = slow.wait()  # collected first, although it ends last
    result = launch.wait()
    assert launch.wait() is result
    return result, returned_after, slower, {how: la.wait() for how, la in dying.items()}


@pytest.mark.torchrun
def test_start_returns_before_the_launch_ends(failed):
    assert failed[1] < 2


@pytest.mark.torchrun
def test_seconds_end_when_the_output_ends_not_when_it_is_collected(failed):
    result, _, slower, _ = failed
    assert slower.ok and result.seconds < slower.seconds - 1


@pytest.mark.torchrun
def test_ranks_exiting_75_unsignalled_are_failed_workers_to_torchrun(failed):
    """Lesson 08: exit 75 reaches torchrun only, which takes it for a failure, restarts under
    --max-restarts, then exits 1: nothing watching torchrun ever sees the 75."""
    ended = failed[3]["75"]
    attempts = (ended.run_dir / "attempts.txt").read_text().split()
    assert ended.returncode == 1 and attempts == ["0", "1"], (ended.returncode, attempts)
    assert [f.exitcode for f in ended.failures] == [75], ended.output[-2000:]


@pytest.mark.torchrun
def test_check_false_returns_the_failed_result(failed):
    result = failed[0]
    assert not result.ok and result.returncode != 0 and result.failures[0].rank == 1


@pytest.mark.torchrun
def test_failing_rank_is_named_with_its_traceback(failed):
    result = failed[0]
    with pytest.raises(LaunchError) as info:
        raise_for_failure("fails.py", result, timeout=60)
    message = str(info.value)
    assert "rank 1 exited with code 1" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert 'fails.py", line' in message  # the traceback tail, not just the summary
    assert result.failures[0].exitcode == 1


@pytest.mark.torchrun
def test_env_override_reaches_ranks_and_output_is_kept_per_rank(failed):
    result = failed[0]
    assert [r["marker"] for r in result.records] == ["hello-from-parent"] * 2
    assert "DDP_TEST_MARKER" not in os.environ  # the parent's environment is untouched
    # output streamed with rank prefixes, and per-rank logs kept on disk
    assert "[default1]:rank 1 wrote its record" in result.output
    assert "rank 1 wrote its record" in result.rank_log(1)
    assert "deliberate failure" in result.rank_log(1, "stderr")


@pytest.mark.torchrun
def test_timeout_kills_everything_checked_or_not(tmp_path, write_script):
    """Two hanging launches side by side, one raising (check=True), one returning its result.

    The limit leaves both ranks time to start even on a loaded machine (torchrun's
    start-up takes seconds there); both launches end within seconds of it.
    """
    script = write_script("hangs_for_test.py", HANGING)
    limit = 15
    launches = {
        check: start(
            script,
            nproc=2,
            run_dir=tmp_path / f"run-{check}",
            timeout=limit,
            echo=False,
            check=check,
        )  # fmt: skip
        for check in (True, False)
    }
    start_time = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launches[True].wait()
    unchecked = launches[False].wait()
    elapsed = time.monotonic() - start_time
    assert elapsed < limit + 15, f"the timeout took {elapsed:.0f}s to take effect"
    assert f"did not finish within {limit} s" in str(info.value)
    assert unchecked.timed_out and not unchecked.ok, "check=False: returned, not raised"
    pids = [r["pid"] for r in info.value.result.records + unchecked.records]
    assert len(pids) == 4, "every rank had started before the timeout"
    _gone(script, pids)


def _gone(script, pids, within_s: float = 10.0) -> None:
    """Every process of the launch ends within ``within_s`` (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not processes_running(str(script)) and not any(alive(pid) for pid in pids):
            return
        time.sleep(0.1)
    assert processes_running(str(script)) == [], "no process of the launch may survive"
    assert not [pid for pid in pids if alive(pid)]


INTERRUPTED_KERNEL = """
import signal, sys
from ddp_tutorial.harness.launch import start
signal.signal(signal.SIGINT, signal.default_int_handler)  # a kernel's, even if started ignored
launch = start(sys.argv[1], nproc=2, run_dir=sys.argv[2], timeout=120, echo=False)
print("waiting", flush=True)
try:
    launch.wait()
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


@pytest.mark.torchrun
def test_an_interrupt_while_waiting_kills_the_launch(tmp_path, write_script, python):
    """The notebook's stop button: a SIGINT to the kernel while wait() runs ends torchrun and its
    ranks, and the KeyboardInterrupt reaches the cell.

    A kernel of its own, interrupted by a real signal as Jupyter does: in this pytest process,
    after a full one-process run, ``_thread.interrupt_main()`` was seen never to land."""
    script = write_script("hangs_interrupted.py", HANGING)
    kernel = write_script("kernel.py", INTERRUPTED_KERNEL)
    run = tmp_path / "run"
    proc = subprocess.Popen([python, str(kernel), str(script), str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(run.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in out.splitlines(), out
    pids = [json.loads(p.read_text())["pid"] for p in run.glob("rank*.json")]
    assert len(pids) == 2
    _gone(script, pids)


@pytest.mark.torchrun
def test_a_monitor_that_cannot_start_leaves_no_torchrun_behind(tmp_path, write_script,
                                                                 monkeypatch):  # fmt: skip
    from ddp_tutorial.harness import monitor

    def broken(self) -> None:
        raise RuntimeError("no sampler today")

    monkeypatch.setattr(monitor.Monitor, "start", broken)
    script = write_script("hangs_monitored.py", HANGING)
    spawned = []
    real_spawn = processes.spawn
    monkeypatch.setattr(processes, "spawn", lambda *a, **k: spawned.append(real_spawn(*a, **k))
                        or spawned[-1])  # fmt: skip
    with pytest.raises(RuntimeError, match="no sampler today"):
        start(script, nproc=2, run_dir=tmp_path / "run", monitor=True, echo=False)
    assert len(spawned) == 1
    _gone(script, [spawned[0].pid])


@pytest.mark.torchrun
def test_run_together_kills_what_it_started_when_a_later_launch_cannot_start(
    tmp_path, write_script
):
    script = write_script("hangs_together.py", HANGING)
    specs = {
        "first": LaunchSpec(script, nproc=1, run_dir=tmp_path / "a", echo=False, timeout=60),
        "second": LaunchSpec(tmp_path / "missing.py", nproc=1, echo=False),
    }
    with pytest.raises(FileNotFoundError, match="missing.py"):
        run_together(specs)
    _gone(script, [])


def test_kill_tree_never_signals_a_number_its_process_gave_up():
    """A reaped process's pid goes to the next process or thread, and a signal to a thread's
    id ends its whole process. Here the number is pointed at a thread of this very process,
    the worst case: the old ``kill_tree(pid)`` sent it SIGTERM, and this test died."""
    import threading

    import psutil

    proc, other = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "30"])
    proc.wait()
    taken = psutil.Process(other.pid)  # taken while it ran, then ended and reaped
    other.kill()
    other.wait()
    ready, done, tids = threading.Event(), threading.Event(), []

    def park() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        done.wait()

    thread = threading.Thread(target=park)
    thread.start()
    ready.wait()
    try:
        proc.pid = tids[0]  # what the kernel may do with a freed number
        assert psutil.Process(tids[0]).ppid() == os.getppid(), "psutil opens a thread's id"
        assert processes.kill_tree(proc) == []
        assert processes.kill_tree(taken) == []
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("timeout", [0, -5])
def test_a_timeout_that_is_not_positive_is_refused_before_anything_starts(timeout):
    with pytest.raises(ValueError, match="timeout must be positive"):
        torchrun(DEMOS / "hello.py", nproc=2, timeout=timeout)


def test_missing_script_fails_before_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_script.py"):
        torchrun(tmp_path / "no_such_script.py", nproc=2)


@pytest.mark.parametrize("nproc", [0, -1, 1.5])
def test_bad_nproc_fails_before_launch(nproc):
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        torchrun(DEMOS / "hello.py", nproc=nproc)


SIGKILLED_PEER_SUMMARY = """
Failures:
[1]:
  time      : 2026-11-29_21:00:01
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_21:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 11
============================================================
"""


def test_a_killed_rank_is_named_before_the_one_torchrun_terminated(tmp_path):
    """torchrun can call the SIGTERM'd peer the root cause; the SIGKILL'd rank comes first."""
    failures = parse_failures(SIGKILLED_PEER_SUMMARY, tmp_path)
    assert [(f.rank, f.signal) for f in failures] == [(1, "SIGKILL"), (0, "SIGTERM")]


@pytest.mark.torchrun
@pytest.mark.parametrize("how", ["SIGABRT", "SIGKILL"])
def test_a_rank_killed_by_a_signal_is_named_from_torchruns_real_summary(failed, how):
    result = failed[3][how]
    assert not result.ok
    first = result.failures[0]
    assert (first.rank, first.signal) == (1, how), result.output[-3000:]
    message = failure_message("dies.py", result)
    assert message.startswith(f"dies.py failed under torchrun: {first.describe()}")
    assert how in first.describe()


ABORTED_PEER_SUMMARY = SIGKILLED_PEER_SUMMARY.replace("-9 (pid: 12)", "-6 (pid: 12)").replace(
    "Signal 9 (SIGKILL)", "Signal 6 (SIGABRT)"
)


def test_a_crash_without_traceback_shows_this_launchs_stderr(tmp_path):
    """A rank killed by a signal leaves no error file: its stderr tail is the evidence.

    A resumed run writes a second log tree into the same run directory; the
    message must come from the launch that failed (the newest log), not from
    the first launch's empty one.
    """
    import os

    old = tmp_path / "logs" / "ffff_first" / "attempt_0" / "1" / "stderr.log"
    new = tmp_path / "logs" / "0000_second" / "attempt_0" / "1" / "stderr.log"
    for path, text in ((old, ""), (new, "terminate called without an active exception\n")):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    os.utime(old, (1_000, 1_000))  # the first launch's log, older (and sorted last by name)
    failures = parse_failures(ABORTED_PEER_SUMMARY, tmp_path)
    assert (failures[0].rank, failures[0].signal) == (1, "SIGABRT")
    assert "terminate called without an active exception" in failures[0].traceback


def test_a_crash_report_starts_at_the_cpp_message_not_the_module_list(tmp_path):
    """With faulthandler on, the message shows the C++ line and the crashed thread's stack."""
    log = tmp_path / "logs" / "run" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    threads = "".join(
        f'Thread 0x{i:x} (most recent call first):\n  File "x.py", line {i}\n\n' for i in range(20)
    )
    log.write_text(
        "rank 1 trained\n"
        "terminate called without an active exception\n"
        "Fatal Python error: Aborted\n\n"
        "Current thread 0x1 (most recent call first):\n  <no Python frame>\n\n"
        + threads
        + "Extension modules: numpy, torch._C (total: 2)\n"
    )
    report = parse_failures(ABORTED_PEER_SUMMARY, tmp_path)[0].traceback
    assert report.splitlines()[:2] == [
        "terminate called without an active exception",
        "Fatal Python error: Aborted",
    ]
    assert "<no Python frame>" in report and "Extension modules" not in report


def test_default_run_dirs_follow_the_runs_root_and_old_ones_are_pruned(tmp_path, monkeypatch):
    import os

    from ddp_tutorial.harness import launch

    monkeypatch.setenv("DDP_TUTORIAL_RUNS", str(tmp_path))
    old = []
    for i in range(launch.KEEP_RUNS + 3):  # runs a previous session left behind
        run = tmp_path / f"train-20260101-0000{i:02d}"
        run.mkdir()
        os.utime(run, (1_000_000 + i, 1_000_000 + i))
        old.append(run)
    other = tmp_path / "hello-20260101-000000"
    other.mkdir()
    mine = [launch.default_run_dir("scripts/train.py") for _ in range(2)]
    for run in mine:
        run.mkdir()
    assert all(run.parent == tmp_path and run.name.startswith("train-") for run in mine)
    assert mine[0] != mine[1]
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("train-"))
    assert set(mine) <= set(kept) and len(kept) <= launch.KEEP_RUNS + 2
    assert not old[0].exists() and old[-1].exists(), "the oldest go, the newest stay"
    assert other.exists(), "another script's runs are not touched"


@pytest.mark.torchrun
def test_a_launch_collected_after_its_deadline_did_not_time_out(tmp_path, monkeypatch):
    """start() now, wait() later: a launch that ended in time is not a timeout."""
    from ddp_tutorial.harness import launch as launch_module

    script = tmp_path / "quick.py"
    script.write_text("print('done', flush=True)\n")
    launch = start(script, nproc=1, run_dir=tmp_path, echo=False, out_flag=None, timeout=60)
    for _ in range(600):  # the output ends (the reader thread notes when), nobody polls
        if launch._ended_at is not None:
            break
        time.sleep(0.1)
    late = launch.deadline + 10  # the notebook comes back to it long after the deadline
    monkeypatch.setattr(launch_module.time, "monotonic", lambda: late)
    result = launch.wait()
    assert not result.timed_out and result.ok and "done" in result.output


STAMPS = """
import json, os, sys, time
start = time.time()
time.sleep(1.5)
with open(os.path.join(sys.argv[-1], "rank0.json"), "w") as f:
    json.dump({"rank": 0, "start": start, "end": time.time()}, f)
"""


@pytest.mark.torchrun
def test_launches_run_one_after_another_on_exclusive_process_gpus(tmp_path, write_script,
                                                                    monkeypatch):  # fmt: skip
    """Side by side they would both create a context on cuda:0, which such a GPU refuses."""
    from ddp_tutorial.harness import launch as launch_module

    script = write_script("stamps.py", STAMPS)
    specs = {n: LaunchSpec(script, nproc=1, run_dir=tmp_path / n, echo=False) for n in "ab"}

    def spans(results):
        (a,), (b,) = results["a"].records, results["b"].records
        return a, b

    monkeypatch.setattr(launch_module, "exclusive_gpus", lambda env=None: True)
    a, b = spans(run_together(specs))
    assert a["end"] <= b["start"] or b["end"] <= a["start"], "one after another"
    # start(), as lessons 01, 05, 08 and 11 use it for launches side by side: the same
    first, second = (launch_module.start(script, nproc=1, run_dir=tmp_path / f"start-{n}",
                                         echo=False) for n in "ab")  # fmt: skip
    a, b = spans({"a": first.wait(), "b": second.wait()})
    assert a["end"] <= b["start"], "the second launch waited for the first"
    # lesson 09's lab (every case gloo on the CPU): side by side all the same, or its
    # 240 s hang would hold up every case started after it
    from ddp_tutorial.lessons.debugging import start_cases

    lab = start_cases(specs, run_dir=tmp_path / "lab")
    assert not any(la.done for la in lab.values()), "start_cases waited for a launch"
    assert all(r.ok for r in (la.wait() for la in lab.values()))


STAMPS_PER_RANK = """
import json, os, sys, time
start = time.time()
time.sleep(1.5)
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": int(rank), "start": start, "end": time.time()}, f)
"""


def _lesson_helper(notebook: str, name: str, **names) -> object:
    """The function ``name`` as a lesson's code cell defines it, with that cell's imports."""
    import ast
    import json

    from conftest import REPO

    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    for cell in cells:
        tree = ast.parse("".join(cell["source"])) if cell["cell_type"] == "code" else None
        defs = [n for n in (tree.body if tree else []) if getattr(n, "name", None) == name]
        if defs:
            imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
            code = compile(ast.Module([*imports, *defs], type_ignores=[]), notebook, "exec")
            exec(code, names)
            return names[name]
    raise LookupError(f"{notebook} defines no {name}()")


@pytest.mark.torchrun
def test_lesson_08_runs_take_turns_on_exclusive_process_gpus(nvml, monkeypatch, tmp_path,
                                                             write_script):  # fmt: skip
    """Lesson 08 starts its runs side by side; on EXCLUSIVE_PROCESS GPUs they must take turns."""
    from conftest import fake_gpu

    for name in ("CUDA_VISIBLE_DEVICES", "DDP_TUTORIAL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    nvml([fake_gpu(0, exclusive=True), fake_gpu(1, exclusive=True)])  # the ranks never see it
    launch = _lesson_helper("08_fault_tolerance.ipynb", "launch", TIMEOUT_S=120)
    script = write_script("stamps.py", STAMPS_PER_RANK)
    first, second = (launch(script, n, run=tmp_path / n) for n in "ab")
    a_end = max(r["end"] for r in first.wait().records)
    b_start = min(r["start"] for r in second.wait().records)
    assert a_end <= b_start, "the second launch started before the first had ended"


def test_exclusive_gpus_is_read_from_nvml_and_ignored_for_gloo(nvml):
    from conftest import fake_gpu
    from ddp_tutorial.harness.launch import exclusive_gpus

    nvml([fake_gpu(0, exclusive=True), fake_gpu(1)])
    assert exclusive_gpus({})
    assert not exclusive_gpus({"DDP_TUTORIAL_BACKEND": "gloo"})
    assert not exclusive_gpus({"CUDA_VISIBLE_DEVICES": "1"})
    nvml([fake_gpu(0), fake_gpu(1)])
    assert not exclusive_gpus({})


ENV_RECORD = """
import json, os, sys
out, rank = sys.argv[-1], os.environ["RANK"]
seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DDP_TUTORIAL_BACKEND")}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": int(rank), **seen}, f)
"""


def _mig_machine(nvml, monkeypatch):
    from conftest import fake_gpu

    for name in ("CUDA_VISIBLE_DEVICES", "DDP_TUTORIAL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    nvml([fake_gpu(0, mig=True), fake_gpu(1), fake_gpu(2), fake_gpu(3)])


def test_a_mig_machine_plans_the_cpu_instead_of_raising(nvml, monkeypatch, tmp_path):
    """MIG: the course refuses it for ranks, so launches run on the CPU (gloo), saying why."""
    from ddp_tutorial.devices import DeviceError
    from ddp_tutorial.harness.gpu_plan import launch_gpu_count, mig_fallback
    from ddp_tutorial.harness.launch import default_nproc
    from ddp_tutorial.harness.multinode import node_gpus_here

    _mig_machine(nvml, monkeypatch)
    assert default_nproc() == 2  # the CPU plan, as lesson 00's report says
    assert launch_gpu_count() == 0  # what the lessons' GPU branches ask: none, they run on the CPU
    from ddp_tutorial.harness.gpu_plan import gpu_branch_note

    assert gpu_branch_note(2) == gpu_branch_note(2, {"CUDA_VISIBLE_DEVICES": "MIG-0a"}) == ""
    assert launch_gpu_count({"CUDA_VISIBLE_DEVICES": "1,2,3"}) == 3
    hide, why = mig_fallback()
    assert hide == {"CUDA_VISIBLE_DEVICES": "", "DDP_TUTORIAL_BACKEND": "gloo"}
    assert "MIG mode is on for GPU(s) [0]" in why and "runs on the CPU with gloo" in why
    spec = LaunchSpec(DEMOS / "hello.py", echo=False)
    assert spec.command(tmp_path)[spec.command(tmp_path).index("--nproc-per-node") + 1] == "2"
    with pytest.warns(RuntimeWarning, match="MIG mode is on"):
        env = spec.child_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DDP_TUTORIAL_BACKEND"] == "gloo"
    envs, decision = node_gpus_here(2)
    assert envs == [hide, hide] and "MIG mode is on" in decision
    # GPUs chosen without MIG are used as they are; a mistyped list is still the user's error
    assert default_nproc({"CUDA_VISIBLE_DEVICES": "1,2,3"}) == 3
    assert mig_fallback({"CUDA_VISIBLE_DEVICES": "1,2,3"}) == ({}, "")
    with pytest.raises(DeviceError, match="appears twice"):
        default_nproc({"CUDA_VISIBLE_DEVICES": "1,1"})


@pytest.mark.torchrun
def test_a_launch_on_a_mig_machine_runs_its_ranks_on_the_cpu(nvml, monkeypatch, tmp_path,
                                                             write_script):  # fmt: skip
    _mig_machine(nvml, monkeypatch)
    script = write_script("env_record.py", ENV_RECORD)
    with pytest.warns(RuntimeWarning, match="MIG mode is on"):
        result = torchrun(script, run_dir=tmp_path / "run", echo=False, timeout=120)
    assert [r["rank"] for r in result.records] == [0, 1]
    assert {(r["CUDA_VISIBLE_DEVICES"], r["DDP_TUTORIAL_BACKEND"]) for r in result.records} == {
        ("", "gloo")
    }


def test_gpus_this_torch_cannot_use_run_the_lessons_on_the_cpu_saying_why(nvml, monkeypatch):
    """Helper 85: NVML lists the GPUs when torch sees none (a CUDA 13 build on a driver for
    12.4; a CPU-only build): the lessons counted them and ran their GPU branches, with the
    ranks on gloo (lesson 03's tensor on the GPU, lesson 12's GPU memory failed). Now the
    launches' count is 0, the lesson's note says why, the monitor samples the ranks."""
    import torch

    from ddp_tutorial.harness.gpu_plan import gpu_branch_note, launch_gpu_count, torch_has_no_gpu
    from ddp_tutorial.harness.launch import default_nproc
    from ddp_tutorial.harness.monitor import Monitor

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    nvml([fake_gpu(0), fake_gpu(1)], driver_cuda=12040)
    assert launch_gpu_count() == 0
    assert default_nproc() == 2  # helper 154: 2 gloo ranks, not one per GPU torch cannot use
    from ddp_tutorial.harness.environment import environment_report

    plan = environment_report()["plan"]  # helper 159: lesson 00's plan said nccl on 2 GPUs
    assert plan["backend"] == "gloo" and "built for CUDA 13.0" in plan["reason"], plan
    assert "built for CUDA 13.0, the driver supports 12.4" in gpu_branch_note(2)
    monitor = Monitor(nproc=2)
    assert monitor._ranks_gpus([fake_gpu(0), fake_gpu(1)]) == [] and "13.0" in monitor.note
    monkeypatch.setattr(torch.version, "cuda", None)
    assert launch_gpu_count() == 0 and "CPU-only build" in gpu_branch_note(2)
    assert torch_has_no_gpu(), "the lessons' in-kernel CUDA demos take their CPU branch"
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a build the driver runs: counted
    assert launch_gpu_count() == 2 == default_nproc() and gpu_branch_note(2) == ""
    assert not torch_has_no_gpu()


def test_the_ranks_number_gpus_as_nvml_does_unless_told_otherwise(monkeypatch):
    """Helper 85: the monitor and lesson 03 map cuda:N to a card in NVML's order (PCI bus);
    CUDA's default puts the fastest card first, another one on a node of mixed models. The
    launches set CUDA_DEVICE_ORDER=PCI_BUS_ID; a value the user set stands."""
    spec = LaunchSpec(DEMOS / "hello.py", echo=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert spec.child_env()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    assert spec.child_env()["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
