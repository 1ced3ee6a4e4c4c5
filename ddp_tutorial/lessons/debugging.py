"""Helpers for the debugging lab (lesson 09): run a broken case, keep the lines that matter.

A failing DDP launch prints a lot: two ranks' tracebacks, torchrun's
summary, warnings. What a learner must read is one or two lines — gloo's
``Timed out waiting 5000ms for recv operation``, DDP's ``Parameters which did
not receive grad for rank 0: aux.bias, aux.weight``, ``Rank 1 failed to pass
monitoredBarrier``. :func:`key_lines` picks those out of the real output
(rank prefix kept: *which* rank said it is half the diagnosis).

A debugger that waits for input is run with
:func:`ddp_tutorial.harness.processes.run_command`: text on its stdin and a
hard timeout that kills the whole process tree, so it can never hang a
notebook or a test.

:func:`start_lab` starts every launch of the lesson at once, in the
background (the broken cases mostly *wait* for a timeout, so side by side
they cost little more than the slowest one); each section of the lesson then
reads its own case with :meth:`Lab.result` and shows the command a user
would type with :meth:`Lab.command`.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

from ddp_tutorial.harness.launch import (
    Launch,
    LaunchSpec,
    RunResult,
    run_together,
    shell_command,
    start,
)
from ddp_tutorial.harness.processes import CommandResult, run_command

KEY_PATTERNS = (
    r"Timed out waiting \d+ms",
    r"Application timeout caused pair closure",
    r"failed to pass monitoredBarrier",
    r"Detected mismatch between collectives",
    r"Expected to have finished reduction",
    r"did not receive grad",
    r"EADDRINUSE|[Aa]ddress already in use",
    r"Missing key\(s\)|Unexpected key\(s\)",
    r"unrecognized arguments",
    r"Connection closed by peer",
    r"RendezvousTimeoutError|[Rr]endezvous.*time",
    r"BackendError|DeviceError",
)


def key_lines(
    output: str,
    patterns: Iterable[str] = KEY_PATTERNS,
    width: int | None = 400,
) -> list[str]:
    """The lines of ``output`` that match any of ``patterns``, each message once.

    torchrun's ``--tee`` prefix (``[default0]:``) and C++ log timestamps
    (``[E1129 19:30:42.2 ProcessGroupGloo.cpp:68]``) are removed; the
    ``[rankN]:`` prefix is kept — *which* rank said it is half the diagnosis.
    A message already shown for a rank is not repeated, and the copy in
    torchrun's closing summary (no rank prefix) is dropped when a rank already
    said it. Lines longer than ``width`` are cut with ``…``.
    """
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    seen: set[tuple[str, str]] = set()
    said: set[str] = set()
    out = []
    for raw in output.splitlines():
        if not regex.search(raw):
            continue
        line = re.sub(r"^\[default\d+\]:", "", raw).strip()
        line = re.sub(r"\[[EWI]\d{4} [\d:.]+ (?:\d+ )?[\w./]+:\d+\] ?", "", line)
        if line.startswith(("File ", "raise ", "^")):
            continue
        match = re.match(r"^\[rank(\d+)\]:\s*", line)
        rank = match.group(1) if match else ""
        text = line[match.end() :] if match else line
        if (rank, text) in seen or (not rank and text in said):
            continue
        seen.add((rank, text))
        said.add(text)
        if width is not None and len(line) > width:
            line = line[: width - 1] + "…"
        out.append(line)
    return out


def first_match(output: str, pattern: str) -> str | None:
    """The first line of ``output`` containing ``pattern`` (a regex), or None."""
    regex = re.compile(pattern)
    return next((ln for ln in output.splitlines() if regex.search(ln)), None)


def case(
    script: str | os.PathLike[str], args: Sequence[object] = (), nproc: int = 2, **options: Any
) -> LaunchSpec:
    """One launch of the lab: 2 ranks unless said otherwise; ``options``: see LaunchSpec."""
    return LaunchSpec(script, args, nproc=nproc, **options)


def run_cases(
    cases: Mapping[str, LaunchSpec],
    timeout: float = 120.0,
    run_dir: str | os.PathLike[str] | None = None,
) -> dict[str, RunResult]:
    """Start every case at once under torchrun, wait for all; ``{name: RunResult}``.

    The broken cases mostly *wait* (for a timeout to end a hang), so running
    them side by side costs little more than the slowest one. Failures are
    results here, not exceptions: the lab reads them. ``timeout`` is the hard
    limit per launch, after which it is killed; case ``name`` writes to
    ``run_dir/name``.
    """
    base = Path(run_dir) if run_dir is not None else None
    specs = {
        name: replace(spec, timeout=timeout, echo=False,
                      run_dir=base / name if base is not None else spec.run_dir)
        for name, spec in cases.items()
    }  # fmt: skip
    return run_together(specs)


PDB_KEYS = "continue\nup\np sorted(saved)\nquit\n"
"""Section 3's pdb session: run to the crash (post-mortem), climb to our frame, print the keys."""
PDB_BREAKPOINT = "up\np answer, info.rank, info.world_size\nc\n"
"""What the "All fixed" launch types into ``torch.distributed.breakpoint()`` on rank 0."""


def start_cases(
    cases: Mapping[str, LaunchSpec], run_dir: str | os.PathLike[str] | None = None
) -> dict[str, Launch]:
    """Start every case at once in the background; ``{name: Launch}``, read with ``.wait()``.

    Each keeps its own hard timeout (the spec's). Failures are results, not
    exceptions. If one cannot start, the ones already started are killed. Side by side
    on EXCLUSIVE_PROCESS GPUs too (``gpus=False``; else one after another there, the lab's
    240 s hang first): every case runs gloo on the CPU.
    """
    base = Path(run_dir) if run_dir is not None else None
    launches: dict[str, Launch] = {}
    try:
        for name, spec in cases.items():
            where = base / name if base is not None else spec.run_dir
            spec = replace(spec, echo=False, check=False, run_dir=where)
            options = {f.name: getattr(spec, f.name) for f in fields(spec)}
            script, args = options.pop("script"), options.pop("args")
            launches[name] = start(script, *args, gpus=False, **options)
    except BaseException:
        for launch in launches.values():
            launch.kill()
        raise
    return launches


@dataclass
class Lab:
    """Every launch of lesson 09, running side by side; each section reads its own.

    ``port_holder`` is "another job" that holds ``taken_port`` (section 2)
    until :meth:`close`. ``pdb`` is section 3's debugger session, a plain
    process, no torchrun.
    """

    launches: dict[str, Launch]
    pdb: Future[CommandResult]
    port_holder: socket.socket
    demos: str
    _pool: ThreadPoolExecutor = field(repr=False)

    @property
    def taken_port(self) -> int:
        return int(self.port_holder.getsockname()[1])

    def result(self, name: str) -> RunResult:
        """Wait for case ``name`` (if it still runs) and return what it did."""
        return self.launches[name].wait()

    def command(self, name: str) -> str:
        """``$ ENV=… torchrun …`` as typed from the repository root (no logging flags)."""
        launch = self.launches[name]
        return typed_command(launch.spec, self.demos, launch.command)

    def left_behind(self, names: Iterable[str]) -> list[int]:
        """pids still alive from the launches ``names``: torchrun or a rank.

        Found by the run directory each has on its command line (``--out DIR``),
        compared word for word: ``run-2`` is not ``run``.
        """
        dirs = {str(self.launches[n].run_dir) for n in names}
        alive = []
        for proc in psutil.process_iter(["cmdline"]):
            if dirs.intersection(proc.info["cmdline"] or ()):
                alive.append(proc.pid)
        return alive

    def close(self) -> None:
        """End whatever still runs (on every exit path) and free the port."""
        for launch in self.launches.values():
            if not launch.done:
                launch.kill()
        self.pdb.cancel()
        self._pool.shutdown(wait=False)
        self.port_holder.close()


def start_lab(
    hang_timeout_s: float,
    launch_timeout_s: float,
    demos: str = "../scripts/demos",
    nproc: int = 2,
) -> Lab:
    """Start every launch of lesson 09 at once; each section of the lesson reads its own.

    The broken cases (each ends by itself after ``hang_timeout_s``), ``hung``
    (section 5's real hang, for ``py-spy``: its timeout is as long as the
    launch's), ``all-fixed`` (every repaired case in one launch, with pdb on
    rank 0), ``teardown`` (section 8: rank 0 without the fix, rank 1 with it),
    and section 3's pdb session. ``launch_timeout_s`` is every launch's hard limit.
    """
    port_holder = socket.create_server(("127.0.0.1", 0))  # "another job" got there first
    taken = int(port_holder.getsockname()[1])
    cases = lab_cases(hang_timeout_s, launch_timeout_s, demos, nproc, taken)
    try:
        launches = start_cases(cases)
    except BaseException:
        port_holder.close()
        raise
    pool = ThreadPoolExecutor(1)
    lab = f"{demos}/debug_lab.py"
    pdb = pool.submit(run_command, [sys.executable, "-m", "pdb", lab, "--case", "keys"],
                      stdin=PDB_KEYS, timeout=launch_timeout_s)  # fmt: skip
    return Lab(launches, pdb, port_holder, demos, pool)


def lab_cases(
    hang_timeout_s: float, launch_timeout_s: float, demos: str, nproc: int, taken_port: int
) -> dict[str, LaunchSpec]:
    """What each launch of lesson 09 runs (not started): the lesson's prose shows these
    commands too, kept equal to them by a test, for a reader without outputs."""
    lab, hello, teardown = f"{demos}/debug_lab.py", f"{demos}/hello.py", f"{demos}/teardown.py"
    taken = str(taken_port)
    hang = ["--timeout", hang_timeout_s]

    def launch(script: str, *args: object, **options: Any) -> LaunchSpec:
        return LaunchSpec(script, args, nproc=nproc, timeout=launch_timeout_s, **options)

    cases = {
        "port": launch(hello, standalone=False,
                       torchrun_args=["--master-addr", "127.0.0.1", "--master-port", taken]),
        "unused": launch(lab, "--case", "unused", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
        "skip": launch(lab, "--case", "skip", "--monitored", *hang),
        "hung": launch(lab, "--case", "skip", "--timeout", launch_timeout_s),
        "shape": launch(lab, "--case", "shape", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
        "rank0-eval": launch(lab, "--case", "rank0-eval", "--flight-recorder", *hang),
        "uneven": launch(lab, "--case", "uneven", *hang),
        "teardown": launch(teardown, "--init", "plain", "--import-first-rank", 1),
        "all-fixed": launch(lab, "--case", "all", "--fix", "--breakpoint", stdin=PDB_BREAKPOINT),
    }  # fmt: skip
    return cases


def typed_command(spec: LaunchSpec, demos: str, command: Sequence[str] | None = None) -> str:
    """``$ ENV=… torchrun …`` as typed from the repository root (no logging flags): of the
    command a launch ran, or the one ``spec`` makes."""
    env = [f"{k}={shlex.quote(str(v))}" for k, v in (spec.env or {}).items()]
    command = command if command is not None else spec.command(Path("run"))
    words = shell_command(command).replace(demos, "scripts/demos")
    return "$ " + " ".join([*env, words])
