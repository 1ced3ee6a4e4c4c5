"""The doctor on machines this one is not: a V100 box, a 2 x T4 hosted notebook, an H100 node.

Everything here runs on a fake NVML inventory (conftest.fake_pynvml) and a faked torch
CUDA build; nothing initialises CUDA.
"""

from __future__ import annotations

import pytest
import torch

from conftest import fake_gpu
from ddp_tutorial.harness import advice, checks
from ddp_tutorial.harness.advice import (
    has_kernels_for,
    hosted_notebook,
    plan_lines,
    workers_per_rank,
)
from ddp_tutorial.numerics import amp_for_capability

WHEEL = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # this torch 2.14.1 wheel


@pytest.mark.parametrize(
    ("capability", "runs"),
    [((7, 0), False), ((7, 5), True), ((8, 9), True), ((9, 0), True), ((6, 1), False)],
)
def test_kernels_for_a_capability(capability, runs):
    assert has_kernels_for(capability, WHEEL) is runs


def test_ptx_runs_on_anything_newer():
    assert has_kernels_for((12, 1), ["sm_80", "compute_90"])
    assert not has_kernels_for((8, 6), ["compute_90"])


def test_amp_follows_the_capability():
    assert [amp_for_capability(c) for c in [(7, 0), (7, 5), (8, 0), (9, 0), None]] == [
        "fp16",
        "fp16",
        "bf16",
        "bf16",
        "bf16",
    ]


def test_workers_leave_each_rank_a_core():
    assert [workers_per_rank(c, r) for c, r in [(4, 2), (2, 2), (64, 8), (1, 2)]] == [1, 0, 7, 0]


def test_hosted_notebooks_are_recognised():
    assert hosted_notebook({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}) == "Kaggle"
    assert hosted_notebook({"COLAB_RELEASE_TAG": "release-colab_20261101"}) == "Colab"
    assert hosted_notebook({}) is None


def _fake_cuda_build(monkeypatch, gpus: int, arch: list[str], cuda: str = "12.4") -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(checks, "torch_gpu_count", lambda env: gpus)  # asked in its own process
    monkeypatch.setattr(advice, "compiled_arch_list", lambda: arch)


def test_the_compiled_arch_list_is_torchs_without_asking_for_cuda(monkeypatch):
    """The doctor runs in the notebook's kernel, which forks ranks later: before torch 2.14,
    get_arch_list() called is_available() (CUDA initialised there); this list never does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    expected = torch.cuda.get_arch_list()  # what torch says it was built for

    def fork_trap():
        raise AssertionError("torch.cuda.is_available() in the doctor's process")

    monkeypatch.setattr(torch.cuda, "is_available", fork_trap)
    assert advice.compiled_arch_list() == expected


def test_the_course_floor_is_read_from_any_form_of_the_requirement(monkeypatch):
    import importlib.metadata

    assert advice.release("2.14.1+cu130") == (2, 14) and advice.release("2") == (2, 0)
    for needs, floor in (
        (["torchvision>=0.29", "torch<3,>=2.14; python_version >= '3.10'"], (2, 14)),
        (["torch>=2"], (2, 0)),
        (["torchvision>=0.29", "torch"], None),  # no lower bound: nothing to warn about
    ):
        monkeypatch.setattr(importlib.metadata, "requires", lambda name, n=needs: n)
        assert advice.course_torch_floor() == floor, needs


def test_a_v100_with_a_wheel_that_has_no_code_for_it_fails(nvml, monkeypatch):
    nvml([fake_gpu(i, name="Tesla V100-SXM2-32GB", capability=(7, 0)) for i in range(2)])
    _fake_cuda_build(monkeypatch, 2, WHEEL)
    finding = checks.check_cuda_build({})
    assert finding.status == "fail"
    assert "no code for cuda:0 Tesla V100-SXM2-32GB (7.0), cuda:1" in finding.detail
    assert "no kernel image is available" in finding.detail


def test_an_h100_with_the_same_wheel_is_fine(nvml, monkeypatch):
    nvml([fake_gpu(i) for i in range(8)])
    _fake_cuda_build(monkeypatch, 8, WHEEL)
    finding = checks.check_cuda_build({})
    assert finding.status == "ok" and "torch sees 8 GPU(s)" in finding.detail


def test_exclusive_process_mode_is_reported(nvml):
    nvml([fake_gpu(0, exclusive=True), fake_gpu(1)])
    finding, count = checks.check_gpus({})
    assert count == 2 and finding.status == "warn"
    assert "cuda:0 in compute mode EXCLUSIVE_PROCESS" in finding.detail
    assert "one after another" in finding.fix


def test_two_t4s_in_a_kaggle_notebook_get_fp16_and_the_command_that_fits(nvml, monkeypatch):
    nvml([fake_gpu(i, name="Tesla T4", capability=(7, 5), memory_mib=15_360) for i in range(2)],
         p2p=False)  # fmt: skip
    monkeypatch.setattr("ddp_tutorial.settings.usable_cores", lambda: 4)
    finding = checks.check_plan({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"})
    summary, command, cell = finding.detail.splitlines()
    assert summary.startswith("a Kaggle notebook; 2 x Tesla T4; compute capability 7.5: --amp fp16")
    assert "4 CPU core(s), 2 per GPU: --num-workers 1" in summary
    assert "no peer-to-peer between the GPUs" in summary
    assert command == (
        "torchrun --standalone --nproc-per-node 2 scripts/train.py --amp fp16 --num-workers 1"
    )
    assert cell == f"(from a notebook cell: !{command})"


def test_an_h100_node_gets_bf16(nvml, monkeypatch):
    nvml([fake_gpu(i) for i in range(8)])
    monkeypatch.setattr("ddp_tutorial.settings.usable_cores", lambda: 96)
    summary, command = checks.check_plan({}).detail.splitlines()
    assert "8 x H100; compute capability 9.0: --amp bf16" in summary
    assert "peer-to-peer between the GPUs" in summary
    assert command.endswith("--nproc-per-node 8 scripts/train.py --amp bf16 --num-workers 11")


def test_mixed_gpus_take_the_weakest_capability():
    from ddp_tutorial.devices import GpuInfo

    gpus = [GpuInfo(0, "A100", "GPU-a", 40_000, 0, capability=(8, 0)),
            GpuInfo(1, "Tesla T4", "GPU-b", 15_000, 0, capability=(7, 5))]  # fmt: skip
    summary, (command,) = plan_lines(gpus, cores=8, p2p=None, hosted=None)
    assert "--amp fp16" in command and "A100 / Tesla T4" in summary
