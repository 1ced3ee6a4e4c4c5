"""Process trees: start a launcher in a session of its own, end it with every descendant.

torchrun starts each worker in a session of its own, and workers start
DataLoader workers: a single ``killpg`` would orphan them. These two
functions are the only places the harness starts or ends such a tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

PLAIN_OUTPUT = {"PYTHONUNBUFFERED": "1", "PYTHON_COLORS": "0"}
"""Every process the harness starts: its output as it happens, and in plain text. Python 3.13+
colours its tracebacks where ``FORCE_COLOR`` is set, and ipykernel sets it for a notebook's
subprocesses: a lesson reading a real error message would read escape codes."""


def spawn(command: list[str], env: Mapping[str, str], with_stdin: bool) -> subprocess.Popen[str]:
    """Start torchrun: output line by line, in a session of its own.

    Its own session: a notebook's SIGINT does not hit the ranks raw, and
    :func:`kill_tree` ends everything on a timeout. The one place a launch
    becomes a process (the test suite checks that fast tests never get here).
    """
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        env=dict(env),
        start_new_session=True,
    )


def tree_root(proc: subprocess.Popen[str]) -> psutil.Process | None:
    """``proc`` as psutil sees it, taken while this process has not reaped it (right after
    the spawn): psutil then checks at each signal that the pid is still the same process."""
    try:
        return psutil.Process(proc.pid)
    except psutil.NoSuchProcess:  # reaped meanwhile by another thread's wait()
        return None


def kill_tree(root: subprocess.Popen[str] | psutil.Process, grace_s: float = 5.0) -> list[int]:
    """Terminate ``root`` and every descendant; SIGKILL whatever outlives ``grace_s``.

    Returns the pids that were found. torchrun starts each worker in a session
    of its own, so a single ``killpg`` would orphan them; walking the tree
    reaches them all (and their DataLoader workers).

    ``root`` is the ``Popen`` that started the tree, or a ``psutil.Process`` taken
    while it ran, never a bare pid: once a process is reaped its number goes to the
    next process *or thread* (``psutil.Process(tid)`` works, and a signal sent to a
    thread's id ends its whole process), so a kill by number after the end can end
    a stranger (the likely end of a pytest worker that died inside a test that
    starts nothing).
    """
    if isinstance(root, subprocess.Popen):
        if root.poll() is not None:  # reaped: its children, if any, were reparented already
            return []
        root = tree_root(root)  # unreaped: the pid stays ours, even as a zombie
    if root is None or not root.is_running():  # gone, or its pid reused since it was taken
        return []
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            for child in p.children(recursive=True):
                child.kill()
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in procs]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie that only waits for its parent is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def matching(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``marker``: what a launch left behind."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@dataclass
class CommandResult:
    """A plain command run with input: what it printed and how it ended."""

    command: list[str]
    returncode: int | None
    output: str
    seconds: float
    timed_out: bool


def run_command(
    command: Sequence[str],
    stdin: str = "",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> CommandResult:
    """Run ``command`` with ``stdin`` as its input; kill its whole tree after ``timeout``.

    A plain command (``python -m pdb script.py``, a gpu-check step), not a torchrun
    launch: :mod:`ddp_tutorial.harness.launch` runs those.

    Output is stdout and stderr together, as a terminal shows them. After the
    input ends the command reads end-of-file — pdb quits on it — so it cannot
    wait for a keyboard that is not there.
    """
    began = time.monotonic()
    proc = subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, **PLAIN_OUTPUT, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(stdin, timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        timed_out = True
    return CommandResult(
        list(command), proc.returncode, output, time.monotonic() - began, timed_out
    )
