"""Lesson 10: two torchrun "nodes" on this machine, checkpoint writers, elastic and missing
nodes, and the SLURM job script (parsed by bash, rendered under a fake SLURM environment)."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import SCRIPTS
from ddp_tutorial.checkpoint import list_snapshots, load_checkpoint, stale_temp_files
from ddp_tutorial.debugging import render_sbatch, rendezvous_node, run_cases
from ddp_tutorial.launch import multinode

SBATCH = SCRIPTS / "slurm" / "train.sbatch"
HELLO = SCRIPTS / "hello.py"
TRAIN = ["--model", "mlp", "--image-size", "8", "--num-samples", "256", "--num-val", "64",
         "--epochs", "2", "--batch-size", "32", "--no-progress"]  # fmt: skip


@pytest.mark.slow
def test_template_trains_across_two_nodes(tmp_path):
    ckpt = tmp_path / "shared" / "ckpt"
    nodes = multinode(SCRIPTS / "train.py", *TRAIN, "--checkpoint-dir", ckpt, nnodes=2,
                      nproc_per_node=1, run_dir=tmp_path / "run", echo=False, timeout=240,
                      env={"GLOO_SOCKET_IFNAME": "lo"})  # fmt: skip
    rows = sorted(
        (json.loads(p.read_text()) for n in nodes for p in n.run_dir.glob("attempt0-rank*.json")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in rows] == [0, 1]
    assert [r["local_rank"] for r in rows] == [0, 0]  # both nodes have a local rank 0
    assert sorted(r["group_rank"] for r in rows) == [0, 1]
    assert all(r["world_size"] == 2 for r in rows)
    metrics = [n.run_dir / "metrics.json" for n in nodes if (n.run_dir / "metrics.json").exists()]
    assert len(metrics) == 1, "one job, one metrics.json (global rank 0)"
    history = json.loads(metrics[0].read_text())["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert list_snapshots(ckpt) and not stale_temp_files(ckpt)
    final = load_checkpoint(ckpt / "final.pt")  # weights_only=True
    assert final and not any(k.startswith("module.") for k in final), "the plain model's keys"


@pytest.mark.slow
def test_local_rank_zero_guard_means_one_writer_per_node(tmp_path):
    nodes = multinode(SCRIPTS / "save_race.py", "--dir", tmp_path / "disk", "--modes",
                      "local-rank-0,rank-0-atomic", "--rounds", 3, "--numel", 100_000,
                      nnodes=2, nproc_per_node=1, run_dir=tmp_path / "run", echo=False,
                      timeout=240)  # fmt: skip
    records = [rec for n in nodes for rec in n.records]
    assert len(records) == 2
    for rec in records:
        assert rec["results"]["local-rank-0"]["writers"] == 2
        assert rec["results"]["rank-0-atomic"]["writers"] == 1
        assert rec["results"]["rank-0-atomic"]["ok"] == 3


@pytest.mark.slow
def test_elastic_starts_alone_and_a_missing_node_times_out(tmp_path):
    runs = run_cases(
        {
            "elastic": rendezvous_node(HELLO, nnodes="1:2", rdzv_conf="last_call_timeout=1"),
            "missing": rendezvous_node(HELLO, nnodes="2", rdzv_conf="join_timeout=3"),
        },
        timeout=120,
        run_dir=tmp_path,
    )
    assert runs["elastic"].ok and [r["world_size"] for r in runs["elastic"].records] == [1]
    missing = runs["missing"]
    assert not missing.ok and not missing.timed_out and not missing.records
    assert "RendezvousTimeoutError" in missing.output


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
