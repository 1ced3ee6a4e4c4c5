"""GPU path: only where a CUDA GPU is visible (`make gpu-check`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import DEMOS, SCRIPTS, gpu_count
from ddp_tutorial.harness.launch import torchrun

pytestmark = pytest.mark.gpu


def test_nvml_count_matches_cuda_count():
    """NVML (used by the kernel, no CUDA context) agrees with CUDA in a child process."""
    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == gpu_count()


def test_hello_nccl_one_rank_per_gpu(tmp_path):
    n = gpu_count()
    result = torchrun(DEMOS / "hello.py", nproc=n, run_dir=tmp_path, echo=False)
    assert [r["backend"] for r in result.records] == ["nccl"] * n
    assert [r["device"] for r in result.records] == [f"cuda:{i}" for i in range(n)]
    assert {r["all_reduce_sum"] for r in result.records} == {float(sum(range(n)))}


def test_auto_falls_back_to_gloo_with_more_ranks_than_gpus(tmp_path):
    n = gpu_count() + 1
    result = torchrun(DEMOS / "hello.py", nproc=n, run_dir=tmp_path, echo=False)
    assert {r["backend"] for r in result.records} == {"gloo"}


@pytest.mark.skipif(gpu_count() < 2, reason="binding to cuda:1 needs two GPUs")
@pytest.mark.parametrize("set_device", [False, True])
def test_device_id_binds_the_group_but_only_set_device_moves_the_current_device(set_device):
    """Lesson 03's claim on real GPUs: init_process_group(device_id=...) calls no set_device."""
    import json

    flag = ["--set-device"] if set_device else []
    done = subprocess.run([sys.executable, str(DEMOS / "device_binding.py"), *flag],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (1, 1, "cuda:1") if set_device else (0, 0, "cuda:0")
    assert (seen["before"], seen["after"], seen["tensor"]) == expected, seen


def test_the_resumable_rung_resumes_on_gpus(tmp_path):
    """The rung's snapshot is loaded onto the rank's GPU (map_location), its CPU generator
    states too: given back as they came, torch.set_rng_state refused them ("RNG state must be
    a torch.ByteTensor") on every resume, a crash no CPU run can show (helper 83's read)."""
    n = gpu_count()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(n), str(SCRIPTS / "resumable_ddp.py"),
               "--num-samples", "512", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    first = subprocess.run([*command, "--epochs", "1"], capture_output=True, text=True)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    rerun = subprocess.run([*command, "--epochs", "2"], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "resumed: epoch 1" in rerun.stdout, rerun.stdout
