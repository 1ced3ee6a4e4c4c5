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
:class:`Launch` at once; :func:`run_together` runs several side by side and
kills them all if anything goes wrong (``ddp_tutorial.harness.multinode``
builds on it). Every launch is described by one :class:`LaunchSpec`.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddp_tutorial import settings
from ddp_tutorial.devices import visible_gpu_count
from ddp_tutorial.harness import processes
from ddp_tutorial.harness.failures import (
    LaunchError,
    LaunchTimeout,
    RankFailure,
    failure_message,
    newest_log,
    parse_failures,
    tail,
)
from ddp_tutorial.harness.gpu_plan import mig_fallback, torch_sees_no_gpu
from ddp_tutorial.harness.runs import KEEP_RUNS, default_run_dir, prune_runs  # noqa: F401
from ddp_tutorial.records import read_rank_records

DEFAULT_TIMEOUT_S = 300.0


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
    utilization: Any = None  # filled by ddp_tutorial.harness.monitor when a launch is monitored
    monitor_overhead: float | None = None  # the sampler's CPU time / wall time (1.0 = a core)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def rank_log(self, rank: int, stream: str = "stdout") -> str:
        """The text one local rank wrote to ``stdout``/``stderr`` (last attempt)."""
        log = newest_log(self.run_dir, rank, stream)
        return log.read_text(errors="replace") if log else ""


def default_nproc(env: Mapping[str, str] | None = None) -> int:
    """One per visible GPU this torch can use, else 2 (MIG, an old driver: the CPU plan)."""
    merged = {**os.environ, **(env or {})}
    if settings.backend(merged) == "gloo" or mig_fallback(merged)[0]:
        return 2
    gpus = visible_gpu_count(merged)
    return gpus if gpus >= 1 and not torch_sees_no_gpu() else 2


@dataclass
class LaunchSpec:
    """Everything about one torchrun launch: what to run, where, how long, what to watch.

    ``args`` go to the script; ``--out RUN_DIR`` is appended so the ranks know
    where to write their records (``out_flag=None`` to skip). ``nproc``:
    ranks on this node (default: one per visible GPU, else 2). ``env`` is
    merged over this process's environment (e.g. ``CUDA_VISIBLE_DEVICES``:
    the launcher is the right place to set it, before any CUDA initialises).
    ``module``: ``script`` is a module name, run with torchrun's ``-m``.
    ``echo`` streams the output live, each line after ``prefix``.
    ``monitor`` samples GPU or per-rank CPU utilization while it runs.
    ``stdin`` is text fed to the launch's standard input, then closed
    (default: no input at all) — the ranks inherit it, so it can drive
    ``torch.distributed.breakpoint()``. ``check``: raise on failure.
    """

    script: str | os.PathLike[str]
    args: Sequence[object] = ()
    nproc: int | None = None
    env: Mapping[str, str] | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    run_dir: str | os.PathLike[str] | None = None
    check: bool = True
    echo: bool = True
    standalone: bool = True
    torchrun_args: Sequence[str] = ()
    out_flag: str | None = "--out"
    monitor: bool = False
    monitor_interval: float = 0.5
    prefix: str = ""
    stdin: str | None = None
    module: bool = False

    @property
    def name(self) -> str:
        return str(self.script) if self.module else Path(self.script).name

    def validate(self) -> None:
        """Refuse bad input before anything starts."""
        if not self.module and not Path(self.script).is_file():
            raise FileNotFoundError(
                f"torchrun: script {str(self.script)!r} not found "
                f"(working directory: {os.getcwd()})"
            )
        if self.nproc is not None and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise ValueError(f"torchrun: nproc must be a positive integer, got {self.nproc!r}")
        if self.timeout <= 0:
            raise ValueError(f"torchrun: timeout must be positive seconds, got {self.timeout!r}")

    def command(self, run_dir: Path) -> list[str]:
        """The full command line, as a user would type it plus logging flags."""
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        if self.standalone:
            cmd.append("--standalone")  # local rendezvous on a free port: no MASTER_PORT clashes
        nproc = self.nproc if self.nproc is not None else default_nproc(self.env)
        cmd += ["--nproc-per-node", str(nproc)]
        if sys.platform.startswith("linux"):
            # Per-rank logs on disk, and every line on the console prefixed with its rank.
            cmd += ["--log-dir", str(run_dir / "logs"), "--tee", "3"]
        cmd += list(self.torchrun_args)
        cmd += ["-m", str(self.script)] if self.module else [str(self.script)]
        cmd += (args := [str(a) for a in self.args])
        if self.out_flag and self.out_flag not in args:
            cmd += [self.out_flag, str(run_dir)]
        return cmd

    def child_env(self) -> dict[str, str]:
        # PYTHONFAULTHANDLER: a rank killed by SIGABRT or SIGSEGV prints every thread's
        # Python stack, so even a crash inside C++ says where Python was. CUDA_DEVICE_ORDER:
        # cuda:N is NVML's (the monitor's) N, not the fastest first on a mixed node.
        env = {
            settings.DEVICE_ORDER_ENV: "PCI_BUS_ID",
            **os.environ,
            **processes.PLAIN_OUTPUT,
            "PYTHONFAULTHANDLER": "1",
            **(self.env or {}),
        }
        hide, why = mig_fallback(env)
        if hide:  # MIG: the CPU plan, said where the learner sees it
            warnings.warn(f"{self.name}: {why}", RuntimeWarning, stacklevel=2)
        return {**env, **hide}


class Launch:
    """A torchrun that is running: :func:`start` returns it, :meth:`wait` finishes it.

    Holding a handle lets one caller run several launches at once — two
    torchrun "nodes" of one job on this machine (:func:`multinode`) — while
    each still gets its own output, records, timeout and error.
    """

    def __init__(self, spec: LaunchSpec):
        spec.validate()
        self.spec = spec
        self.run_dir = (
            Path(spec.run_dir) if spec.run_dir is not None else default_run_dir(spec.name)
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.command = spec.command(self.run_dir)
        self.lines: list[str] = []
        self.timed_out = False
        self._seen_before_kill = 0
        self._done = False
        self._result: RunResult | None = None
        env = spec.child_env()
        self.start_time = time.monotonic()
        self._ended_at: float | None = None
        self.deadline = self.start_time + spec.timeout
        self.proc = processes.spawn(self.command, env, with_stdin=spec.stdin is not None)
        self._tree = processes.tree_root(self.proc)  # now, while its pid is surely its own
        self._sampler = None
        try:
            if spec.stdin is not None:  # e.g. pdb commands for torch.distributed.breakpoint()
                threading.Thread(target=self._feed, args=(spec.stdin,), daemon=True).start()
            if spec.monitor:
                from ddp_tutorial.harness.monitor import Monitor

                nproc = spec.nproc if spec.nproc is not None else default_nproc(spec.env)
                self._sampler = Monitor(
                    root_pid=self.proc.pid, env=env, interval=spec.monitor_interval, nproc=nproc
                )
                self._sampler.start()
        except BaseException:
            self.kill()  # a monitor that cannot start must not leave torchrun orphaned
            raise
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
        # When the output ended, not when someone collected it: run_together() waits
        # for the slowest launch before it builds any result.
        self._ended_at = time.monotonic()
        self._pipe.put(None)

    @property
    def done(self) -> bool:
        """True once the output has ended or the timeout has passed."""
        return self._done

    @property
    def failed(self) -> bool:
        """True once the launch has timed out or ended with a non-zero status."""
        return self.timed_out or (self._done and self.proc.poll() not in (None, 0))

    def poll(self, block_s: float = 0.0) -> None:
        """Collect (and echo) output that has arrived, waiting up to ``block_s`` for the first."""
        while not self._done:
            remaining = self.deadline - time.monotonic()
            # A launch collected late (start() now, wait() after the deadline) that ended in
            # time did not time out: its output is all in the queue, take it.
            ended_in_time = self._ended_at is not None and self._ended_at <= self.deadline
            if remaining <= 0 and not ended_in_time:
                self.timed_out = True
                self._seen_before_kill = len(self.lines)
                self._done = True
                return
            wait_s = min(max(remaining, 0.001), block_s) if block_s > 0 else 0.001
            try:
                line = self._pipe.get(timeout=wait_s)
            except queue.Empty:
                return
            if line is None:
                self._done = True
                return
            self.lines.append(line)
            if self.spec.echo:
                print(self.spec.prefix + line, end="", flush=True)
            block_s = 0.0  # after the first line, take only what is already there

    def kill(self) -> None:
        """Terminate the launch and every process it started."""
        processes.kill_tree(self._tree or self.proc)

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
            seconds=(self._ended_at or time.monotonic()) - self.start_time,
            records=read_rank_records(self.run_dir),
            failures=parse_failures(output, self.run_dir) if returncode else [],
            timed_out=self.timed_out,
            utilization=sampler.samples() if sampler is not None else None,
            monitor_overhead=sampler.overhead if sampler is not None else None,
        )
        if sampler is not None:
            sampler.write_csv(self.run_dir / "utilization.csv")
        self._result = result
        if self.spec.check:
            before_kill = "".join(self.lines[: self._seen_before_kill])
            raise_for_failure(self.spec.name, result, self.spec.timeout, before_kill)
        return result


def raise_for_failure(name: str, result: RunResult, timeout: float, before_kill: str = "") -> None:
    """Raise :class:`LaunchTimeout` / :class:`LaunchError` for a failed launch, else nothing."""
    if result.timed_out:
        raise LaunchTimeout(
            f"{name} did not finish within {timeout:g} s and was killed (torchrun and all "
            f"its workers). Last output before the kill:\n{tail(before_kill or result.output)}",
            result,
        )
    if result.returncode != 0:
        raise LaunchError(failure_message(name, result), result)


def start(script: str | os.PathLike[str], *args: object, **options: Any) -> Launch:
    """Start ``script`` under torchrun and return at once; ``.wait()`` gives the result.

    ``options`` are the fields of :class:`LaunchSpec` (bad input is refused before anything
    starts). On GPUs that take one process at a time (:func:`exclusive_gpus`) it first waits
    for the launches it started before; ``gpus=False``: its ranks never touch a GPU, so it
    waits for none, and none waits for it."""
    gpus = options.pop("gpus", True)
    spec = LaunchSpec(script, args, **options)
    if gpus and exclusive_gpus(spec.env):
        # EXCLUSIVE_PROCESS GPUs take one CUDA context each: a launch of this process that
        # still runs holds them, and a second one side by side would fail at its first CUDA
        # call. Lessons that start launches side by side run them one after another there.
        for other in list(_STARTED):
            if not other.done:
                print(f"EXCLUSIVE_PROCESS GPUs: {spec.name} waits for {other.spec.name}")
            while not other.done:
                other.poll(block_s=0.5)
    launch = Launch(spec)
    _STARTED.add(launch) if gpus else None  # what holds no GPU holds up no one
    return launch


_STARTED: weakref.WeakSet[Launch] = weakref.WeakSet()
"""The launches :func:`start` began that may still run (for EXCLUSIVE_PROCESS GPUs)."""


def torchrun(script: str | os.PathLike[str], *args: object, **options: Any) -> RunResult:
    """Run ``script`` under torchrun and wait for it; ``options``: see :class:`LaunchSpec`.

    With ``check`` (default) a failure raises :class:`LaunchError` naming the
    failed rank and its traceback tail; a timeout raises :class:`LaunchTimeout`
    after killing every process the launch started.
    """
    return start(script, *args, **options).wait()


def exclusive_gpus(env: Mapping[str, str] | None = None) -> bool:
    """Whether launches with ``env`` would use GPUs that take one process at a time.

    A GPU in compute mode EXCLUSIVE_PROCESS (common on shared clusters) refuses
    a second CUDA context: two launches side by side on the same GPUs fail there.
    Launches pinned to gloo (``DDP_TUTORIAL_BACKEND=gloo``) never touch the GPUs.
    """
    from ddp_tutorial.devices import DeviceError, visible_gpus

    merged = {**os.environ, **(env or {})}
    if settings.backend(merged) == "gloo":
        return False
    try:
        return any(gpu.exclusive for gpu in visible_gpus(merged))
    except DeviceError:
        return False


def run_together(
    specs: Mapping[str, LaunchSpec], stop_on_failure: bool = False, share_gpus: bool = True
) -> dict[str, RunResult]:
    """Start every launch at once, wait for all; ``{name: RunResult}``.

    The one place that runs launches side by side: the debugging lab's broken
    cases (which mostly *wait* for a timeout, so together they cost little
    more than the slowest), and the "nodes" of a multi-node job. On any error
    or interrupt every launch is killed. ``stop_on_failure``: as soon as one
    launch fails or times out, kill the others (nodes that would wait for a
    dead peer until the rendezvous timeout). Results are returned, not raised:
    each spec's ``check`` is ignored here; see :func:`raise_for_failure`.
    ``share_gpus``: the launches would share this machine's GPUs; where those
    take one process at a time (:func:`exclusive_gpus`) they run one after another.
    """
    if share_gpus and any(exclusive_gpus(spec.env) for spec in specs.values()):
        # One process per GPU at a time (EXCLUSIVE_PROCESS): one launch after another.
        # (Nodes of one job, ``share_gpus=False``, each have GPUs of their own.)
        return {name: Launch(replace(spec, check=False)).wait() for name, spec in specs.items()}
    launches: dict[str, Launch] = {}
    try:
        for name, spec in specs.items():
            launches[name] = Launch(replace(spec, check=False))
        while not all(la.done for la in launches.values()):
            for launch in launches.values():
                launch.poll(block_s=0.1)
            if stop_on_failure and any(la.failed for la in launches.values()):
                break
    except BaseException:
        for launch in launches.values():
            launch.kill()
        raise
    for launch in launches.values():
        if not launch.done:
            launch.kill()
    return {name: launch.wait() for name, launch in launches.items()}


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
