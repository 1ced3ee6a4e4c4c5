"""Why a launch failed, in words: which rank, how (exit code or signal), its traceback tail.

torchrun's own summary is long and names ranks in an order that can
mislead (it may call a peer that it SIGTERM'd the "root cause"). These
functions read that summary, the error files that ``@record`` writes, and
the per-rank logs of ``--log-dir``, and turn them into one paragraph that a
notebook shows and a test can match.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddp_tutorial.harness.launch import RunResult

TRACEBACK_TAIL_LINES = 15


@dataclass
class RankFailure:
    """One failed rank as torchrun reported it."""

    rank: int | None
    local_rank: int | None
    exitcode: int | None
    signal: str | None
    traceback: str

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        how = (
            f"was killed by {self.signal}"
            if self.signal
            else f"exited with code {self.exitcode}"
            if self.exitcode is not None
            else "failed"
        )
        return f"{who} {how}"


class LaunchError(RuntimeError):
    """A launch failed; ``.result`` holds everything that was collected."""

    def __init__(self, message: str, result: RunResult):
        super().__init__(message)
        self.result = result


class LaunchTimeout(LaunchError):
    """A launch ran past its timeout and was killed (with every child process)."""


def tail(text: str, lines: int = TRACEBACK_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text`` (where an error message usually is)."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def newest_log(run_dir: Path, local_rank: int, stream: str = "stderr") -> Path | None:
    """The log torchrun's ``--log-dir`` got last from ``local_rank`` (``None`` if none).

    By time, not by name: a run directory can hold several launches (a
    resumed run) and restarts, and the launch ids in the paths are random.
    """
    logs = (run_dir / "logs").glob(f"**/attempt_*/{local_rank}/{stream}.log")
    return max(logs, key=lambda p: p.stat().st_mtime, default=None)


_ROOT_CAUSE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*\d+\)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<file>.*?)\s*\n"
    r"\s*traceback\s*:\s*(?P<tb>.*?)(?:\n\s*\n|\n=====|\Z)",
    re.S,
)


def crash_report(stderr: str) -> str:
    """From the line before faulthandler's "Fatal Python error" on, if there is one.

    A rank killed by a signal has no Python traceback; with
    ``PYTHONFAULTHANDLER`` its stderr ends with the C++ message (e.g.
    "terminate called without an active exception"), "Fatal Python error:
    Aborted" and every thread's stack, innermost frame first, then a long
    list of extension modules. Its first lines are what explain the crash.
    """
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            report = [x for x in lines[max(i - 1, 0) :] if not x.startswith("Extension modules:")]
            return "\n".join(report[:TRACEBACK_TAIL_LINES])
    return stderr


def _read_error_file(path: str) -> str:
    """The traceback that ``@record`` saved in torchrun's error file, if any."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    return str(message)


def _signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def parse_failures(output: str, run_dir: Path) -> list[RankFailure]:
    """Failed ranks from torchrun's summary, with each one's traceback tail.

    The summary lists each failed rank with its exit code (negative: killed
    by that signal) and the error file its ``@record`` wrote. Without an
    error file (a crash, a signal) we fall back to the rank's stderr log.
    """
    failures = []
    # torchrun lists the root cause last; report it first, then the ranks it took down.
    head, _, root = output.rpartition("Root Cause (first observed failure):")
    matches = list(_ROOT_CAUSE.finditer(root)) + list(_ROOT_CAUSE.finditer(head))
    for m in matches:
        rank, local, code = int(m["rank"]), int(m["local"]), int(m["code"])
        tb = ""
        if m["file"] and m["file"] != "<N/A>":
            tb = _read_error_file(m["file"])
        if not tb:
            log = newest_log(run_dir, local)
            tb = log.read_text(errors="replace") if log else ""
            tb = crash_report(tb) if tb.strip() else m["tb"]
        failures.append(RankFailure(rank, local, code, _signal_name(code), tail(tb)))
    # torchrun stops the surviving ranks with SIGTERM, and it prefers a rank that left an
    # error file as the "root cause": a rank that died by SIGKILL leaves none, and its peer
    # (which then failed in a collective and got SIGTERM) can be named instead. A rank
    # that torchrun did not terminate itself is the better root cause.
    return sorted(failures, key=lambda f: f.signal == "SIGTERM")


def failure_message(name: str, result: RunResult) -> str:
    """One readable paragraph: which rank failed, how, and its traceback tail."""
    if not result.failures:
        return (
            f"{name} failed under torchrun (exit code {result.returncode}). "
            f"Last output:\n{tail(result.output)}"
        )
    root, *others = result.failures
    parts = [
        f"{name} failed under torchrun: {root.describe()} (the first failure). "
        f"Its traceback ends with:\n{root.traceback}"
    ]
    if others:
        stopped = ", ".join(f.describe() for f in others)
        parts.append(f"Then torchrun stopped the others: {stopped}.")
    return "\n".join(parts)
