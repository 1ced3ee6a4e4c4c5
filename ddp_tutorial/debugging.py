"""Helpers for the debugging lab (lesson 09): run a broken case, keep the lines that matter.

A failing DDP launch prints a lot: two ranks' tracebacks, torchrun's
summary, warnings. What a learner must read is one or two lines — gloo's
``Timed out waiting 5000ms for recv operation``, DDP's ``Parameters which did
not receive grad for rank 0: aux.bias, aux.weight``, ``Rank 1 failed to pass
monitoredBarrier``. :func:`key_lines` picks those out of the real output
(rank prefix kept: *which* rank said it is half the diagnosis).

:func:`run_with_input` runs a plain command (``python -m pdb script.py``)
with text on its stdin and a hard timeout that kills the whole process tree:
a debugger that waits for input can never hang a notebook or a test.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddp_tutorial.launch import Launch, RunResult, kill_tree, start

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


@dataclass
class CommandResult:
    """A plain command run with input: what it printed and how it ended."""

    command: list[str]
    returncode: int | None
    output: str
    seconds: float
    timed_out: bool


def run_with_input(
    command: Sequence[str],
    stdin: str = "",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> CommandResult:
    """Run ``command`` with ``stdin`` as its input; kill its whole tree after ``timeout``.

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
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(stdin, timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        timed_out = True
    return CommandResult(
        list(command), proc.returncode, output, time.monotonic() - began, timed_out
    )


@dataclass
class Case:
    """One launch of the lab: a script, its arguments, extra environment, torchrun flags."""

    script: str | os.PathLike[str]
    args: Sequence[object] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    standalone: bool = True
    torchrun_args: Sequence[str] = ()
    nproc: int = 2


def rendezvous_node(
    script: str | os.PathLike[str],
    *args: object,
    nnodes: str = "2",
    rdzv_conf: str = "",
    nproc: int = 1,
    port: int | None = None,
    run_id: str | None = None,
) -> Case:
    """One node's torchrun of a multi-node job whose c10d rendezvous is hosted here.

    ``nnodes`` is torchrun's ``--nnodes`` ("2", or "1:2" for an elastic job);
    ``rdzv_conf`` its ``--rdzv-conf`` (e.g. ``"join_timeout=5"``: how long to
    wait for missing nodes, 600 s by default). Started alone, it shows what
    a node sees when the others do not come.
    """
    from ddp_tutorial.launch import free_port

    port = port or free_port()
    rdzv = ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id or f"job-{port}"]  # fmt: skip
    if rdzv_conf:
        rdzv += ["--rdzv-conf", rdzv_conf]
    return Case(script, args, nproc=nproc, standalone=False, torchrun_args=rdzv)


def run_cases(
    cases: Mapping[str, Case], timeout: float = 120.0, run_dir: str | os.PathLike[str] | None = None
) -> dict[str, RunResult]:
    """Start every case at once under torchrun, wait for all; ``{name: RunResult}``.

    The broken cases mostly *wait* (for a timeout to end a hang), so running
    them side by side costs little more than the slowest one. Failures are
    results here, not exceptions (``check=False``): the lab reads them.
    ``timeout`` is the hard limit per launch, after which it is killed.
    """
    base = Path(run_dir) if run_dir is not None else None
    launches: dict[str, Launch] = {}
    try:
        for name, case in cases.items():
            launches[name] = start(
                case.script,
                *case.args,
                nproc=case.nproc,
                env=dict(case.env),
                timeout=timeout,
                run_dir=base / name if base is not None else None,
                check=False,
                echo=False,
                standalone=case.standalone,
                torchrun_args=case.torchrun_args,
            )
        return {name: launch.wait() for name, launch in launches.items()}
    except BaseException:
        for launch in launches.values():
            launch.kill()
        raise


def render_sbatch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    nodes: Sequence[str] = ("node01", "node02"),
    slurm_env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """The command a SLURM job script would run, without a cluster: a dry run.

    Debugging a job script in the queue costs an allocation per attempt.
    This runs it with ``bash`` under a fake SLURM environment — the variables
    ``sbatch`` sets (``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_JOB_ID``,
    …, overridable with ``slurm_env``), a stand-in ``scontrol`` that lists
    ``nodes``, and ``DRY_RUN=1``, which the course's job script honours by
    printing its command (after the variables it exports) instead of running
    it. Returns the words, e.g. ``["OMP_NUM_THREADS=8", "srun", …, "torchrun", …]``.
    """
    import shlex
    import tempfile

    if not nodes:
        raise ValueError("render_sbatch: need at least one node name")
    with tempfile.TemporaryDirectory(prefix="fake-slurm-") as tmp:
        scontrol = Path(tmp) / "scontrol"
        listing = " ".join(shlex.quote(n) for n in nodes)
        scontrol.write_text(
            f"#!/bin/sh\n# fake: `scontrol show hostnames`\nprintf '%s\\n' {listing}\n"
        )
        scontrol.chmod(0o755)
        env = {
            **os.environ,
            "PATH": f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"{nodes[0]},{nodes[-1]}" if len(nodes) > 1 else nodes[0],
            "SLURM_NNODES": str(len(nodes)),
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_CPUS_PER_TASK": "64",
            **(slurm_env or {}),
            "DRY_RUN": "1",
        }
        if "OMP_NUM_THREADS" not in (slurm_env or {}):
            env.pop("OMP_NUM_THREADS", None)  # let the script compute it, as on a fresh node
        done = subprocess.run(
            ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {done.returncode}): {done.stderr.strip()}")
    return shlex.split(done.stdout)
