"""Look inside a hung job from outside: ``py-spy dump`` on every rank of a launch.

A job that hangs prints nothing: every rank waits in some collective for a
partner that is elsewhere. The question is *which* collective each rank is
in, and ``py-spy dump --pid P`` answers it without stopping or changing the
process — it reads the Python stack from the process's memory (ptrace), so
it works on a job that was started without any debugging option, which is
the job you have when it hangs. Run it on every rank: the rank whose stack
differs from the others is the one out of step.

``py-spy`` needs permission to attach: root, or the same user with
``/proc/sys/kernel/yama/ptrace_scope`` at 0 or 1 (1 allows only a parent,
unless run as root); in a container ``--cap-add SYS_PTRACE``. Where that is
missing, :func:`dump_stack` says so instead of failing obscurely.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ddp_tutorial.harness.processes import run_command

PTRACE_DENIED = (
    "py-spy may not attach here (ptrace is not permitted): run it as root or with sudo, "
    "set /proc/sys/kernel/yama/ptrace_scope to 0, or in a container add --cap-add SYS_PTRACE"
)
# A frame line of `py-spy dump`: "    all_reduce (torch/distributed/distributed_c10d.py:2871)"
_FRAME = re.compile(r"^\s+(?P<function>[\w<>.]+) \((?P<file>[^:()]+):\d+\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # py-spy colours its output when it thinks it may
_WRAPPERS = {"wrapper", "inner", "_fn"}  # decorator frames torch puts around a collective


@dataclass
class StackDump:
    """One process's Python stacks, as ``py-spy dump`` printed them (or why it could not)."""

    pid: int
    ok: bool
    text: str  # py-spy's output, or the reason it failed

    @property
    def collective(self) -> str | None:
        """The ``torch.distributed`` call this process waits in, or None (see :func:`stuck_in`)."""
        return stuck_in(self.text) if self.ok else None


def py_spy() -> str | None:
    """The ``py-spy`` executable: beside this Python (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def stuck_in(dump: str) -> str | None:
    """The innermost ``torch.distributed`` function in a dump: where the first thread waits.

    py-spy prints the innermost frame first; decorator frames torch wraps
    around collectives (``wrapper``) are skipped.
    """
    for line in dump.splitlines():
        match = _FRAME.match(line)
        name = match["function"].rsplit(".", 1)[-1] if match else ""
        if match and "torch/distributed/" in match["file"] and name not in _WRAPPERS:
            return match["function"]
    return None


def explain(pid: int, returncode: int, output: str) -> str:
    """What a failed ``py-spy dump`` means, in words (a missing permission, a gone process)."""
    lowered = output.lower()
    if "permission" in lowered or "not permitted" in lowered:
        return f"pid {pid}: {PTRACE_DENIED}. py-spy said: {output.strip()[-300:]}"
    if not psutil.pid_exists(pid):
        return f"pid {pid}: the process has ended"
    return f"pid {pid}: py-spy exited with {returncode}: {output.strip()[-500:]}"


def dump_stack(pid: int, timeout: float = 30.0) -> StackDump:
    """``py-spy dump --pid PID``: the Python stack of every thread, without stopping the process."""
    exe = py_spy()
    if exe is None:
        return StackDump(pid, False, "py-spy is not installed (pip install py-spy)")
    done = run_command([exe, "dump", "--pid", str(pid)], timeout=timeout)  # tree killed on time
    if done.timed_out:
        return StackDump(pid, False, f"pid {pid}: py-spy did not answer within {timeout:.0f} s")
    said = _ANSI.sub("", done.output)
    if done.returncode != 0:
        return StackDump(pid, False, explain(pid, done.returncode or -1, said))
    return StackDump(pid, True, said)


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the workers a torchrun launcher started (its children with a RANK).

    DataLoader workers inherit RANK too, but they are the ranks' children,
    not the launcher's, so they are not counted.
    """
    ranks = {}
    for child in psutil.Process(launcher_pid).children():
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            ranks[int(rank)] = child.pid
    return dict(sorted(ranks.items()))


def dump_ranks(launcher_pid: int, settle_s: float = 10.0) -> dict[int, StackDump]:
    """A :class:`StackDump` of every rank of a running launch, in rank order.

    Within ``settle_s`` it dumps again until every rank is inside a
    ``torch.distributed`` call (a rank still importing torch is not hung yet).
    """
    deadline = time.monotonic() + settle_s
    while True:
        dumps = {rank: dump_stack(pid) for rank, pid in rank_pids(launcher_pid).items()}
        settled = dumps and all(d.collective or not d.ok for d in dumps.values())
        if settled or time.monotonic() > deadline:
            return dumps
        time.sleep(0.5)
