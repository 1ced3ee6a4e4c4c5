"""The debugging lab's helpers and what the lesson does not run itself.

Every broken case with its real message, every fix in one launch, pdb on a
world of one and ``torch.distributed.breakpoint`` are asserted by
notebooks/09_debugging.ipynb on real launches of scripts/demos/debug_lab.py. Here:
the lab's input checks, a breakpoint that gets no input, and the pure
helpers. Nothing may hang: every launch has a hard timeout.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time

import pytest

from conftest import DEMOS, REPO, load_script, processes_running
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.harness.processes import run_command
from ddp_tutorial.lessons.debugging import key_lines

LAB = DEMOS / "debug_lab.py"
HARD_TIMEOUT = 150


@pytest.mark.torchrun
def test_breakpoint_without_input_does_not_hang(tmp_path):
    # pdb reads end-of-file at once and quits: rank 0 fails, torchrun stops rank 1.
    run = torchrun(LAB, "--case", "breakpoint", nproc=2, run_dir=tmp_path, echo=False,
                   timeout=HARD_TIMEOUT, check=False, stdin="")  # fmt: skip
    assert not run.ok and not run.timed_out
    first = run.failures[0]
    assert (first.rank, first.exitcode) == (0, 1), "rank 0 is the one in pdb"
    assert "(Pdb)" in run.rank_log(0) and "bdb.BdbQuit" in first.traceback, "pdb read EOF"
    assert "dist.breakpoint(rank=0)" in first.traceback


def test_lab_refuses_bad_input(monkeypatch, capsys):
    lab = load_script("demos/debug_lab.py")
    monkeypatch.setattr(sys, "argv", ["debug_lab.py", "--case", "all"])
    with pytest.raises(SystemExit) as info:
        lab.parse_args()
    assert info.value.code == 2
    assert "--case all runs the fixed versions only" in capsys.readouterr().err


@pytest.mark.torchrun  # a Python process that waits forever
def test_run_command_kills_what_waits_forever():
    marker = "ddp-tutorial-test-sleeper"
    t0 = time.monotonic()
    result = run_command(
        [sys.executable, "-c", f"import time; input(); time.sleep(600)  # {marker}"],
        stdin="go\n",
        timeout=2,
    )
    assert result.timed_out and time.monotonic() - t0 < 30
    assert not processes_running(marker)


@pytest.mark.torchrun  # a Python process that raises
def test_commands_and_launches_print_plain_tracebacks_under_a_notebook(monkeypatch):
    """ipykernel sets FORCE_COLOR for a notebook's subprocesses, and Python 3.13+ then colours
    its tracebacks: lesson 12 found no "...Error:" line in escape codes on 3.13.0. Every process
    the harness starts gets PYTHON_COLORS=0 (launches too), and prints plain text."""
    from ddp_tutorial.harness.launch import LaunchSpec

    monkeypatch.setenv("FORCE_COLOR", "1")
    code = "import os; print('colors', os.environ.get('PYTHON_COLORS')); 1 / 0"
    result = run_command([sys.executable, "-c", code], timeout=60)
    assert "colors 0" in result.output and "\x1b[" not in result.output, repr(result.output)
    assert re.search(r"^ZeroDivisionError: division by zero$", result.output, re.M)
    assert LaunchSpec(LAB, ()).child_env()["PYTHON_COLORS"] == "0"


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


@pytest.mark.torchrun  # a Python process left behind on purpose
def test_lab_shows_the_typed_command_and_finds_only_its_own_leftovers(tmp_path):
    """``Lab.command`` is what a user types; ``left_behind`` matches run dirs word for word."""
    import socket
    from concurrent.futures import Future, ThreadPoolExecutor
    from types import SimpleNamespace

    from ddp_tutorial.harness.launch import LaunchSpec
    from ddp_tutorial.lessons.debugging import Lab

    def fake(name: str, env: dict[str, str] | None = None) -> SimpleNamespace:
        run_dir = tmp_path / name
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        logs = ["--log-dir", str(run_dir / "logs"), "--tee", "3"]
        script = ["../scripts/demos/debug_lab.py", "--case", "unused", "--out", str(run_dir)]
        command = [*torchrun, "--nproc-per-node", "2", *logs, *script]
        return SimpleNamespace(spec=LaunchSpec("x.py", env=env), command=command,
                               run_dir=run_dir, done=True)  # fmt: skip

    holder = socket.create_server(("127.0.0.1", 0))
    pool = ThreadPoolExecutor(1)
    launches = {"a": fake("run", {"TORCH_DISTRIBUTED_DEBUG": "INFO"}), "b": fake("run-2")}
    lab = Lab(launches, Future(), holder, "../scripts/demos", pool)
    assert lab.command("a") == (
        "$ TORCH_DISTRIBUTED_DEBUG=INFO torchrun --standalone --nproc-per-node 2 "
        "scripts/demos/debug_lab.py --case unused"
    )
    # a process of launch b (its run dir "run-2" starts with a's "run") is still alive
    code = "import time; time.sleep(60)"
    sleeper = subprocess.Popen([sys.executable, "-c", code, "--out", str(tmp_path / "run-2")])
    try:
        assert lab.left_behind(["a"]) == []
        assert lab.left_behind(["b"]) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
        lab.close()
    assert holder.fileno() == -1  # close() freed the port


def test_the_lab_imports_dynamo_early_for_exactly_the_cases_that_wrap_in_ddp():
    """A DDP case imports ``torch._dynamo`` before the short timeout; the others need not."""
    import inspect

    from conftest import load_script

    lab = load_script("demos/debug_lab.py")
    wrapping = {name for name, fn in lab.CASES.items() if "wrap(" in inspect.getsource(fn)}
    assert wrapping == lab.DDP_CASES


def _markdown_blocks(notebook: str) -> list[str]:
    """The ```python blocks of a lesson's markdown cells: what a reader sees without running."""
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.findall(r"```python\n(.*?)\n```", text, re.S)


def _top_level(path) -> dict[str, str]:
    """Every top-level function and class of a file, as its source lines (comments kept)."""
    text = path.read_text()
    lines = text.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno])
            for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}  # fmt: skip


def test_the_cases_lesson_09_shows_are_the_code_that_ran():
    # Lesson 09 shows each broken case's code in its markdown (readable in a notebook without
    # outputs); it must be debug_lab.py's, line for line, for every case the lab launches.
    defs = _top_level(LAB)
    shown = []
    for block in _markdown_blocks("09_debugging.ipynb"):
        if not block.startswith(("def case_", "class ")):
            continue
        for piece in re.split(r"\n\n\n(?=def |class )", block):
            name = re.match(r"(?:def|class) (\w+)", piece).group(1)
            assert piece == defs.get(name), f"lesson 09 shows {name} unlike debug_lab.py"
            shown.append(name)
    assert shown == ["WithAux", "case_unused", "case_skip", "case_shape", "case_rank0_eval",
                     "case_uneven"]  # fmt: skip


@pytest.mark.torchrun  # plain python processes, no torchrun
def test_detail_beside_ddp_crashes_the_constructor_on_a_machine_without_a_gpu():
    """Helper 119, then lesson 09's note: TORCH_DISTRIBUTED_DEBUG=DETAIL and
    DistributedDataParallel(...) on a CUDA build of torch without a GPU die of SIGSEGV inside
    the constructor (c10d::Logger::set_env_variables), in most runs, not all (3 of 4 here: a
    memory error). Up to 6 runs: one crash, with faulthandler's stack in _ddp_init_helper,
    keeps the note true, and explain names it; INFO builds the same model."""
    import signal

    import torch

    from ddp_tutorial.harness.explain import keys

    if torch.version.cuda is None or torch.cuda.is_available():
        pytest.skip("measured on a CUDA build of torch, on a machine without a GPU")
    command = [sys.executable, str(DEMOS / "debug_lab.py"), "--case", "wrap"]
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "PYTHONFAULTHANDLER": "1"}
    for _ in range(6):
        run = run_command(command, env=detail, timeout=120)
        if run.returncode == -signal.SIGSEGV:
            break
        assert run.returncode == 0, run.output[-2000:]
    else:
        pytest.fail("6 runs under DETAIL without a crash: lesson 09's note is out of date")
    assert "in _ddp_init_helper" in run.output and keys(run.output) == ["killed-sigsegv"]
    info = run_command(command, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}, timeout=120)
    assert info.returncode == 0 and "case wrap (fix=False) finished" in info.output, info.output
