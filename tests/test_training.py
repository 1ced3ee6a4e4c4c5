"""scripts/train.py, the template: what the lessons do not already assert on a launch of it.

Lesson 06 asserts that it learns, that every rank evaluates one model (BatchNorm
buffers averaged) and that ``final.pt`` is that model, loadable with
``weights_only=True``; lesson 08 a crash, a restart and a bitwise-exact resume;
lesson 10 two nodes, and a resume on another number of ranks that sees every
sample of the interrupted epoch exactly once.

Bad input is checked here through the template's own ``main()`` in this process:
it must stop before ``init_process_group``, so no launch is needed to see it (one
real 2-rank launch shows it on every rank).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from conftest import SCRIPTS, load_script
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.models import build_model
from ddp_tutorial.real_data import write_example_folder
from ddp_tutorial.recorder import state_digest

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
CPU = {"DDP_TUTORIAL_BACKEND": "gloo"}  # these tests are about the CPU path


@pytest.fixture(scope="module")
def template():
    """scripts/train.py as a module: its functions run here, without a launch."""
    return load_script("train.py")


def run_main(template, monkeypatch, capsys, *argv):
    """The template's main() as rank 0 of a 1-rank job; returns (exit code, stderr)."""
    monkeypatch.setenv("DDP_TUTORIAL_BACKEND", "gloo")
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as stopped:
        template.main([str(a) for a in argv])
    assert not torch.distributed.is_initialized(), "stopped before init_process_group"
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--epochs", "0"], "argument --epochs: must be at least 1"),
        (["--grad-accum", "0"], "argument --grad-accum: must be at least 1"),
        (["--model", "vgg"], "invalid choice"),
        (["--warmup", "1.5"], "--warmup is a fraction"),
    ],
)
def test_bad_flags_fail_before_training(template, capsys, bad, message):
    with pytest.raises(SystemExit) as info:
        template.parse_args(bad)
    assert info.value.code == 2 and message in capsys.readouterr().err


def impossible_settings(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    write_example_folder(tmp_path / "no-val-class")
    for png in (tmp_path / "no-val-class" / "val" / "b").iterdir():
        png.unlink()
    (write_example_folder(tmp_path / "corrupt") / "train" / "a" / "0.png").write_bytes(b"not a png")
    (tmp_path / "empty").mkdir()
    return {
        "batch larger than the shard": (
            ["--num-samples", "10", "--batch-size", "32"],
            "--batch-size 32 x --grad-accum 1 is more than the 10 samples",
        ),
        "accumulation larger than the shard": (
            ["--num-samples", "64", "--batch-size", "16", "--grad-accum", "8"],
            "--grad-accum 8 is more than the 64 samples",
        ),
        "save-every beyond the run": (
            ["--num-samples", "64", "--batch-size", "16", "--epochs", "1", "--save-every", "9"],
            "--save-every 9 is beyond the run's 4 steps",
        ),
        "checkpoint dir is a file": (
            ["--checkpoint-dir", tmp_path / "a-file"],
            "a-file: is a file; give a directory",
        ),
        "missing data dir": (["--data-dir", tmp_path / "nowhere"], "no such folder"),
        "data dir without images": (["--data-dir", tmp_path / "empty"], "no train/ folder"),
        "class missing from val": (
            ["--data-dir", tmp_path / "no-val-class"],
            "class 'b' has no images in val/",
        ),
        "corrupt image": (["--data-dir", tmp_path / "corrupt"], "0.png is not a readable image"),
        "cifar10 not downloaded": (
            ["--data", "cifar10", "--data-dir", tmp_path / "cifar"],
            "Add --download to fetch it",
        ),
        "missing pretrain file": (["--pretrain", tmp_path / "nope.pt"], "no such file"),
        "one class": (["--num-classes", "1"], "synthetic data: SyntheticImages needs"),
        "sync-bn on CPU": (["--sync-bn"], "--sync-bn needs GPUs with nccl"),
    }


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest
def test_impossible_settings_stop_before_training(template, tmp_path, monkeypatch, capsys):
    for case, (argv, message) in impossible_settings(tmp_path).items():
        start = time.monotonic()
        code, err = run_main(template, monkeypatch, capsys, *argv)
        assert code == 2 and "train.py: error: " in err and message in err, (case, err)
        assert "Traceback" not in err and time.monotonic() - start < 10, case


def test_lr_schedule_warms_up_then_decays_to_zero(template):
    peak, warmup = 0.4, 0.1
    lrs = [template.lr_at(p / 100, peak, warmup) for p in range(101)]
    assert lrs[0] == 0 and lrs[5] == pytest.approx(peak / 2) and lrs[10] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False)) and lrs[100] == 0


def first_batches(template, dataset, *, seed, workers):
    """Each rank's first batch, built the way the template builds it (rank after rank)."""
    args = template.parse_args(
        ["--batch-size", "4", "--num-workers", str(workers), "--seed", str(seed)]
    )
    batches = []
    for rank in (0, 1):
        sampler, loader = template.data_loader(args, dataset, rank, 2, cuda=False)
        sampler.set_epoch(0)
        batches.append(next(iter(loader))[0])
    return batches


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_augment_differently_and_reproducibly(template, tmp_path, workers):
    from ddp_tutorial.real_data import image_folder

    train, _, _ = image_folder(write_example_folder(tmp_path, same=True, size=24), 16)  # one image
    rank0, rank1 = first_batches(template, train, seed=0, workers=workers)
    assert not torch.equal(rank0, rank1), "each rank crops and flips its own way"
    again0, again1 = first_batches(template, train, seed=0, workers=workers)
    assert torch.equal(rank0, again0) and torch.equal(rank1, again1), "a rerun reproduces them"
    assert not torch.equal(rank0[0], rank0[1]), "and the samples of one batch differ"


def test_speed_flags_parse_and_pick_their_tools(template):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from ddp_tutorial.comm_hooks import comm_hook
    from ddp_tutorial.numerics import amp_dtype

    assert template.parse_args(["--amp"]).amp == "bf16", "a bare --amp keeps meaning bf16"
    args = template.parse_args(["--amp", "fp16", "--compile", "--comm-hook", "powersgd"])
    assert (args.amp, args.compile, args.comm_hook) == ("fp16", "inductor", "powersgd")
    assert amp_dtype(torch.device("cpu"), "fp16") == torch.float16
    assert comm_hook("fp16") == (None, default_hooks.fp16_compress_hook)
    assert comm_hook("bf16") == (None, default_hooks.bf16_compress_hook)
    state, hook = comm_hook("powersgd")
    assert hook is powerSGD_hook.powerSGD_hook and state.start_powerSGD_iter == 1000
    with pytest.raises(ValueError, match="--comm-hook must be one of"):
        comm_hook("int8")


# -- real launches: every template run of this file at once, side by side ------------------
# Most of a launch is start-up (import torch, join the group): together they cost
# little more than the slowest. Each test below reads its own run.

MLP_RUN = ["--model", "mlp", "--image-size", "8", "--num-val", "64", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ddp_tutorial.harness.launch import LaunchSpec, run_together

    tmp = tmp_path_factory.mktemp("template")
    images = write_example_folder(tmp / "images", train=16, val=4, size=20)
    accum = [*MLP_RUN, "--num-samples", "512", "--epochs", "1", "--max-steps", "6"]
    argv = {
        "impossible": ["--num-samples", "10", "--batch-size", "32"],
        "folder": ["--data-dir", images, "--image-size", "16", "--batch-size", "4",
                   "--epochs", "3", "--no-progress"],
        "big batch": [*accum, "--batch-size", "16"],
        "accumulated": [*accum, "--batch-size", "8", "--grad-accum", "2"],
        "speed flags": [*MLP_RUN, "--num-samples", "192", "--batch-size", "16", "--epochs", "2",
                        "--amp", "fp16", "--comm-hook", "fp16", "--compile", "aot_eager",
                        "--grad-accum", "2"],
    }  # fmt: skip
    specs = {
        name: LaunchSpec(SCRIPTS / "train.py", [*args, "--checkpoint-dir", tmp / name / "ckpt"],
                         nproc=2, run_dir=tmp / name, echo=False, timeout=300, env=CPU)
        for name, args in argv.items()
    }  # fmt: skip
    results = run_together(specs)
    for name, result in results.items():
        assert name == "impossible" or result.ok, f"{name}:\n{result.output[-3000:]}"
    return results


@pytest.mark.torchrun
def test_impossible_batch_fails_fast_on_every_rank(runs):
    result = runs["impossible"]
    assert result.returncode != 0 and result.seconds < 60
    assert result.failures[0].exitcode == 2, "the ranks stop with status 2, no traceback"
    assert result.output.count("no step could run") == 1, "one message (local rank 0's)"


@pytest.mark.torchrun
def test_trains_on_an_image_folder_and_saves_the_model_it_evaluated(runs):
    run = runs["folder"].run_dir
    assert "global batch 8 = 4 per rank x 2 ranks x 1 accumulation" in runs["folder"].output
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]
    records = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    digests = [[e["digest"] for e in r["evaluations"]] for r in records]
    assert digests[0] == digests[1], "every rank evaluated the same weights and buffers"
    final = torch.load(run / "ckpt" / "final.pt", weights_only=True)
    assert state_digest(final) == digests[0][-1], "final.pt is the model that was evaluated"
    build_model("cnn", 3, 16).load_state_dict(final)  # 3 classes, from the folder names


@pytest.mark.torchrun
def test_gradient_accumulation_matches_the_large_batch(runs):
    """K micro-batches of B on N ranks take the step one batch of K*B takes (no BatchNorm)."""
    big, accum = (
        torch.load(runs[name].run_dir / "ckpt" / "final.pt", weights_only=True)
        for name in ("big batch", "accumulated")
    )
    assert all(torch.allclose(big[k], accum[k], atol=1e-6) for k in big), "float rounding only"


@pytest.mark.torchrun
def test_speed_flags_train_and_resume_state(runs):
    """--amp fp16 (a GradScaler), --comm-hook fp16, --compile and --grad-accum together."""
    from ddp_tutorial.snapshots import latest_snapshot

    run = runs["speed flags"].run_dir
    history = json.loads((run / "metrics.json").read_text())["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    snapshot = torch.load(latest_snapshot(run / "ckpt"), weights_only=True)
    assert snapshot["scaler"]["scale"] > 0, "the GradScaler's state is part of the snapshot"
    final = torch.load(run / "ckpt" / "final.pt", weights_only=True)
    build_model("mlp", 10, 8).load_state_dict(final)  # no "_orig_mod." or "module." prefix


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest
def test_pretrain_with_module_prefix(template, tmp_path, monkeypatch):
    """The template's own main(), as a real world of one in this process (no launch)."""
    from ddp_tutorial.distributed import free_port

    torch.manual_seed(3)
    model = build_model("cnn", 10, 16)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "pre.pt")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **CPU}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pretrain = ["--pretrain", str(tmp_path / "pre.pt"), "--checkpoint-dir", str(tmp_path)]
    template.main([*SMALL, "--epochs", "1", "--max-steps", "1", "--lr", "0", *pretrain])
    assert not torch.distributed.is_initialized(), "main() left the group"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    # lr 0: the parameters are still the pretrained ones (BatchNorm's running
    # statistics, buffers, do move with the forward pass)
    assert all(torch.equal(final[k], v) for k, v in model.named_parameters())


@pytest.mark.gpu
def test_train_on_gpus_with_nccl_amp_and_sync_bn(tmp_path):
    from conftest import gpu_count

    n = gpu_count()
    run = tmp_path / "gpu"
    result = torchrun(
        SCRIPTS / "train.py",
        *SMALL,
        "--epochs",
        "2",
        "--amp",
        "--sync-bn",
        "--checkpoint-dir",
        run / "ckpt",
        "--out",
        run,
        nproc=n,
        run_dir=run,
        echo=False,
        timeout=600,
    )
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    assert metrics["backend"] == "nccl" and metrics["device"] == "cuda:0"
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]
    state = torch.load(run / "ckpt" / "final.pt", weights_only=True, map_location="cpu")
    build_model("cnn", 10, 16).load_state_dict(state)  # SyncBatchNorm keys == BatchNorm keys


def test_template_offers_deterministic_and_timeout(template, capsys):
    args = template.parse_args(["--deterministic", "--timeout", "30"])
    assert args.deterministic and args.timeout == 30.0
    assert template.parse_args([]).timeout == 600.0  # a long save on rank 0 fits
    with pytest.raises(SystemExit):
        template.parse_args(["--timeout", "0"])
    assert "--timeout > 0" in capsys.readouterr().err


def test_make_deterministic_sets_every_switch(monkeypatch):
    from ddp_tutorial.numerics import make_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        done = make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" == done["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def test_amp_refuses_emulated_bf16_with_a_clear_message():
    from ddp_tutorial.numerics import amp_dtype

    gpu = torch.device("cuda", 0)
    assert amp_dtype(gpu, amp=False) is None
    assert amp_dtype(gpu, amp=True, native_bf16=lambda: True) == torch.bfloat16  # A100, H100
    with pytest.raises(ValueError, match="does not support natively .* V100 or T4.*--amp fp16"):
        amp_dtype(gpu, amp=True, native_bf16=lambda: False)  # V100, T4
    assert amp_dtype(gpu, amp="fp16", native_bf16=lambda: False) == torch.float16  # their way
    assert amp_dtype(torch.device("cpu"), amp=True) == torch.bfloat16
