"""scripts/train.py end to end with 2 real gloo ranks: it learns, saves, loads, resumes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SCRIPTS
from ddp_tutorial.launch import LaunchError, torchrun
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
METRIC_KEYS = {
    "world_size",
    "backend",
    "device",
    "samples_per_sec",
    "step_times",
    "train_loss",
    "val_accuracy",
    "epochs",
    "steps",
}


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
    )


def test_trains_saves_and_loads(tmp_path):
    result = train(tmp_path, "a", "--epochs", "2")
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert metrics["steps"] == 2 * (512 // 2 // 16)
    assert set(metrics["step_times"]) == {"0", "1"} and metrics["samples_per_sec"] > 0
    history = metrics["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert metrics["val_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert [r["rank"] for r in result.records] == [0, 1]
    state = torch.load(result.run_dir / "ckpt" / "final.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    build_model("cnn", 10, 16).load_state_dict(state)  # strict


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    """Stop mid-epoch (--max-steps), relaunch: the final weights are bitwise the same."""
    straight = train(tmp_path, "straight", "--epochs", "2")
    first = train(tmp_path, "resumed", "--epochs", "2", "--max-steps", "21", "--save-every", "7")
    assert json.loads((first.run_dir / "metrics.json").read_text())["steps"] == 21
    second = train(tmp_path, "resumed", "--epochs", "2")
    metrics = json.loads((second.run_dir / "metrics.json").read_text())
    assert metrics["resumed"] and metrics["steps"] == 32
    a = torch.load(straight.run_dir / "ckpt" / "final.pt", weights_only=True)
    b = torch.load(second.run_dir / "ckpt" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resume must be exact on CPU"


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


def test_sync_bn_on_cpu_is_a_clear_error(tmp_path):
    result = train(tmp_path, "s", "--sync-bn", check=False)
    assert result.returncode != 0
    assert "--sync-bn needs GPUs with nccl" in result.output


@pytest.mark.parametrize("bad", [["--epochs", "0"], ["--model", "vgg"]])
def test_bad_flags_fail_before_training(tmp_path, bad):
    with pytest.raises(LaunchError):
        train(tmp_path, "bad", *bad)


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
