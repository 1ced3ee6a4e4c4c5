"""Lesson 10's SLURM job script: parsed by bash, rendered under a fake SLURM environment.

The launches of lesson 10 (the template across two torchrun "nodes", who
writes checkpoints on a shared disk, an elastic job and a missing node) are
asserted by notebooks/10_multinode.ipynb itself; the launcher's multi-node
failure handling by tests/test_wrapping.py.
"""

from __future__ import annotations

import subprocess

import pytest

from conftest import SCRIPTS
from ddp_tutorial.lessons.cluster import render_sbatch

SBATCH = SCRIPTS / "slurm" / "train.sbatch"


def test_sbatch_parses():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sbatch_renders_the_torchrun_command():
    words = render_sbatch(SBATCH, ["--epochs", "3"], nodes=["n1", "n2", "n3"],
                          slurm_env={"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "77"})  # fmt: skip
    assert words[:3] == ["OMP_NUM_THREADS=16", "srun", "--kill-on-bad-exit=1"]  # 64 CPUs / 4
    i = words.index("torchrun")
    flags = dict(zip(words[i + 1 : i + 15 : 2], words[i + 2 : i + 15 : 2], strict=True))
    assert flags == {
        "--nnodes": "3",
        "--nproc-per-node": "4",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "n1:29500",  # the allocation's first host
        "--rdzv-id": "77",
        "--max-restarts": "2",
        "scripts/train.py": "--checkpoint-dir",
    }
    assert words[-3:] == ["checkpoints/77", "--epochs", "3"]
    assert "--node-rank" not in words


def test_sbatch_honours_overrides():
    words = render_sbatch(SBATCH, nodes=["a"], slurm_env={
        "RDZV_PORT": "31000", "OMP_NUM_THREADS": "3", "CHECKPOINT_DIR": "/shared/run1",
        "MAX_RESTARTS": "0"})  # fmt: skip
    assert words[0] == "OMP_NUM_THREADS=3"
    assert "a:31000" in words and "/shared/run1" in words
    assert words[words.index("--max-restarts") + 1] == "0"


def test_sbatch_never_sets_zero_threads():
    words = render_sbatch(SBATCH, slurm_env={"SLURM_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "8"})
    assert words[0] == "OMP_NUM_THREADS=1"


def test_render_sbatch_bad_input(tmp_path):
    with pytest.raises(ValueError, match="at least one node"):
        render_sbatch(SBATCH, nodes=[])
    broken = tmp_path / "broken.sbatch"
    broken.write_text("#!/bin/bash\nset -u\necho $UNDEFINED_VARIABLE_XYZ\n")
    with pytest.raises(RuntimeError, match="UNDEFINED_VARIABLE_XYZ"):
        render_sbatch(broken)
