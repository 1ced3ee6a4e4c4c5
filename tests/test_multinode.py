"""Multi-node: lesson 10's SLURM job script, and its rank grid.

The launches of lesson 10 (the template across two torchrun "nodes", a rank killed
on one node with ``--max-restarts 1`` and the job restarting on both from one
snapshot), who writes checkpoints on a shared disk, an elastic
job and a missing node) are asserted by notebooks/10_multinode.ipynb itself; the
agreed attempt number with the nodes' restart counts made to differ by
tests/test_stores.py; the launcher's multi-node failure handling by
tests/test_wrapping.py. Here: the job script parsed by bash and rendered under a
fake SLURM environment.
"""

from __future__ import annotations

import subprocess

import pytest

from conftest import SCRIPTS
from ddp_tutorial.lessons.cluster import render_sbatch


def test_rank_grid_is_drawn_from_the_records():
    """Lesson 10's picture: one cell per process at (node, local rank), labelled with its RANK."""
    from ddp_tutorial.lessons.cluster import grid_labels, rank_grid_figure

    records = [{"rank": g * 3 + lr, "group_rank": g, "local_rank": lr}
               for g in range(2) for lr in range(3)]  # fmt: skip
    fig = rank_grid_figure(records)
    assert grid_labels(fig) == {(g, lr): f"RANK {g * 3 + lr}" for g in range(2) for lr in range(3)}
    assert len(fig.axes[0].patches) == 6


SBATCH = SCRIPTS / "slurm" / "train.sbatch"


def test_sbatch_parses():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sbatch_saves_and_requeues_before_the_time_limit():
    """SLURM: USR1 120 s before the limit, requeue allowed, a trap that passes it on."""
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    assert "trap requeue USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text


FAKE_SRUN = """#!/bin/bash
# fake srun: a "training" that saves on USR1 and exits 1, as srun does around a signalled
# torchrun (its ranks exit 75, torchrun re-raises the signal and exits 1): the trap must requeue
trap 'echo "$(date +%s.%N) USR1" >> "$LOG"; exit 1' USR1
echo "started $*" >> "$LOG"
while true; do sleep 0.05; done
"""


def test_sbatch_passes_usr1_on_and_requeues_after_the_save(tmp_path):
    """The job script's trap, run by bash with a fake srun and scontrol (no cluster)."""
    import os
    import signal
    import time

    log = tmp_path / "log"
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "scontrol $*" >> {log}\n'
                                       f'[ "$1" = show ] && echo n1 || true\n')  # fmt: skip
    for name in ("srun", "scontrol"):
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}  # fmt: skip
    job = subprocess.Popen(["bash", str(SBATCH), "--epochs", "3"], env=env, cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while "started" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the fake srun never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends
        _, err = job.communicate(timeout=20)
    finally:
        job.kill()
    lines = log.read_text().splitlines()
    assert job.returncode == 0 and "saving a snapshot, then requeueing job 77" in err
    assert lines[-2].endswith("USR1") and lines[-1] == "scontrol requeue 77", lines


def test_sbatch_renders_the_torchrun_command():
    words = render_sbatch(SBATCH, ["--epochs", "3"], nodes=["n1", "n2", "n3"],
                          slurm_env={"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "77"})  # fmt: skip
    assert words[:3] == ["OMP_NUM_THREADS=16", "srun", "--kill-on-bad-exit=1"]  # 64 CPUs / 4
    assert words[3] == "--cpus-per-task=64", "srun asks again: it does not inherit sbatch's"
    i = words.index("torchrun")
    flags = dict(zip(words[i + 1 : i + 19 : 2], words[i + 2 : i + 19 : 2], strict=True))
    assert flags == {
        "--nnodes": "3",
        "--nproc-per-node": "4",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "n1:29500",  # the allocation's first host
        "--rdzv-id": "77",
        "--max-restarts": "2",
        "--signals-to-handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",  # USR1 reaches the ranks
        "--shutdown-timeout": "100",  # time for their snapshot, inside --signal's 120 s
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
