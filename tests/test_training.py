"""scripts/train.py, the template: what the lessons do not already assert on a launch of it.

Lesson 06 asserts that it learns, that every rank evaluates one model (BatchNorm
buffers averaged) and that ``final.pt`` is that model, loadable with
``weights_only=True``; lesson 08 a crash, a restart and a bitwise-exact resume;
lesson 10 two nodes, and a resume on another number of ranks that sees every
sample of the interrupted epoch exactly once.

Bad input is checked here through the template's own ``main()`` in this process:
it must stop before ``init_process_group``, so no launch is needed to see it (one
real 2-rank launch shows it on every rank). What a week on a cluster needs — a save
that fails, a rank that falls behind — is proven on real launches, all started side by
side in one module fixture; a SIGTERM mid-epoch (its ranks exit 75, torchrun 1; the rerun bitwise
equal) and a loss that diverges (every rank stops, the good snapshots kept) are lesson
08's own launches, asserted there.
What one rank shows as well (the speed flags, a resume with a GradScaler, --download)
runs as a world of one in this process: no launch.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time

import pytest
import torch

from conftest import SCRIPTS, load_script
from ddp_tutorial.data import SyntheticImages, distributed_evaluate
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.models import build_model
from ddp_tutorial.real_data import build_datasets, write_example_folder
from ddp_tutorial.recorder import state_digest
from ddp_tutorial.seeding import rank_seed

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
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")  # a world of one: its store binds any free port
    benchmark = torch.backends.cudnn.benchmark  # main() sets it before its last checks
    try:
        with pytest.raises(SystemExit) as stopped:
            template.main([str(a) for a in argv])
    finally:
        torch.backends.cudnn.benchmark = benchmark
    assert not torch.distributed.is_initialized(), "stopped before init_process_group"
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--epochs", "0"], "argument --epochs: must be at least 1"),
        (["--grad-accum", "0"], "argument --grad-accum: must be at least 1"),
        (["--model", "vgg"], "invalid choice"),
        (["--warmup", "1.5"], "--warmup is a fraction"),
        # helper 107: tracebacks from numpy and torch, a failed.json, or silently off
        (["--seed", "-1"], "argument --seed: must be at least 0"),
        (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
        (["--lr", "-1"], "argument --lr: must be a finite number >= 0"),
        (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number"),
        (["--clip-grad", "inf"], "argument --clip-grad: must be a finite number"),
        (["--save-minutes", "nan"], "argument --save-minutes: must be a finite number"),
        (["--timeout", "inf"], "argument --timeout: must be a finite number"),
        (["--init-timeout", "nan"], "argument --init-timeout: must be a finite number"),
        (["--eval-every", "-3"], "argument --eval-every: must be at least 0"),
        (["--num-workers", "-1"], "argument --num-workers: must be at least 0"),
        # helper 113: "no timeout" as a huge number failed every start in gloo (its ns overflow),
        # a nanosecond timestamp as a seed in torch's manual_seed
        (["--timeout", "1e10"], "--timeout must be at least 1 and at most 31536000"),
        (["--timeout", "0.001"], "--timeout must be at least 1"),  # helper 150: gloo's 1 ms
        (["--init-timeout", "1e14"], "--init-timeout must be at least 1 and at most 31536000"),
        (["--seed", "20000000000000"], "argument --seed: must be at least 0 and below 2**32"),
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
            [
                "--num-samples",
                "64",
                "--batch-size",
                "16",
                "--epochs",
                "1",
                "--max-steps",
                "3",
                "--save-every",
                "4",
            ],  # fmt: skip
            "--save-every 4 is beyond the run's 3 steps (--max-steps)",
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
    # torchvision and PIL first: the bound times the checks, not the first case's import of
    # them (11 s on a loaded host, helper 111)
    import torchvision.datasets.folder  # noqa: F401

    for case, (argv, message) in impossible_settings(tmp_path).items():
        start = time.monotonic()
        code, err = run_main(template, monkeypatch, capsys, *argv)
        assert code == 2 and "train.py: error: " in err and message in err, (case, err)
        assert "Traceback" not in err and time.monotonic() - start < 10, case


def test_lr_schedule_warms_up_then_decays_to_zero(template):
    peak, warmup = 0.4, 0.1
    lrs = [template.kit.lr_at(p / 100, peak, warmup) for p in range(101)]
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
    assert template.parse_args(["--compile"]).compile == "inductor", "a bare --compile"
    assert amp_dtype(torch.device("cpu"), "fp16") == torch.float16
    assert comm_hook("fp16") == (None, default_hooks.fp16_compress_hook)
    assert comm_hook("bf16") == (None, default_hooks.bf16_compress_hook)
    state, hook = comm_hook("powersgd")
    assert hook is powerSGD_hook.powerSGD_hook and state.start_powerSGD_iter == 1000
    with pytest.raises(ValueError, match="--comm-hook must be one of"):
        comm_hook("int8")


# -- real launches: every template run of this file at once, side by side ------------------
# Most of a launch is start-up (import torch, join the group): together they cost
# little more than the slowest. Each test below reads its own run (one runs under a
# file-size limit, one has a rank frozen).

MLP_RUN = ["--model", "mlp", "--image-size", "8", "--num-val", "64", "--no-progress"]
LATE_AFTER = "step 3:"  # ... after which it freezes rank 1 (SIGSTOP) of the --timeout run
LATE_TIMEOUT_S = 3
FILE_SIZE_LIMIT = 100_000  # bytes: a snapshot of the MLP (~230 KB) cannot be written, logs can

BUFFERS = """
import sys, torch
from torch import nn
from ddp_tutorial.data import distributed_evaluate
from ddp_tutorial.distributed import average_buffers, process_group
from ddp_tutorial.records import write_rank_record

class Rotary(nn.Module):  # a constant buffer, one meant to differ per rank, a BatchNorm
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))
        self.register_buffer("mine", torch.zeros(2))
        self.register_buffer("scale", torch.zeros(1))  # a float buffer that no norm keeps
        self.norm = nn.BatchNorm1d(4)

with process_group(backend="gloo") as info:
    model = Rotary()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["mine"])
    constant = model.inv_freq.clone()
    model.mine.fill_(info.rank)
    model.scale.fill_(info.rank)
    model.norm.running_mean.fill_(info.rank)
    model.norm.num_batches_tracked.fill_(10 + info.rank)
    moved = average_buffers(model)
    # a stop asked on rank 1 only, from its 25th batch of 334/333/333 (1000 samples, batch 1)
    torch.manual_seed(0)  # the same samples and weights on every rank
    data = torch.utils.data.TensorDataset(torch.randn(1000, 2), torch.arange(1000) % 3)
    net, seen = nn.Linear(2, 3), []
    net.register_forward_hook(lambda *args: seen.append(1))
    plain = distributed_evaluate(net, data, 1)
    never = distributed_evaluate(net, data, 1, stop=lambda: False)
    seen.clear()
    stopped = distributed_evaluate(net, data, 1, stop=lambda: info.rank == 1 and len(seen) >= 25)
    write_rank_record(sys.argv[-1], {
        "eval": [plain.correct, plain.count, never.correct, never.count, never.interrupted],
        "stopped": [stopped.interrupted, len(seen)],
        "constant_kept": torch.equal(model.inv_freq, constant), "mine": model.mine.tolist(),
        "scale": model.scale.tolist(), "running_mean": model.norm.running_mean.tolist(),
        "count": int(model.norm.num_batches_tracked), "moved": moved})
"""


# the template run on a node whose copy of the data has one training sample less (helper 150:
# the ranks hung until --timeout at the first epoch's end, then gloo's recv timeout)
UNEQUAL = """
import os, sys
sys.path.insert(0, os.environ["TEMPLATE_DIR"])
import torch, ddp_kit, train
real = ddp_kit.build_datasets
def build(args, rank=0, world_size=1):
    train_set, val_set, classes = real(args, rank, world_size)
    if rank == 1:
        train_set = torch.utils.data.Subset(train_set, range(len(train_set) - 1))
    return train_set, val_set, classes
ddp_kit.build_datasets = build
train.main()
"""


def file_size_limited(spec, limit):
    """Start ``spec`` with RLIMIT_FSIZE = ``limit`` bytes (inherited by torchrun and its ranks).

    A real failed write: as root, permissions do not stop one; a file-size limit does
    (the write fails with EFBIG, "File too large").
    """
    from ddp_tutorial.harness.launch import Launch

    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        return Launch(spec)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)


def freeze_a_rank(launch, late: dict) -> None:
    """One step of the late-rank run: SIGSTOP rank 1 after LATE_AFTER; SIGCONT when rank 0 ends.

    A frozen rank is a real late one (a node swapping, a stuck file system): rank 0
    waits for it in the next all_reduce until the collective timeout. Once rank 0
    has ended, rank 1 resumes to take torchrun's SIGTERM (a stopped process would
    hold it until torchrun's grace period ends).
    """
    import psutil

    if "stopped" not in late and any(LATE_AFTER in line for line in launch.lines):
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launch.proc.pid).children()}
        ranks[1].suspend()
        late.update(stopped=time.time(), ranks=ranks)
    elif "stopped" in late and "rank 0 ended" not in late:
        try:
            running = late["ranks"][0].status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        if not running or time.time() - late["stopped"] > 120:
            late["rank 0 ended"] = time.time()
            late["ranks"][1].resume()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dataclasses import replace

    from ddp_tutorial.harness.launch import Launch, LaunchSpec

    tmp = tmp_path_factory.mktemp("template")
    images = write_example_folder(tmp / "images", train=16, val=4, size=20)
    accum = [*MLP_RUN, "--num-samples", "512", "--epochs", "1", "--max-steps", "6"]
    argv = {
        "impossible": ["--num-samples", "10", "--batch-size", "32"],
        "folder": ["--data-dir", images, "--image-size", "16", "--batch-size", "4",
                   "--epochs", "3", "--no-progress"],
        "big batch": [*accum, "--batch-size", "16", "--optimizer", "sgd"],
        "accumulated": [*accum, "--batch-size", "8", "--grad-accum", "2", "--optimizer", "sgd"],
        "speed flags": [*MLP_RUN, "--num-samples", "192", "--batch-size", "16", "--epochs", "2",
                        "--amp", "bf16", "--comm-hook", "fp16", "--compile", "aot_eager",
                        "--grad-accum", "2"],  # bf16 autocast is real on CPUs (fp16: one rank)
        "late rank": [*MLP_RUN, "--num-samples", "4096", "--batch-size", "8", "--epochs", "1",
                      "--log-every", "1", "--timeout", str(LATE_TIMEOUT_S)],
        "failed save": [*MLP_RUN, "--num-samples", "512", "--batch-size", "16",
                        "--save-every", "2"],
    }  # fmt: skip
    specs = {
        name: LaunchSpec(SCRIPTS / "train.py", [*args, "--checkpoint-dir", tmp / name / "ckpt"],
                         nproc=2, run_dir=tmp / name, echo=False, timeout=300, env=CPU)
        for name, args in argv.items()
    }  # fmt: skip
    (tmp / "unequal.py").write_text(UNEQUAL)
    specs["unequal data"] = LaunchSpec(tmp / "unequal.py", [*MLP_RUN, "--num-samples", "64"],
                                       nproc=2, run_dir=tmp / "unequal", echo=False, timeout=300,
                                       env={**CPU, "TEMPLATE_DIR": str(SCRIPTS)})  # fmt: skip
    (tmp / "buffers.py").write_text(BUFFERS)
    specs["buffers"] = LaunchSpec(tmp / "buffers.py", nproc=3, run_dir=tmp / "buffers",
                                  echo=False, timeout=300)  # fmt: skip
    launches, ended, late = {}, {}, {}
    try:
        for name, spec in specs.items():
            if name == "failed save":
                launches[name] = file_size_limited(replace(spec, check=False), FILE_SIZE_LIMIT)
            else:
                launches[name] = Launch(replace(spec, check=False))
        while not all(la.done for la in launches.values()):
            for name, launch in launches.items():
                launch.poll(block_s=0.05)
                if launch.done and name not in ended:
                    ended[name] = time.time()
            freeze_a_rank(launches["late rank"], late)
    except BaseException:
        for launch in launches.values():
            launch.kill()
        raise
    finally:
        if "stopped" in late and "rank 0 ended" not in late:
            late["ranks"][1].resume()
    results = {name: launch.wait() for name, launch in launches.items()}
    for name, result in results.items():
        if name not in ("impossible", "failed save", "late rank", "unequal data"):
            assert result.ok, f"{name}:\n{result.output[-3000:]}"
    results["ended"], results["late"] = ended, late
    return results


def attempt_started(run) -> float:
    """When the ranks began training: their attempt records are written right before."""
    return min(p.stat().st_mtime for p in run.run_dir.glob("attempt*-rank*.json"))


@pytest.mark.torchrun
def test_impossible_batch_fails_fast_on_every_rank(runs):
    result = runs["impossible"]
    assert result.returncode != 0  # fast: stopped before init (its time depends on the host)
    assert result.failures[0].exitcode == 2, "the ranks stop with status 2, no traceback"
    assert result.output.count("no step could run") == 1, "one message (local rank 0's)"


@pytest.mark.torchrun
def test_ranks_with_data_sets_of_different_sizes_stop_at_once(runs):
    result = runs["unequal data"]
    # stopped by the check, not by the launch's 300 s (--timeout's 600 s would be a hang)
    assert result.returncode == 1 and not result.timed_out, result.output[-3000:]
    said = "train.py: error: DataError: the ranks' data sets differ in size (train 63 to 64"
    assert all(f"[rank{r}]: {said}" in result.output for r in (0, 1)), result.output[-3000:]


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
def test_gradient_accumulation_matches_the_large_batch(runs, template):
    """K micro-batches of B on N ranks take the step one batch of K*B takes (no BatchNorm)."""
    big, accum = (
        torch.load(runs[name].run_dir / "ckpt" / "final.pt", weights_only=True)
        for name in ("big batch", "accumulated")
    )
    assert all(torch.allclose(big[k], accum[k], atol=1e-6) for k in big), "float rounding only"
    torch.manual_seed(template.parse_args([]).seed)  # the weights both runs started from
    start = build_model("mlp", 10, 8).state_dict()
    moved = min((big[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3, f"every tensor moved far beyond the tolerance (least: {moved:.2g})"


@pytest.mark.torchrun
def test_speed_flags_train_on_two_ranks(runs):
    """--amp bf16, --comm-hook fp16, --compile and --grad-accum together, on 2 gloo ranks.

    (--amp fp16's GradScaler and its resume: test_speed_flags_are_active_and_resume_exactly.)
    """
    run = runs["speed flags"].run_dir
    history = json.loads((run / "metrics.json").read_text())["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    final = torch.load(run / "ckpt" / "final.pt", weights_only=True)
    assert all(v.dtype != torch.bfloat16 for v in final.values()), "autocast: fp32 weights"
    build_model("mlp", 10, 8).load_state_dict(final)  # no "_orig_mod." or "module." prefix


@pytest.mark.torchrun
def test_a_late_rank_fails_the_job_within_the_timeout(runs):
    """--timeout 3: rank 1 frozen after step 3; rank 0 gives up in 3 s, not in gloo's 30 minutes."""
    late, run = runs["late"], runs["late rank"]
    assert "stopped" in late, "the run ended before rank 1 could be frozen"
    waited = late["rank 0 ended"] - late["stopped"]
    # the message is the proof; the bound only tells 3 s from gloo's default 1800 s, with room
    # for a loaded host (rank 1 is let go at 120 s: a run without the timeout ends there)
    assert run.returncode != 0 and waited < 100, waited
    err = run.rank_log(0, "stderr")
    assert f"Timed out waiting {LATE_TIMEOUT_S * 1000}ms" in err, err[-2000:]


@pytest.mark.torchrun
def test_a_failed_save_stops_every_rank_at_once_with_rank_0s_error(runs):
    """rank 0's write really fails (a file-size limit); nobody waits in a barrier."""
    run = runs["failed save"]
    seconds = runs["ended"]["failed save"] - attempt_started(run)
    # every rank raises rank 0's error at once; a rank left in a barrier would wait for the
    # collective timeout (600 s): the bound tells the two apart on a loaded host too
    assert run.returncode != 0 and seconds < 120, seconds
    assert {f.rank for f in run.failures} == {0, 1}, "both ranks stopped"
    for rank in (0, 1):
        err = run.rank_log(rank, "stderr")
        assert "rank 0 failed to save" in err and "File too large" in err, (rank, err[-2000:])
    assert not list((run.run_dir / "ckpt").glob("snapshot-*.pt")), "no partial snapshot left"
    failed = json.loads((run.run_dir / "ckpt" / "failed.json").read_text())
    assert "File too large" in failed["error"], "a restart would stop at once, naming it"


@pytest.mark.torchrun
def test_buffers_averaged_are_norm_statistics_only_on_three_ranks(runs):
    """average_buffers: a constant buffer bit-exact, an ignored one per rank, a counter rank 0's."""
    records = runs["buffers"].records
    assert [r["rank"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["constant_kept"], "an average of 3 equal float32 copies is not always the copy"
        assert r["mine"] == [float(r["rank"])] * 2, "_ddp_params_and_buffers_to_ignore: left alone"
        # helper 173: every float buffer averaged passed (the constant's copies are equal)
        assert r["scale"] == [0.0], "a float buffer that is no norm statistic: rank 0's"
        assert r["running_mean"] == [1.0] * 4 and r["count"] == 10, r
    assert [r["moved"] for r in records] == [1.0, 1.0, 2.0], "the largest change on each rank"


@pytest.mark.torchrun
def test_an_evaluation_stopped_on_one_rank_stops_on_every_rank_at_the_same_batch(runs):
    """distributed_evaluate(stop=...) on 3 ranks, 334/333/333 batches: asked only on rank 1 from
    its 25th batch, every rank stops at the agreement of batch 31 (0, 1, then every 10 when
    batches are fast) and says interrupted; no rank waits alone in the sums' all_reduce while
    the others evaluate on. A stop never asked changes nothing: each sample counted once."""
    records = runs["buffers"].records
    for r in records:
        correct, count, same, also, interrupted = r["eval"]
        assert (count, also, same, interrupted) == (1000, 1000, correct, False), r["eval"]
    assert [r["stopped"] for r in records] == [[True, 31]] * 3


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for one rank: the template's main() runs in this process.

    MASTER_PORT 0: rank 0's store binds a port the OS picks as it binds (no other rank
    connects), so no port is chosen first and taken meanwhile. Its stop checks install
    SIGTERM/SIGUSR1 handlers: pytest's own come back afterwards. main() turns on
    ``cudnn.benchmark`` for the process, as it should in a training job: put back
    here, so the next test in this process does not inherit it.
    """
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", **CPU}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = benchmark
    for sig, handler in saved.items():
        signal.signal(sig, handler)


TINY = ["--model", "mlp", "--image-size", "8", "--num-val", "8", "--no-progress"]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest
def test_pretrain_with_module_prefix(template, tmp_path, one_rank):
    """The template's own main(), as a real world of one in this process (no launch)."""
    torch.manual_seed(3)
    model = build_model("cnn", 10, 16)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "pre.pt")
    pretrain = ["--pretrain", str(tmp_path / "pre.pt"), "--checkpoint-dir", str(tmp_path)]
    template.main([*SMALL, "--epochs", "1", "--max-steps", "1", "--lr", "0", *pretrain])
    assert not torch.distributed.is_initialized(), "main() left the group"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    # lr 0: the parameters are still the pretrained ones (BatchNorm's running
    # statistics, buffers, do move with the forward pass)
    assert all(torch.equal(final[k], v) for k, v in model.named_parameters())


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_snapshot_of_a_padded_last_step_resumes(template, tmp_path, one_rank, capsys):
    """9 samples on 2 ranks, batch 5: the epoch's one step deals out 10 (padding).

    A snapshot of that step (--save-every 1) holds consumed=10; a crash during the
    evaluation that follows made every resume fail with "consumed must be in [0, 9]".
    """
    from ddp_tutorial.snapshots import latest_snapshot

    nine = [*TINY, "--num-samples", "9", "--batch-size", "5", "--epochs", "2",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*nine, "--max-steps", "1"])
    path = latest_snapshot(tmp_path)
    state = torch.load(path, weights_only=True)
    # what the 2-rank job saved at its step 1, before evaluating epoch 0
    state.update(epoch=0, world_size=2, rng=state["rng"] * 2)
    state["extra"].update(consumed=10, history=[], loss_sums=[23.0, 10.0])  # 10 targets
    torch.save(state, path)
    (tmp_path / "final.pt").unlink()
    capsys.readouterr()
    template.main(nine)  # resumes: nothing left of epoch 0, evaluates it, trains epoch 1
    out = capsys.readouterr().out
    assert "resumed from snapshot-000000001.pt: epoch 0, step 1, 10 samples into it" in out, out
    history = read_history(tmp_path)
    # epoch 0 is not trained again: evaluated at the saved step 1, with the saved loss (23 / 10);
    # epoch 1 on 1 rank: 9 samples, batch 5, one step
    assert [(h["epoch"], h["step"]) for h in history] == [(0, 1), (1, 2)], history
    assert history[0]["train_loss"] == pytest.approx(2.3)
    last = torch.load(latest_snapshot(tmp_path), weights_only=True)["optimizer"]["state"]
    assert all(int(s["step"]) == 2 for s in last.values()), "epoch 1 trained: one more step"


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_loop_practitioners_expect(template, tmp_path, monkeypatch, capsys, one_rank):
    """What practitioners expect of a loop: cudnn.benchmark, the log line, --eval-every and best.pt,
    the schedule warning on resume, the short collective timeout after the first step."""
    calls = []
    monkeypatch.setattr(template.kit, "set_collective_timeout", lambda s: calls.append(s))
    before = torch.backends.cudnn.benchmark
    argv = [*TINY, "--num-samples", "256", "--batch-size", "16", "--epochs", "1",
            "--max-steps", "8", "--log-every", "4", "--eval-every", "4", "--num-val", "64",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    try:
        template.main([*argv, "--timeout", "30", "--out", str(tmp_path / "out")])
        assert torch.backends.cudnn.benchmark, "no --deterministic: cuDNN may time its kernels"
    finally:
        torch.backends.cudnn.benchmark = before
    out = capsys.readouterr().out
    assert calls == [30.0], "the short timeout once, after the first step (not at init)"
    line = next(ln for ln in out.splitlines() if ln.startswith("step 4: "))
    assert all(word in line for word in ("loss", "lr", "grad norm", "samples/s")), line
    history = read_history(tmp_path)
    assert [h["step"] for h in history] == [4, 8], "--eval-every 4: steps 4 and 8 (the last)"
    # best.pt is the first evaluated model with the highest accuracy: its digest is that
    # evaluation's (recorded with --out), and it scores that accuracy on the validation set
    evaluations = json.loads((tmp_path / "out" / "rank0.json").read_text())["evaluations"]
    accuracies = [h["val_accuracy"] for h in history]
    best_at = accuracies.index(max(accuracies))
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert state_digest(best) == evaluations[best_at]["digest"], (accuracies, best_at)
    model = build_model("mlp", 10, 8)
    model.load_state_dict(best)
    _, val_set, _ = build_datasets(template.parse_args(argv))
    assert distributed_evaluate(model, val_set).accuracy == accuracies[best_at]
    template.main([*argv, "--epochs", "2", "--lr", "0.01"])
    assert "WARNING: resumed with --epochs 1 -> 2, --lr 0.003 -> 0.01" in capsys.readouterr().out


SPEED = [*TINY, "--num-samples", "128", "--batch-size", "8", "--epochs", "2", "--amp", "fp16",
         "--grad-accum", "2", "--compile", "aot_eager", "--comm-hook", "fp16", "--deterministic",
         "--warmup", "0"]  # fmt: skip


def cloned(state):
    """A deep copy of a state_dict-like tree (training goes on mutating the original)."""
    import copy

    return copy.deepcopy(state)


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_speed_flags_are_active_and_resume_exactly(template, tmp_path, monkeypatch, one_rank):
    """--amp fp16 (a GradScaler), --grad-accum 2, --compile, --comm-hook fp16, --deterministic.

    A world of one in this process: the hook is called on every optimizer step (and on no
    micro-batch under no_sync), deterministic algorithms are on, and a run stopped at step 6
    resumes with the scaler, step, weights and optimizer it saved, to end bitwise where the
    uninterrupted run ends.
    """
    hook_calls = []

    def counting(name):  # the real hook, counted
        state, hook = real_comm_hook(name)
        return state, lambda s, bucket: hook_calls.append(bucket.index()) or hook(s, bucket)

    real_comm_hook = template.kit.comm_hook
    monkeypatch.setattr(template.kit, "comm_hook", counting)
    restored = {}
    real_restore = template.kit.restore_training_state

    def spy(state, ddp, optimizer, scaler, same_world):
        where = real_restore(state, ddp, optimizer, scaler, same_world)
        # copies: the optimizer trains on with the loaded tensors, in place
        restored.update(saved=cloned(state), where=where, scaler=scaler.state_dict(),
                        model=cloned(ddp.module.state_dict()),
                        optimizer=cloned(optimizer.state_dict()["state"]))  # fmt: skip
        return where

    monkeypatch.setattr(template.kit, "restore_training_state", spy)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so that teardown removes
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # what --deterministic sets
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        template.main([*SPEED, "--checkpoint-dir", str(tmp_path / "straight")])
        assert torch.are_deterministic_algorithms_enabled(), "--deterministic"
        assert len(hook_calls) == 16, "2 epochs x 8 steps, one bucket: only on the last micro"
        template.main([*SPEED, "--checkpoint-dir", str(tmp_path / "stopped"), "--max-steps", "6"])
        assert not restored, "nothing to resume yet"
        template.main([*SPEED, "--checkpoint-dir", str(tmp_path / "stopped")])
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before
        torch._dynamo.reset()
    saved = restored["saved"]
    assert restored["where"]["step"] == saved["step"] == 6 and len(hook_calls) == 16 + 6 + 10
    fresh = torch.amp.GradScaler("cpu").state_dict()
    assert saved["scaler"]["_growth_tracker"] == 6 != fresh["_growth_tracker"]
    assert restored["scaler"] == saved["scaler"], "the GradScaler continues, not restarts"
    torch.testing.assert_close(restored["model"], saved["model"], rtol=0, atol=0)
    torch.testing.assert_close(restored["optimizer"], saved["optimizer"]["state"], rtol=0, atol=0)
    straight, resumed = (torch.load(tmp_path / run / "final.pt", weights_only=True)
                         for run in ("straight", "stopped"))  # fmt: skip
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "bitwise"
    assert not any(torch.equal(resumed[k], saved["model"][k]) for k in resumed), "it trained on"


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_pods_rank_without_a_launcher_is_told_to_start_torchrun(template, monkeypatch):
    """Only a launcher sets LOCAL_RANK; a pod's RANK (the node's number) is no launcher."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stopped:
        template.main([])
    assert stopped.value.code == (
        "train.py: start it with torchrun --standalone --nproc-per-node N train.py"
    )
    assert not torch.distributed.is_initialized()


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_plain_python_is_a_world_of_one(template, tmp_path, monkeypatch, one_rank, capsys):
    """``python train.py`` (no torchrun variables at all): one process trains, for a debugger."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # fmt: skip
        monkeypatch.setenv(name, "")  # recorded: teardown removes what main() sets
        monkeypatch.delenv(name)
    template.main([*TINY, "--num-samples", "32", "--batch-size", "16", "--epochs", "1",
                   "--checkpoint-dir", str(tmp_path)])  # fmt: skip
    assert "1 rank (" in capsys.readouterr().out and (tmp_path / "final.pt").is_file()


class FakeCIFAR10(torch.utils.data.Dataset):
    """torchvision's CIFAR10 as far as the template uses it; its "download" writes a marker.

    No internet here. Without a download and without the marker it raises what
    torchvision raises for a folder that holds no copy.
    """

    calls: list[tuple[str, bool, bool]] = []

    def __init__(self, root, train, download, transform):
        from pathlib import Path

        from PIL import Image

        FakeCIFAR10.calls.append((str(root), train, download))
        marker = Path(root) / "cifar-10-batches-py"
        if download:
            marker.mkdir(parents=True, exist_ok=True)
        elif not marker.is_dir():
            raise RuntimeError("Dataset not found or corrupted. You can use download=True")
        pixels = torch.randint(0, 256, (32, 32, 32, 3), dtype=torch.uint8)
        self.images = [Image.fromarray(p.numpy()) for p in pixels]
        self.targets, self.transform = [i % 10 for i in range(32)], transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.targets[i]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_download_with_one_rank_then_train_from_the_copy(template, tmp_path, monkeypatch,
                                                          one_rank, capsys):  # fmt: skip
    """--download on one rank fetches CIFAR-10; the next run reads that copy."""
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    monkeypatch.setattr(FakeCIFAR10, "calls", [])
    data = tmp_path / "data"
    cifar = ["--data", "cifar10", "--data-dir", str(data), "--image-size", "16", "--batch-size",
             "8", "--max-steps", "1", "--no-progress"]  # fmt: skip
    code, err = run_main(template, monkeypatch, capsys, *cifar)
    assert code == 2 and "Add --download to fetch it" in err, "no copy yet"
    template.main([*cifar, "--download", "--checkpoint-dir", str(tmp_path / "a")])
    template.main([*cifar, "--checkpoint-dir", str(tmp_path / "b")])
    assert FakeCIFAR10.calls == [(str(data), True, False)] + [
        (str(data), split, download) for download in (True, False) for split in (True, False)
    ]
    build_model("cnn", 10, 16).load_state_dict(
        torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    )


def read_history(checkpoint_dir):
    from ddp_tutorial.snapshots import latest_snapshot

    return torch.load(latest_snapshot(checkpoint_dir), weights_only=True)["extra"]["history"]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_tensorboard_scalars_from_rank_0(template, tmp_path, one_rank, capsys):
    """--tensorboard writes, every --log-every steps, the numbers the log line prints, and the
    validation accuracy the snapshot's history holds (tensorboard is in the dev extras)."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    template.main([*TINY, "--num-samples", "64", "--batch-size", "16", "--epochs", "1",
                   "--log-every", "2", "--tensorboard", str(tmp_path / "tb"),
                   "--checkpoint-dir", str(tmp_path / "ckpt")])  # fmt: skip
    printed = {
        int(m["step"]): {
            "loss": float(m["loss"]),
            "lr": float(m["lr"]),
            "grad_norm": float(m["norm"]),
        }  # fmt: skip
        for m in re.finditer(
            r"step (?P<step>\d+): loss (?P<loss>\S+), lr (?P<lr>\S+), "
            r"grad norm (?P<norm>[^,]+),",
            capsys.readouterr().out,
        )  # fmt: skip
    }
    assert sorted(printed) == [2, 4], "64 samples / 16: 4 steps, logged every 2"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    # the log line prints loss to 4 decimals, lr to 4 and grad norm to 3 significant digits
    for key, within in {
        "loss": {"abs": 5e-5},
        "lr": {"rel": 5e-4},
        "grad_norm": {"rel": 5e-3},
    }.items():
        written = {e.step: e.value for e in events.Scalars(f"train/{key}")}
        assert sorted(written) == [2, 4], key
        for step, value in written.items():
            assert value == pytest.approx(printed[step][key], **within), (key, step)
    assert all(e.value > 0 for e in events.Scalars("train/samples_per_sec"))
    history = read_history(tmp_path / "ckpt")
    accuracy = {e.step: e.value for e in events.Scalars("val/accuracy")}
    assert accuracy == {h["step"]: pytest.approx(h["val_accuracy"]) for h in history} != {}


def test_tensorboard_without_the_package_is_refused_before_training(template, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    args = template.parse_args(["--tensorboard", "tb"])
    assert "pip install tensorboard" in template.check_run(args, 2, None)


def test_out_without_the_course_package_is_refused_before_training(template, monkeypatch):
    """--out is the course's hook: a copy in a project without the package is told so."""
    import importlib.util

    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "ddp_tutorial" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    args = template.parse_args(["--out", "records"])
    assert "leave --out out in your own project" in template.check_run(args, 2, None)


def test_a_file_for_tensorboard_or_an_unknown_compile_backend_is_refused_before_training(
    template, tmp_path
):
    """Helper 107: --tensorboard naming a file failed in the writer (33 lines ending in
    FileExistsError), --compile bogus at the first step, after the data and the model."""
    (tmp_path / "a-file").write_text("not a folder")
    args = template.parse_args(["--tensorboard", str(tmp_path / "a-file")])
    assert "--tensorboard" in (template.check_run(args, 1, None) or ""), "a file is no folder"
    args = template.parse_args(["--compile", "bogus"])
    problem = template.check_run(args, 1, None) or ""
    assert "--compile bogus" in problem and "inductor" in problem, problem
    assert template.check_run(template.parse_args(["--compile"]), 1, None) is None


def test_download_is_refused_on_several_ranks(template):
    """--download with several ranks: refused before any rank builds (downloads) the data."""
    args = template.parse_args(["--data", "cifar10", "--data-dir", "d", "--download"])
    problem = template.check_run(args, 2, None)  # None: before the data exist
    assert "--download with 2 ranks" in problem and "--nproc-per-node 1" in problem
    assert template.check_run(args, 1, None) is None, "one process may download"


def test_each_group_keeps_its_multiple_of_the_schedule(template):
    """The schedule scales each param group's own LR (not one value for all groups)."""
    head, body = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    peak = 0.1
    opt = torch.optim.SGD([{"params": body.parameters()},
                           {"params": head.parameters(), "lr": 10 * peak}], lr=peak)  # fmt: skip
    for lr in (0.05, 0.02):
        template.kit.set_lr(opt, lr, peak)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr, 10 * lr])
    restored = torch.optim.SGD([{"params": body.parameters()}, {"params": head.parameters()}])
    restored.load_state_dict(opt.state_dict())  # a resume, here on twice the ranks: peak x 2
    template.kit.set_lr(restored, 0.04, 2 * peak)
    assert [g["lr"] for g in restored.param_groups] == pytest.approx([0.04, 0.4])


def test_adamw_without_decay_on_biases_and_norms_and_sgd_selectable(template):
    """AdamW without decay on biases and norms, fused (GradScaler.step needs no host sync)."""
    build_optimizer = template.kit.build_optimizer
    model = build_model("cnn", 10, 16)
    opt = build_optimizer("adamw", model, 1e-3, 0.05)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.999)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * 2 + 1, "2 BatchNorms (weight, bias), the head's bias"
    assert opt._step_supports_amp_scaling, "fused: the scaler skips inf/nan on the device"
    assert isinstance(build_optimizer("sgd", model, 0.1, 0), torch.optim.SGD)
    args = template.parse_args([])
    assert (args.optimizer, args.clip_grad, args.lr) == ("adamw", 1.0, 3e-3)
    assert template.parse_args(["--optimizer", "sgd"]).lr == 0.2


def test_help_says_what_a_resume_loses_with_powersgd(template, capsys):
    """PowerSGD's error feedback is not in the snapshot; --help says so."""
    with pytest.raises(SystemExit):
        template.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "powersgd: a resume restarts its error feedback" in help_text


class NoisyImages(SyntheticImages):
    """Augmentation drawn in the worker, like a random crop."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x + torch.rand(()), y


def test_workers_take_each_epochs_seed_so_an_epoch_boundary_resume_is_exact(template):
    """Persistent workers draw their seeds once: the loader's generator is reseeded per epoch.
    (The dataset is a module-level class: the template's workers receive it pickled.)"""
    data = NoisyImages(64, 8, 4)
    args = template.parse_args(["--batch-size", "4", "--num-workers", "2"])

    def epoch_batches(sampler, loader, epoch):
        sampler.set_epoch(epoch)
        loader.generator.manual_seed(rank_seed(args.seed, 0, epoch, 1))  # as the template's loop
        return [x for x, _ in loader]

    sampler, loader = template.data_loader(args, data, 0, 2, cuda=False)
    epoch_batches(sampler, loader, 0)
    straight = epoch_batches(sampler, loader, 1)
    sampler, loader = template.data_loader(args, data, 0, 2, cuda=False)  # a resume at epoch 1
    resumed = epoch_batches(sampler, loader, 1)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_the_evaluation_loader_takes_workers_and_pinned_memory():
    """Exact evaluation with DataLoader workers (and pin_memory on GPUs)."""
    from ddp_tutorial.data import GaussianBlobs, distributed_evaluate

    torch.manual_seed(0)
    model, data = torch.nn.Linear(16, 4), GaussianBlobs(50)
    plain = distributed_evaluate(model, data, batch_size=8)
    workers = distributed_evaluate(model, data, batch_size=8, num_workers=1, pin_memory=False)
    assert (workers.correct, workers.count) == (plain.correct, plain.count) and plain.count == 50


def test_without_out_the_recorder_keeps_nothing_per_step():
    """The recorder without --out: no per-step clock readings, no sample indices, unless asked."""
    from types import SimpleNamespace

    from ddp_tutorial.recorder import Recorder

    flags = {"out": None, "record_steps": False, "record_indices": False, "fail_at_step": None,
             "fail_rank": 1}  # fmt: skip
    rec = Recorder(SimpleNamespace(**flags), 0, 1, torch.device("cpu"))
    loss = torch.zeros(())
    for step in range(1, 1001):
        rec.step(step, loss)
        if step % 250 == 0:
            rec.evaluated(0, step, torch.nn.Linear(1, 1), 0.0)
            rec.epoch_done(0, range(10**6), 10**6)
    assert rec.intervals == [] and rec.indices == {} and rec.evaluations == []
    # timed: steps 6-250 (after 5 warm-up steps), then 252-500, ... (each pause's next step not)
    assert [n for *_, n in rec.spans] == [245, 249, 249, 249]


@pytest.mark.gpu
def test_train_on_gpus_with_nccl_amp_and_sync_bn(tmp_path):
    from conftest import gpu_count
    from ddp_tutorial.devices import visible_gpus
    from ddp_tutorial.numerics import amp_for_capability

    n = gpu_count()
    run = tmp_path / "gpu"
    # bf16 where the GPUs compute it (A100, H100), fp16 on a T4 or V100: the same rule as
    # the doctor's advice; a bare --amp (bf16) is rightly refused below capability 8.0.
    amp = amp_for_capability(min(g.capability or (0, 0) for g in visible_gpus()))
    result = torchrun(
        SCRIPTS / "train.py",
        *SMALL,
        "--epochs",
        "2",
        "--amp",
        amp,
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


@pytest.mark.parametrize("flag", ["--timeout", "--init-timeout"])
def test_a_timeout_of_zero_is_refused_by_its_own_name(template, capsys, flag):
    with pytest.raises(SystemExit):
        template.parse_args([flag, "0"])
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage lines
    other = ({"--timeout", "--init-timeout"} - {flag}).pop()
    assert f"{flag} must be at least 1" in error and other not in error, error


def test_make_deterministic_sets_every_switch(monkeypatch):
    from ddp_tutorial.numerics import make_deterministic

    # set, then removed: monkeypatch now removes what make_deterministic sets, at teardown
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
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
