"""Process trees: start a launcher in a session of its own, end it with every descendant.

torchrun starts each worker in a session of its own, and workers start
DataLoader workers: a single ``killpg`` would orphan them. These two
functions are the only places the harness starts or ends such a tree.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping

import psutil


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


def kill_tree(pid: int, grace_s: float = 5.0) -> list[int]:
    """Terminate ``pid`` and every descendant; SIGKILL whatever outlives ``grace_s``.

    Returns the pids that were found. torchrun starts each worker in a session
    of its own, so a single ``killpg`` would orphan them; walking the tree
    reaches them all (and their DataLoader workers).
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
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
