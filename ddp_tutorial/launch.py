"""Run a script under the real ``torchrun``, from Python (a notebook cell or a test).

The notebook kernel never forks ranks itself: it starts
``python -m torch.distributed.run --standalone --nproc-per-node N script.py``
exactly as a user would from the shell, streams its output line by line (so a
notebook shows it live), and collects what the ranks wrote to the run
directory. Three things make this safe to use from a kernel:

* the launcher runs in a new session, and on a timeout or an interrupt
  (the notebook's stop button) the whole process tree is terminated and then
  killed — torchrun's workers live in sessions of their own, so we walk the
  tree with psutil instead of trusting one process group;
* per-rank logs (``--log-dir``, ``--tee``) and torchrun's error files
  (``@record``) turn a failure into an error that names the rank, its exit
  code or signal, and the tail of its traceback;
* bad input (a missing script, ``nproc < 1``) is refused before anything starts.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddp_tutorial.devices import visible_gpu_count
from ddp_tutorial.records import read_rank_records

DEFAULT_TIMEOUT_S = 300.0
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


@dataclass
class RunResult:
    """What a launch produced: exit status, full output, and the ranks' records."""

    command: list[str]
    returncode: int
    output: str
    run_dir: Path
    seconds: float
    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[RankFailure] = field(default_factory=list)
    timed_out: bool = False
    utilization: Any = None  # filled by ddp_tutorial.monitor when a launch is monitored

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def rank_log(self, rank: int, stream: str = "stdout") -> str:
        """The text one local rank wrote to ``stdout``/``stderr`` (last attempt)."""
        logs = sorted((self.run_dir / "logs").glob(f"**/attempt_*/{rank}/{stream}.log"))
        return logs[-1].read_text(errors="replace") if logs else ""


class LaunchError(RuntimeError):
    """A launch failed; ``.result`` holds everything that was collected."""

    def __init__(self, message: str, result: RunResult):
        super().__init__(message)
        self.result = result


class LaunchTimeout(LaunchError):
    """A launch ran past its timeout and was killed (with every child process)."""


def default_nproc(env: Mapping[str, str] | None = None) -> int:
    """One process per visible GPU when there are GPUs, else 2 (CPU lessons use 2 ranks)."""
    merged = {**os.environ, **(env or {})}
    if merged.get("DDP_TUTORIAL_BACKEND", "auto") == "gloo":
        return 2
    gpus = visible_gpu_count(merged)
    return gpus if gpus >= 1 else 2


def default_run_dir(script: str | os.PathLike[str]) -> Path:
    """``runs/<script>-<time>-<n>`` under the current directory (git-ignored)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{Path(script).stem}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


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


_ROOT_CAUSE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*\d+\)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<file>.*?)\s*\n"
    r"\s*traceback\s*:\s*(?P<tb>.*?)(?:\n\s*\n|\n=====|\Z)",
    re.S,
)


def _tail(text: str, lines: int = TRACEBACK_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _read_error_file(path: str) -> str:
    """The traceback that ``@record`` saved in torchrun's error file, if any."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    return str(message)


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
        sig = None
        if code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
        tb = ""
        if m["file"] and m["file"] != "<N/A>":
            tb = _read_error_file(m["file"])
        if not tb:
            logs = sorted((run_dir / "logs").glob(f"**/attempt_*/{local}/stderr.log"))
            tb = logs[-1].read_text(errors="replace") if logs else m["tb"]
        failures.append(RankFailure(rank, local, code, sig, _tail(tb)))
    return failures


def _build_command(
    script: Path,
    args: Sequence[str],
    nproc: int,
    run_dir: Path,
    standalone: bool,
    torchrun_args: Sequence[str],
    out_flag: str | None,
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if standalone:
        cmd.append("--standalone")  # local rendezvous on a free port: no MASTER_PORT clashes
    cmd += ["--nproc-per-node", str(nproc)]
    if sys.platform.startswith("linux"):
        # Per-rank logs on disk, and every line on the console prefixed with its rank.
        cmd += ["--log-dir", str(run_dir / "logs"), "--tee", "3"]
    cmd += list(torchrun_args)
    cmd.append(str(script))
    cmd += [str(a) for a in args]
    if out_flag and out_flag not in args:
        cmd += [out_flag, str(run_dir)]
    return cmd


def torchrun(
    script: str | os.PathLike[str],
    *args: object,
    nproc: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    run_dir: str | os.PathLike[str] | None = None,
    check: bool = True,
    echo: bool = True,
    standalone: bool = True,
    torchrun_args: Sequence[str] = (),
    out_flag: str | None = "--out",
    monitor: bool = False,
    monitor_interval: float = 0.5,
) -> RunResult:
    """Run ``script`` under torchrun and wait for it.

    ``args`` go to the script; ``--out RUN_DIR`` is appended so the ranks know
    where to write their records (``out_flag=None`` to skip). ``env`` is
    merged over this process's environment (e.g. ``CUDA_VISIBLE_DEVICES``:
    the launcher is the right place to set it, before any CUDA initialises).
    ``echo`` streams the output live. ``monitor`` samples GPU or per-rank CPU
    utilization while it runs (``result.utilization``).

    With ``check`` (default) a failure raises :class:`LaunchError` naming the
    failed rank and its traceback tail; a timeout raises :class:`LaunchTimeout`
    after killing every process the launch started.
    """
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(
            f"torchrun: script {str(script)!r} not found (working directory: {os.getcwd()})"
        )
    if nproc is None:
        nproc = default_nproc(env)
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"torchrun: nproc must be a positive integer, got {nproc!r}")
    if timeout <= 0:
        raise ValueError(f"torchrun: timeout must be positive seconds, got {timeout!r}")
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(script)
    run_dir.mkdir(parents=True, exist_ok=True)
    str_args = [str(a) for a in args]
    cmd = _build_command(script, str_args, nproc, run_dir, standalone, torchrun_args, out_flag)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}

    lines: list[str] = []
    timed_out = False
    seen_before_kill = 0
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        env=child_env,
        start_new_session=True,  # our own group: a notebook's SIGINT does not hit the ranks raw
    )
    sampler = None
    if monitor:
        from ddp_tutorial.monitor import Monitor

        sampler = Monitor(root_pid=proc.pid, env=child_env, interval=monitor_interval)
        sampler.start()
    pipe: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            pipe.put(line)
        pipe.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = start + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                seen_before_kill = len(lines)
                break
            try:
                line = pipe.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                break
            lines.append(line)
            if echo:
                print(line, end="", flush=True)
    except KeyboardInterrupt:
        kill_tree(proc.pid)
        raise
    finally:
        if timed_out:
            kill_tree(proc.pid)
        if sampler is not None:
            sampler.stop()
    returncode = proc.wait()
    reader.join(timeout=5)
    while True:  # anything the reader got after the loop ended
        try:
            line = pipe.get_nowait()
        except queue.Empty:
            break
        if line is not None:
            lines.append(line)
    output = "".join(lines)
    result = RunResult(
        command=cmd,
        returncode=returncode,
        output=output,
        run_dir=run_dir,
        seconds=time.monotonic() - start,
        records=read_rank_records(run_dir),
        failures=parse_failures(output, run_dir) if returncode else [],
        timed_out=timed_out,
        utilization=sampler.samples() if sampler is not None else None,
    )
    if sampler is not None:
        sampler.write_csv(run_dir / "utilization.csv")
    if check and timed_out:
        raise LaunchTimeout(
            f"{script.name} did not finish within {timeout:g} s and was killed "
            f"(torchrun and all its workers). Last output before the kill:\n"
            f"{_tail(''.join(lines[:seen_before_kill]))}",
            result,
        )
    if check and returncode != 0:
        raise LaunchError(failure_message(script.name, result), result)
    return result


def failure_message(name: str, result: RunResult) -> str:
    """One readable paragraph: which rank failed, how, and its traceback tail."""
    if not result.failures:
        return (
            f"{name} failed under torchrun (exit code {result.returncode}). "
            f"Last output:\n{_tail(result.output)}"
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
