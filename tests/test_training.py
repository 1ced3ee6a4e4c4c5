"""scripts/train.py: what the lessons do not already assert on it.

Training that learns, saves a plain ``final.pt`` and loads it with
``weights_only=True`` is asserted by notebooks/06_training_and_utilization.ipynb;
a crash, a restart and a bitwise-exact resume by notebooks/08_fault_tolerance.ipynb.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SCRIPTS, load_script
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.models import build_model

SMALL = [
    "--num-samples",
    "512",
    "--num-val",
    "200",
    "--image-size",
    "16",
    "--batch-size",
    "16",
    "--no-progress",
]


def train(tmp_path, name, *extra, check=True):
    run = tmp_path / name
    return torchrun(
        SCRIPTS / "train.py",
        *SMALL,
        "--checkpoint-dir",
        run / "ckpt",
        *extra,
        nproc=2,
        run_dir=run,
        echo=False,
        timeout=240,
        check=check,
        env={"DDP_TUTORIAL_BACKEND": "gloo"},  # these tests are about the CPU path
    )


@pytest.mark.torchrun
def test_pretrain_with_module_prefix(tmp_path):
    torch.manual_seed(3)
    model = build_model("cnn", 10, 16)
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / "pretrained.pt"
    torch.save(prefixed, path)
    result = train(
        tmp_path, "p", "--epochs", "1", "--max-steps", "1", "--pretrain", path, "--lr", "0"
    )
    final = torch.load(result.run_dir / "ckpt" / "final.pt", weights_only=True)
    # lr 0: the parameters are still the pretrained ones (BatchNorm's running
    # statistics, buffers, do move with the forward pass)
    assert all(torch.equal(final[k], v) for k, v in model.named_parameters())


def test_sync_bn_on_cpu_is_a_clear_error():
    """Refused before anything is built on the device (no launch needed to see it)."""
    from ddp_tutorial.data import SyntheticImages
    from ddp_tutorial.distributed import DistInfo
    from ddp_tutorial.training import TrainConfig, Trainer

    info = DistInfo(0, 0, 1, 1, "gloo", torch.device("cpu"), "gloo requested")
    data = SyntheticImages(8, 16, 10)
    with pytest.raises(ValueError, match="--sync-bn needs GPUs with the nccl backend"):
        Trainer(TrainConfig(sync_bn=True, image_size=16), info, data, data)


@pytest.fixture(scope="module")
def template():
    """scripts/train.py as a module: its flag parsing runs here, without a launch."""
    return load_script("train.py")


@pytest.mark.parametrize(
    "bad,message",
    [(["--epochs", "0"], "--epochs must be at least 1"), (["--model", "vgg"], "invalid choice")],
)
def test_bad_flags_fail_before_training(template, capsys, bad, message):
    with pytest.raises(SystemExit) as info:
        template.parse_args(bad)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
def test_train_on_gpus_with_nccl_amp_and_sync_bn(tmp_path):
    from conftest import gpu_count

    n = gpu_count()
    run = tmp_path / "gpu"
    result = torchrun(SCRIPTS / "train.py", *SMALL, "--epochs", "2", "--amp", "--sync-bn",
                      "--checkpoint-dir", run / "ckpt", nproc=n, run_dir=run, echo=False,
                      timeout=600)  # fmt: skip
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    assert metrics["backend"] == "nccl" and metrics["device"] == "cuda:0"
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]
    state = torch.load(run / "ckpt" / "final.pt", weights_only=True, map_location="cpu")
    build_model("cnn", 10, 16).load_state_dict(state)  # SyncBatchNorm keys == BatchNorm keys


def test_template_offers_deterministic_and_timeout(template, capsys):
    cfg = template.parse_args(["--deterministic", "--timeout", "30"])
    assert cfg.deterministic and cfg.timeout == 30.0
    assert template.parse_args([]).timeout == 600.0  # a long save on rank 0 fits
    with pytest.raises(SystemExit):
        template.parse_args(["--timeout", "0"])
    assert "--timeout must be a positive number" in capsys.readouterr().err


def test_make_deterministic_sets_every_switch(monkeypatch):
    from ddp_tutorial.numerics import make_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        done = make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" == done["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def test_amp_refuses_emulated_bf16_with_a_clear_message():
    from ddp_tutorial.numerics import amp_dtype

    gpu = torch.device("cuda", 0)
    assert amp_dtype(gpu, amp=False) is None
    assert amp_dtype(gpu, amp=True, native_bf16=lambda: True) == torch.bfloat16  # A100, H100
    with pytest.raises(ValueError, match="does not support natively .* V100 or T4"):
        amp_dtype(gpu, amp=True, native_bf16=lambda: False)  # V100, T4
    assert amp_dtype(torch.device("cpu"), amp=True) == torch.bfloat16
