"""The launcher against the real torchrun: success, failure, timeout, env, bad input."""

from __future__ import annotations

import os
import time

import pytest

from conftest import SCRIPTS, processes_running
from ddp_tutorial.launch import LaunchError, LaunchTimeout, torchrun

FAILING = """
import os
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("deliberate failure on rank 1")

if __name__ == "__main__":
    main()
"""

HANGING = """
import os, sys, time
from ddp_tutorial.records import write_rank_record
write_rank_record(sys.argv[-1], {"pid": os.getpid()})
print("rank", os.environ["RANK"], "hanging", flush=True)
time.sleep(3600)
"""

ENV_REPORT = """
import os, sys
from ddp_tutorial.records import write_rank_record
write_rank_record(sys.argv[-1], {"marker": os.environ.get("DDP_TEST_MARKER"),
                                  "omp": os.environ.get("OMP_NUM_THREADS")})
"""


def test_hello_two_ranks(tmp_path):
    result = torchrun(SCRIPTS / "hello.py", nproc=2, run_dir=tmp_path / "run", echo=False)
    assert result.ok and result.returncode == 0
    assert [r["rank"] for r in result.records] == [0, 1]
    assert {r["all_reduce_sum"] for r in result.records} == {1.0}
    assert len({r["pid"] for r in result.records}) == 2
    # output streamed with rank prefixes, and per-rank logs kept on disk
    assert "[default0]:rank 0/2" in result.output and "[default1]:rank 1/2" in result.output
    assert "rank 1/2" in result.rank_log(1)


def test_failing_rank_names_rank_and_traceback(tmp_path, write_script):
    script = write_script("fails.py", FAILING)
    with pytest.raises(LaunchError) as info:
        torchrun(script, nproc=2, run_dir=tmp_path / "run", echo=False, out_flag=None)
    message = str(info.value)
    assert "rank 1 exited with code 1" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert 'fails.py", line' in message  # the traceback tail, not just the summary
    failures = info.value.result.failures
    assert failures[0].rank == 1 and failures[0].exitcode == 1


def test_check_false_returns_result(tmp_path, write_script):
    script = write_script("fails.py", FAILING)
    result = torchrun(
        script, nproc=2, run_dir=tmp_path / "r", echo=False, check=False, out_flag=None
    )
    assert not result.ok and result.returncode != 0 and result.failures[0].rank == 1


def test_timeout_kills_everything(tmp_path, write_script):
    script = write_script("hangs_for_test.py", HANGING)
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        # 20 s: both ranks must have started (torch's import alone takes seconds on a busy box)
        torchrun(script, nproc=2, run_dir=tmp_path / "run", timeout=20, echo=False)
    elapsed = time.monotonic() - start
    assert elapsed < 40, f"timeout took {elapsed:.0f}s to take effect"
    assert "did not finish within 20 s" in str(info.value)
    worker_pids = [r["pid"] for r in info.value.result.records]
    assert len(worker_pids) == 2, "both ranks had started before the timeout"
    time.sleep(0.5)
    assert processes_running(str(script)) == [], "no process of the launch may survive"
    for pid in worker_pids:
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_env_override_reaches_ranks(tmp_path, write_script):
    script = write_script("env_report.py", ENV_REPORT)
    result = torchrun(
        script,
        nproc=2,
        run_dir=tmp_path / "run",
        echo=False,
        env={"DDP_TEST_MARKER": "hello-from-parent", "OMP_NUM_THREADS": "1"},
    )
    assert [r["marker"] for r in result.records] == ["hello-from-parent"] * 2
    assert "DDP_TEST_MARKER" not in os.environ  # the parent's environment is untouched


def test_missing_script_fails_before_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_script.py"):
        torchrun(tmp_path / "no_such_script.py", nproc=2)


@pytest.mark.parametrize("nproc", [0, -1, 1.5])
def test_bad_nproc_fails_before_launch(nproc):
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        torchrun(SCRIPTS / "hello.py", nproc=nproc)


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
    from ddp_tutorial.launch import parse_failures

    failures = parse_failures(SIGKILLED_PEER_SUMMARY, tmp_path)
    assert [(f.rank, f.signal) for f in failures] == [(1, "SIGKILL"), (0, "SIGTERM")]


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

    from ddp_tutorial.launch import parse_failures

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
    from ddp_tutorial.launch import parse_failures

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
