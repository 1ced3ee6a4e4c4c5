"""Backend choice and process-group setup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SCRIPTS
from ddp_tutorial.distributed import BackendError, choose_backend


@pytest.mark.parametrize(
    ("requested", "local_ranks", "gpus", "expected"),
    [
        ("auto", 2, 0, "gloo"),
        ("auto", 2, 1, "gloo"),  # a 1-GPU laptop still runs 2-rank lessons, on CPU
        ("auto", 2, 2, "nccl"),
        ("auto", 1, 8, "nccl"),
        ("gloo", 2, 8, "gloo"),
        ("GLOO", 1, 0, "gloo"),
    ],
)
def test_choose_backend(requested, local_ranks, gpus, expected, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    backend, reason = choose_backend(requested, local_ranks, gpus=gpus)
    assert backend == expected and reason


def test_auto_says_why_it_fell_back_to_gloo():
    _, reason = choose_backend("auto", 2, gpus=1)
    assert "1 GPU(s) for 2 local ranks" in reason


def test_explicit_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(BackendError, match="Use backend='gloo'"):
        choose_backend("nccl", 2, gpus=0)


def test_explicit_nccl_with_too_few_gpus_says_how_many(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with pytest.raises(BackendError, match="--nproc-per-node 1"):
        choose_backend("nccl", 2, gpus=1)


def test_unknown_backend():
    with pytest.raises(BackendError, match="'auto', 'gloo' or 'nccl'"):
        choose_backend("mpi4", 1, gpus=0)


@pytest.mark.torchrun
def test_hello_without_torchrun_is_a_world_of_one(tmp_path):
    """Plain `python script.py` works (world size 1): the script can be debugged."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "hello.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 0/1" in proc.stdout and "all_reduce(sum of ranks) = 0" in proc.stdout


@pytest.mark.torchrun
def test_nccl_on_cpu_machine_fails_clearly_under_torchrun(tmp_path):
    from conftest import gpu_count
    from ddp_tutorial.harness.failures import LaunchError
    from ddp_tutorial.harness.launch import torchrun

    if gpu_count() >= 2:
        pytest.skip("this machine can run nccl with 2 ranks")
    with pytest.raises(LaunchError) as info:
        torchrun(
            SCRIPTS / "hello.py",
            "--backend",
            "nccl",
            nproc=2,
            run_dir=tmp_path,
            echo=False,
            env={"DDP_TUTORIAL_TIMEOUT": "20"},
        )
    assert "BackendError" in str(info.value) and "nccl" in str(info.value)
