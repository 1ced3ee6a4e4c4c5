"""``py-spy dump`` from the harness (ddp_tutorial.harness.stacks).

Lesson 09 dumps every rank of a real hung torchrun launch and asserts which
collective each waits in; here: reading a dump, the words for a refused
attach, and one real dump of a plain Python process (py-spy must be able to
attach on this machine: the course's dependency list installs it).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ddp_tutorial.harness.stacks import PTRACE_DENIED, dump_stack, explain, py_spy, stuck_in

DUMP = """Process 4242: python -u scripts/demos/debug_lab.py --case skip
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3913)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    case_skip (debug_lab.py:101)
    <module> (debug_lab.py:236)
"""


def test_stuck_in_names_the_innermost_collective():
    assert stuck_in(DUMP) == "all_reduce"
    wrapped_only = DUMP.replace("    all_reduce (torch/distributed/distributed_c10d.py:3913)\n", "")
    assert stuck_in(wrapped_only) is None  # a decorator frame is not a collective
    assert stuck_in("Thread 1 (idle)\n    main (train.py:10)\n") is None


def test_a_refused_attach_is_explained():
    said = "Error: Operation not permitted (os error 1)"
    assert PTRACE_DENIED in explain(1, 1, said)
    assert "SYS_PTRACE" in PTRACE_DENIED


@pytest.mark.torchrun  # a real Python process to attach to
def test_py_spy_dumps_a_real_process():
    assert py_spy() is not None, "py-spy is a dependency: pip install -e ."
    code = (
        "import time\ndef waiting_here():\n    print('in', flush=True)\n    time.sleep(60)\n"
        "waiting_here()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in\n"  # it is in the function (or has died: "")
        deadline = time.monotonic() + 30  # a dump may miss the frame while it is entered
        dump = dump_stack(proc.pid)
        while not (dump.ok and "waiting_here" in dump.text) and time.monotonic() < deadline:
            time.sleep(0.3)
            dump = dump_stack(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert dump.ok, dump.text  # here attaching is allowed: a failure is a real one
    assert "waiting_here (<string>:4)" in dump.text
    assert "\x1b[" not in dump.text  # colours stripped
