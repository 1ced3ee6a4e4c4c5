"""Lesson 08's claims with real crashes: restart, resume mid-epoch, lose nothing."""

from __future__ import annotations

import json
import time

import torch

from conftest import SCRIPTS, processes_running
from ddp_tutorial.launch import torchrun

SMALL = [
    "--num-samples",
    "512",
    "--num-val",
    "100",
    "--image-size",
    "16",
    "--batch-size",
    "16",
    "--epochs",
    "2",
    "--no-progress",
]  # fmt: skip  (32 steps: 16 per epoch)


def train(run, *extra, restarts=0, check=True):
    return torchrun(SCRIPTS / "train.py", *SMALL, "--checkpoint-dir", run / "ckpt", *extra,
                    nproc=2, run_dir=run, echo=False, timeout=300, check=check,
                    torchrun_args=["--max-restarts", str(restarts)])  # fmt: skip


def test_crash_restart_is_bitwise_equal_to_uninterrupted(tmp_path):
    straight = train(tmp_path / "straight")
    crashed = train(tmp_path / "crashed", "--save-every", "5", "--fail-at-step", "13", restarts=2)
    assert "[fault injection] rank 1 dies at step 13" in crashed.output
    attempts = sorted(p.name for p in crashed.run_dir.glob("attempt*-rank*.json"))
    assert attempts == ["attempt0-rank0.json", "attempt0-rank1.json",
                        "attempt1-rank0.json", "attempt1-rank1.json"]  # fmt: skip
    second = json.loads((crashed.run_dir / "attempt1-rank0.json").read_text())
    assert second["resumed_from"] == {"epoch": 0, "step": 10, "batch": 10}  # mid-epoch snapshot
    a = torch.load(straight.run_dir / "ckpt" / "final.pt", weights_only=True)
    b = torch.load(crashed.run_dir / "ckpt" / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a), "weights after crash+restart differ"
    # the replayed steps (11..13) gave exactly the losses of the first attempt
    log = [json.loads(line) for line in (crashed.run_dir / "steps.jsonl").read_text().splitlines()]
    first = {r["step"]: r["loss"] for r in log if r["attempt"] == 0}
    again = {r["step"]: r["loss"] for r in log if r["attempt"] == 1}
    assert max(first) == 13 and min(again) == 11 and max(again) == 32
    assert all(first[s] == again[s] for s in range(11, 14))


def test_without_restarts_the_job_fails_naming_rank_and_signal(tmp_path):
    run = tmp_path / "norestart"
    result = train(run, "--fail-at-step", "3", check=False)
    assert result.returncode != 0
    root = result.failures[0]
    assert root.rank == 1 and root.signal == "SIGKILL"
    time.sleep(0.5)
    assert processes_running(str(run)) == [], "no rank may outlive a failed job"
