"""Helpers of lesson 10 (multi-node): check a SLURM job script without a cluster."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path


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
