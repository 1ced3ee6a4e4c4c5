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

:func:`torchrun` runs one launch and waits; :func:`start` returns a running
:class:`Launch` at once; :func:`multinode` runs N torchrun "nodes" of one job
at the same time on this machine (``--nnodes``/``--node-rank``, a c10d
rendezvous on 127.0.0.1), as the multi-node lessons need.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
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
    monitor_overhead: float | None = None  # the sampler's CPU time / wall time (1.0 = a core)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def rank_log(self, rank: int, stream: str = "stdout") -> str:
        """The text one local rank wrote to ``stdout``/``stderr`` (last attempt)."""
        log = newest_log(self.run_dir, rank, stream)
        return log.read_text(errors="replace") if log else ""


def newest_log(run_dir: Path, local_rank: int, stream: str = "stderr") -> Path | None:
    """The log torchrun's ``--log-dir`` got last from ``local_rank`` (``None`` if none).

    By time, not by name: a run directory can hold several launches (a
    resumed run) and restarts, and the launch ids in the paths are random.
    """
    logs = (run_dir / "logs").glob(f"**/attempt_*/{local_rank}/{stream}.log")
    return max(logs, key=lambda p: p.stat().st_mtime, default=None)


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


def _crash_report(stderr: str) -> str:
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
            log = newest_log(run_dir, local)
            tb = log.read_text(errors="replace") if log else ""
            tb = _crash_report(tb) if tb.strip() else m["tb"]
        failures.append(RankFailure(rank, local, code, sig, _tail(tb)))
    # torchrun stops the surviving ranks with SIGTERM, and it prefers a rank that left an
    # error file as the "root cause": a rank that died by SIGKILL leaves none, and its peer
    # (which then failed in a collective and got SIGTERM) can be named instead. A rank
    # that torchrun did not terminate itself is the better root cause.
    return sorted(failures, key=lambda f: f.signal == "SIGTERM")


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


class Launch:
    """A torchrun that is running: :func:`start` returns it, :meth:`wait` finishes it.

    Holding a handle lets one caller run several launches at once — two
    torchrun "nodes" of one job on this machine (:func:`multinode`) — while
    each still gets its own output, records, timeout and error.
    """

    def __init__(
        self,
        script: Path,
        cmd: list[str],
        run_dir: Path,
        env: dict[str, str],
        timeout: float,
        check: bool,
        echo: bool,
        prefix: str,
        monitor: bool,
        monitor_interval: float,
        stdin: str | None = None,
    ):
        self.script, self.command, self.run_dir = script, cmd, run_dir
        self.check, self.echo, self.prefix = check, echo, prefix
        self.lines: list[str] = []
        self.timed_out = False
        self._seen_before_kill = 0
        self._done = False
        self._result: RunResult | None = None
        self.start_time = time.monotonic()
        self.deadline = self.start_time + timeout
        self.timeout = timeout
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            env=env,
            start_new_session=True,  # our own group: a notebook's SIGINT does not hit the ranks raw
        )
        if stdin is not None:  # e.g. pdb commands for torch.distributed.breakpoint()
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()
        self._sampler = None
        if monitor:
            from ddp_tutorial.monitor import Monitor

            self._sampler = Monitor(root_pid=self.proc.pid, env=env, interval=monitor_interval)
            self._sampler.start()
        self._pipe: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _feed(self, text: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.close()  # EOF: a reader that wants more gets end-of-file, not a hang
        except (BrokenPipeError, OSError):
            pass

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._pipe.put(line)
        self._pipe.put(None)

    @property
    def done(self) -> bool:
        """True once the output has ended or the timeout has passed."""
        return self._done

    def poll(self, block_s: float = 0.0) -> None:
        """Collect (and echo) output that has arrived, waiting up to ``block_s`` for the first."""
        while not self._done:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                self._seen_before_kill = len(self.lines)
                self._done = True
                return
            try:
                line = self._pipe.get(timeout=min(remaining, block_s) if block_s > 0 else 0.001)
            except queue.Empty:
                return
            if line is None:
                self._done = True
                return
            self.lines.append(line)
            if self.echo:
                print(self.prefix + line, end="", flush=True)
            block_s = 0.0  # after the first line, take only what is already there

    def kill(self) -> None:
        """Terminate the launch and every process it started."""
        kill_tree(self.proc.pid)

    def wait(self) -> RunResult:
        """Stream output until the launch ends (or times out), then build its result.

        Raises :class:`LaunchTimeout` / :class:`LaunchError` as :func:`torchrun`
        does when ``check`` was set.
        """
        if self._result is not None:
            return self._result
        try:
            while not self._done:
                self.poll(block_s=0.5)
        except KeyboardInterrupt:
            self.kill()
            raise
        finally:
            if self.timed_out:
                self.kill()
            if self._sampler is not None:
                self._sampler.stop()
        return self._finish()

    def _finish(self) -> RunResult:
        returncode = self.proc.wait()
        self._reader.join(timeout=5)
        while True:  # anything the reader got after the loop ended
            try:
                line = self._pipe.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        output = "".join(self.lines)
        sampler = self._sampler
        result = RunResult(
            command=self.command,
            returncode=returncode,
            output=output,
            run_dir=self.run_dir,
            seconds=time.monotonic() - self.start_time,
            records=read_rank_records(self.run_dir),
            failures=parse_failures(output, self.run_dir) if returncode else [],
            timed_out=self.timed_out,
            utilization=sampler.samples() if sampler is not None else None,
            monitor_overhead=sampler.overhead if sampler is not None else None,
        )
        if sampler is not None:
            sampler.write_csv(self.run_dir / "utilization.csv")
        self._result = result
        if self.check and self.timed_out:
            raise LaunchTimeout(
                f"{self.script.name} did not finish within {self.timeout:g} s and was killed "
                f"(torchrun and all its workers). Last output before the kill:\n"
                f"{_tail(''.join(self.lines[: self._seen_before_kill]))}",
                result,
            )
        if self.check and returncode != 0:
            raise LaunchError(failure_message(self.script.name, result), result)
        return result


def start(
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
    prefix: str = "",
    stdin: str | None = None,
) -> Launch:
    """Start ``script`` under torchrun and return at once; ``.wait()`` gives the result.

    Same arguments as :func:`torchrun`, plus ``prefix`` (put before every
    echoed line, to tell concurrent launches apart). Bad input is refused
    before anything starts.
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
    # PYTHONFAULTHANDLER: a rank killed by SIGABRT or SIGSEGV prints every thread's
    # Python stack, so even a crash inside C++ says where Python was.
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    return Launch(
        script,
        cmd,
        run_dir,
        child_env,
        timeout,
        check,
        echo,
        prefix,
        monitor,
        monitor_interval,
        stdin,
    )


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
    stdin: str | None = None,
) -> RunResult:
    """Run ``script`` under torchrun and wait for it.

    ``args`` go to the script; ``--out RUN_DIR`` is appended so the ranks know
    where to write their records (``out_flag=None`` to skip). ``env`` is
    merged over this process's environment (e.g. ``CUDA_VISIBLE_DEVICES``:
    the launcher is the right place to set it, before any CUDA initialises).
    ``echo`` streams the output live. ``monitor`` samples GPU or per-rank CPU
    utilization while it runs (``result.utilization``). ``stdin`` is text fed
    to the launch's standard input, then closed (default: no input at all) —
    the ranks inherit it, so it can drive ``torch.distributed.breakpoint()``.

    With ``check`` (default) a failure raises :class:`LaunchError` naming the
    failed rank and its traceback tail; a timeout raises :class:`LaunchTimeout`
    after killing every process the launch started.
    """
    return start(
        script,
        *args,
        nproc=nproc,
        env=env,
        timeout=timeout,
        run_dir=run_dir,
        check=check,
        echo=echo,
        standalone=standalone,
        torchrun_args=torchrun_args,
        out_flag=out_flag,
        monitor=monitor,
        monitor_interval=monitor_interval,
        stdin=stdin,
    ).wait()


def shell_command(command: Sequence[str]) -> str:
    """The command a user would type: ``torchrun …`` without the logging and ``--out`` flags."""
    words = list(command)
    if words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    out, skip = [], 0
    for i, word in enumerate(words):
        if skip:
            skip -= 1
            continue
        if word in ("--log-dir", "--tee", "--out") and i + 1 < len(words):
            skip = 1
            continue
        out.append(word)
    return " ".join(out)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous endpoint)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def multinode(
    script: str | os.PathLike[str],
    *args: object,
    nnodes: int = 2,
    nproc_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
    node_env: Sequence[Mapping[str, str]] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    run_dir: str | os.PathLike[str] | None = None,
    check: bool = True,
    echo: bool = True,
    host: str = "127.0.0.1",
    port: int | None = None,
    torchrun_args: Sequence[str] = (),
) -> list[RunResult]:
    """One job on ``nnodes`` "nodes" that all live on this machine; one result per node.

    Starts ``nnodes`` torchrun launchers at once, each with ``--nnodes N
    --node-rank i`` and the same c10d rendezvous (``--rdzv-endpoint
    host:port``), exactly the command you would type on each machine of a
    real cluster. Node ``i`` writes to ``RUN_DIR/node{i}`` and its echoed
    lines start with ``[node i]``; ``node_env[i]`` adds variables for node
    ``i`` only. Note that with c10d the rendezvous, not ``--node-rank``,
    decides each node's ``GROUP_RANK`` (the ranks' records say which it got).

    If one node fails or times out the others are killed (they would wait
    for it until the rendezvous timeout); with ``check`` the first failure
    is raised.
    """
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"multinode: nnodes must be a positive integer, got {nnodes!r}")
    if node_env is not None and len(node_env) != nnodes:
        raise ValueError(f"multinode: node_env needs {nnodes} entries, got {len(node_env)}")
    base = Path(run_dir) if run_dir is not None else default_run_dir(script)
    port = port or free_port(host)
    job_id = f"{Path(script).stem}-{port}"
    launches: list[Launch] = []
    try:
        for node in range(nnodes):
            rdzv = [
                "--nnodes", str(nnodes),
                "--node-rank", str(node),
                "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{host}:{port}",
                "--rdzv-id", job_id,
                # node 0 hosts the rendezvous store; the others connect to it
                "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
            ]  # fmt: skip
            launches.append(
                start(
                    script,
                    *args,
                    nproc=nproc_per_node,
                    env={**(env or {}), **(node_env[node] if node_env else {})},
                    timeout=timeout,
                    run_dir=base / f"node{node}",
                    check=False,
                    echo=echo,
                    standalone=False,
                    torchrun_args=[*rdzv, *torchrun_args],
                    prefix=f"[node {node}]",
                )
            )
        while not all(launch.done for launch in launches):
            for launch in launches:
                launch.poll(block_s=0.1)
            if any(la.done and la.proc.poll() not in (None, 0) for la in launches) or any(
                la.timed_out for la in launches
            ):
                break  # one node failed: the others would wait for it forever
    except BaseException:
        for launch in launches:
            launch.kill()
        raise
    for launch in launches:
        if not launch.done:
            launch.kill()
    results = [launch.wait() for launch in launches]
    if check:
        for launch, result in zip(launches, results, strict=True):
            if result.timed_out:
                raise LaunchTimeout(
                    f"{launch.script.name} (node {launches.index(launch)}) did not finish "
                    f"within {timeout:g} s; every node was killed.\n{_tail(result.output)}",
                    result,
                )
        for node, result in enumerate(results):
            if result.returncode != 0 and result.failures:
                raise LaunchError(
                    f"node {node}: " + failure_message(Path(script).name, result), result
                )
        for node, result in enumerate(results):
            if result.returncode != 0:
                raise LaunchError(
                    f"node {node}: " + failure_message(Path(script).name, result), result
                )
    return results


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
