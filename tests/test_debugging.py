"""The debugging lab: every broken case is detected (fast, with its real message); every fix works.

The broken launches run side by side in one module-scoped fixture (their time
is mostly spent waiting for the short timeout), then one test per case reads
its result. Nothing may hang: every launch has a hard timeout, and the
process-group timeout ends each hang after HANG seconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, SCRIPTS, processes_running
from ddp_tutorial.debugging import Case, key_lines, run_cases, run_with_input
from ddp_tutorial.launch import torchrun

LAB = SCRIPTS / "debug_lab.py"
HANG = 4
HARD_TIMEOUT = 150


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    hang = ["--timeout", HANG]
    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        cases = {
            "port": Case(SCRIPTS / "hello.py", standalone=False,
                         torchrun_args=["--master-addr", "127.0.0.1", "--master-port", str(port)]),
            "unused": Case(LAB, ["--case", "unused"], env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
            "skip": Case(LAB, ["--case", "skip", *hang]),
            "skip-monitored": Case(LAB, ["--case", "skip", "--monitored", *hang]),
            "shape": Case(LAB, ["--case", "shape"], env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
            "shape-unchecked": Case(LAB, ["--case", "shape", *hang]),
            "rank0-eval": Case(LAB, ["--case", "rank0-eval", *hang]),
            "uneven": Case(LAB, ["--case", "uneven", *hang]),
        }  # fmt: skip
        t0 = time.monotonic()
        results = run_cases(cases, timeout=HARD_TIMEOUT, run_dir=tmp_path_factory.mktemp("lab"))
        elapsed = time.monotonic() - t0
    assert not processes_running(str(LAB)), "a broken case left processes behind"
    return results, elapsed


@pytest.mark.slow  # shares one run of eight broken launches
def test_lab_cases_all_fail_on_their_own(lab):
    results, elapsed = lab
    for name, run in results.items():
        assert not run.ok, f"{name} should fail"
        assert not run.timed_out, f"{name} needed the hard timeout: a hang was not ended"
    assert elapsed < HARD_TIMEOUT


@pytest.mark.slow  # shares one run of eight broken launches
def test_port_in_use(lab):
    run = lab[0]["port"]
    assert "EADDRINUSE" in run.output and not run.records
    assert any("address already in use" in ln for ln in key_lines(run.output))


@pytest.mark.slow  # shares one run of eight broken launches
def test_unused_parameters_named_with_debug_info(lab):
    out = lab[0]["unused"].output
    assert "Expected to have finished reduction in the prior iteration" in out
    assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in out


@pytest.mark.slow  # shares one run of eight broken launches
def test_skipped_collective_hangs_until_the_timeout(lab):
    out = lab[0]["skip"].output
    assert f"Timed out waiting {HANG * 1000}ms" in out


@pytest.mark.slow  # shares one run of eight broken launches
def test_monitored_barrier_names_the_missing_rank(lab):
    run = lab[0]["skip-monitored"]
    assert "Rank 1 failed to pass monitoredBarrier" in run.output
    assert "failed to pass monitoredBarrier" in run.rank_log(0, "stderr")  # said by rank 0


@pytest.mark.slow  # shares one run of eight broken launches
def test_detail_names_the_shape_mismatch(lab):
    out = lab[0]["shape"].output
    assert "Detected mismatch between collectives on ranks" in out
    assert "Tensor Tensor shapes: 2vs 3" in out


@pytest.mark.slow  # shares one run of eight broken launches
def test_unchecked_shape_mismatch_is_not_a_clean_run(lab):
    # Without DETAIL gloo does not compare shapes: a crash, a hang or a wrong sum, never a
    # clean run in which both ranks agree on the counts.
    run = lab[0]["shape-unchecked"]
    counts = [r["cases"]["shape"]["counts"] for r in run.records]
    assert not run.ok or len({tuple(c) for c in counts}) > 1


@pytest.mark.slow  # shares one run of eight broken launches
def test_rank0_only_evaluation_hangs(lab):
    out = lab[0]["rank0-eval"].output
    assert f"Timed out waiting {HANG * 1000}ms" in out


@pytest.mark.slow  # shares one run of eight broken launches
def test_uneven_inputs_hang(lab):
    assert f"Timed out waiting {HANG * 1000}ms" in lab[0]["uneven"].output


def test_every_fix_works_and_breakpoint_stops_rank_0(tmp_path):
    commands = "up\np answer, info.rank\nc\n"
    run = torchrun(LAB, "--case", "all", "--fix", "--breakpoint", nproc=2, run_dir=tmp_path,
                   echo=False, timeout=HARD_TIMEOUT, stdin=commands)  # fmt: skip
    cases = [r["cases"] for r in run.records]
    assert [c["uneven"]["batches"] for c in cases] == [2, 3]
    assert all(c["skip"]["correct"] == [1.0, 2.0] for c in cases)
    assert cases[0]["shape"]["counts"] == cases[1]["shape"]["counts"]
    assert cases[1]["rank0-eval"]["accuracy"] is None and cases[0]["rank0-eval"]["accuracy"] >= 0
    assert all(len(c["unused"]["losses"]) == 3 for c in cases)
    assert "(Pdb) (40, 0)" in run.output
    assert [c["breakpoint"]["answer"] for c in cases] == [42, 43]


def test_breakpoint_without_input_does_not_hang(tmp_path):
    # pdb reads end-of-file at once and quits: rank 0 fails, torchrun stops rank 1.
    run = torchrun(LAB, "--case", "breakpoint", nproc=2, run_dir=tmp_path, echo=False,
                   timeout=HARD_TIMEOUT, check=False, stdin="")  # fmt: skip
    assert not run.ok and not run.timed_out


def test_world_of_one_under_pdb():
    result = run_with_input(
        [sys.executable, "-m", "pdb", str(LAB), "--case", "keys"],
        stdin="continue\nup\np sorted(saved)\nquit\n",
        timeout=HARD_TIMEOUT,
        cwd=str(REPO),
    )
    assert not result.timed_out
    assert 'Unexpected key(s) in state_dict: "module.weight", "module.bias"' in result.output
    assert "Uncaught exception. Entering post mortem debugging" in result.output
    assert "['module.bias', 'module.weight']" in result.output


def test_world_of_one_fixed_runs_plainly():
    done = subprocess.run([sys.executable, str(LAB), "--case", "all", "--fix"],
                          capture_output=True, text=True, timeout=HARD_TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "case uneven (fix=True) finished" in done.stdout


def test_lab_refuses_bad_input():
    done = subprocess.run([sys.executable, str(LAB), "--case", "all"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--case all runs the fixed versions only" in done.stderr


def test_run_with_input_kills_what_waits_forever():
    marker = "ddp-tutorial-test-sleeper"
    t0 = time.monotonic()
    result = run_with_input(
        [sys.executable, "-c", f"import time; input(); time.sleep(600)  # {marker}"],
        stdin="go\n",
        timeout=2,
    )
    assert result.timed_out and time.monotonic() - t0 < 30
    assert not processes_running(marker)


def test_key_lines_keeps_each_message_once_with_its_rank():
    output = "\n".join([
        "[default0]:[rank0]: RuntimeError: Timed out waiting 5000ms for recv operation",
        "[default1]:[rank1]: RuntimeError: Timed out waiting 5000ms for recv operation",
        "[default0]:[rank0]: RuntimeError: Timed out waiting 5000ms for recv operation",
        "  RuntimeError: Timed out waiting 5000ms for recv operation",
        "[rank0]:[E1129 19:39:51.233130989 ProcessGroupGloo.cpp:2948] [Rank 0]: Rank 1 failed "
        "to pass monitoredBarrier in 5000 ms",
        "an unrelated line",
    ])  # fmt: skip
    assert key_lines(output) == [
        "[rank0]: RuntimeError: Timed out waiting 5000ms for recv operation",
        "[rank1]: RuntimeError: Timed out waiting 5000ms for recv operation",
        "[rank0]:[Rank 0]: Rank 1 failed to pass monitoredBarrier in 5000 ms",
    ]
    assert key_lines("x" * 50 + " EADDRINUSE", width=20) == ["x" * 19 + "…"]
