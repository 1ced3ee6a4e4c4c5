"""The template's promises, each with a test that fails when the promise breaks.

A world of one runs the template's own ``main()`` in this process (no launch): a
divergence before the first evaluation, a rerun of a finished job, a resume with dropout,
a timed save on a controllable clock, a file that would run code, the atomic save's
fsync order. What needs real processes and real signals is tests/test_template_copy.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import zipfile
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import REPO, load_script
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.lessons.speed import script_module

TINY = ["--model", "mlp", "--image-size", "8", "--num-val", "16", "--no-progress",
        "--backend", "gloo"]  # fmt: skip
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@pytest.fixture(scope="module")
def template():
    return load_script("train.py")


@pytest.fixture
def kit(template):
    return template.kit


@pytest.fixture
def one_rank(monkeypatch, kit):
    """torchrun's environment for one rank; the signal handlers and cuDNN flag put back.

    The ranks' agreements come every 10 steps (and batches), as on an idle host: a test
    that signals at a step then knows the step that is saved. The seconds rule (sooner
    when steps are slow) counted this host's load: on a busy CI host step 1 took over
    0.5 s and the agreement came at step 10 where the test expected 11. Its own tests
    call ``next_agreement`` with the seconds they choose."""
    monkeypatch.setattr(kit, "next_agreement", lambda at, seconds, every, within_s: at + every)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = benchmark
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def snapshot_steps(kit, folder: Path) -> list[int]:
    return [step for step, _ in kit.list_snapshots(folder)]


def signal_at(kit, monkeypatch, at: int):
    """The scheduler's SIGTERM, raised in this process right after step ``at``; returns what
    puts the step back as it was (for the rerun)."""
    observe = kit.StopCheck.observe

    def observe_then_signal(self, step, loss):
        observe(self, step, loss)
        if step == at:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(kit.StopCheck, "observe", observe_then_signal)
    return partial(monkeypatch.setattr, kit.StopCheck, "observe", observe)


def stops_with(template, argv: list[str], capsys, error: str, says: str, error_file=None) -> str:
    """main() stops with exit 1 and one line naming ``error`` and saying ``says`` (an expected
    stop). Under torchrun (``error_file``: its TORCHELASTIC_ERROR_FILE) the traceback goes to
    that file, for torchrun's summary, not to the rank's output; with plain python, no
    summary: it is printed. Returns what the run printed before it stopped."""
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    out, err = capsys.readouterr()
    assert stopped.value.code == 1 and f"[rank0]: train.py: error: {error}: " in err, err[-3000:]
    assert says in err and ("Traceback" in err) == (error_file is None), err[-3000:]
    if error_file is not None:
        recorded = json.loads(error_file.read_text())["message"]
        assert recorded["message"].startswith(f"{error}: ") and says in recorded["message"]
        assert "Traceback" in recorded["extraInfo"]["py_callstack"], recorded
    return out


def test_a_divergence_before_the_first_evaluation_is_never_scored_or_kept(
    template, kit, tmp_path, one_rank, monkeypatch, capsys
):
    """lr 1e12 on 4 steps an epoch: the periodic check (every 10 steps) never runs before the
    epoch's evaluation. The evaluation checks first: no best.pt of non-finite weights; then
    failed.json makes a restart stop at once instead of replaying the divergence; and the
    TensorBoard scalars logged so far reach the disk on this exit path too."""
    import torch.utils.tensorboard as tb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opened = []

    class Writer(tb.SummaryWriter):  # the template's writer, kept to see whether it was closed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(tb, "SummaryWriter", Writer)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "16", "--epochs", "1", "--lr", "1e12",
            "--warmup", "0", "--log-every", "1", "--clip-grad", "0", "--checkpoint-dir",
            str(tmp_path / "c"), "--tensorboard", str(tmp_path / "tb")]  # fmt: skip
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # torchrun's
    stops_with(template, argv, capsys, "DivergedError", "stopped being finite at step",
               error_file=tmp_path / "error.json")  # fmt: skip
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "c" / "best.pt").exists(), "a diverged model was scored and kept"
    assert not snapshot_steps(kit, tmp_path / "c")
    failed = json.loads((tmp_path / "c" / "failed.json").read_text())
    assert "stopped being finite" in failed["error"] and failed["stopped_at_step"] > 0
    # closed (its buffer written out) on this exit path: the scalars reading back below would
    # pass without it, since a writer left open in this process still flushes on its own
    assert len(opened) == 1 and opened[0].file_writer is None, "the writer was left open"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("train/loss", "train/lr", "train/samples_per_sec"):  # 12 events: > 1 queue
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4], f"{tag}: what was logged"
    with pytest.raises(SystemExit) as stopped:  # the restart torchrun would make
        template.main(argv)
    assert stopped.value.code == 2, "a restart stops at once, before training anything"


@pytest.mark.parametrize(("step_s", "acted_at"), [(0.01, 11), (4.0, 3)], ids=["fast", "4 s"])
def test_a_signal_is_acted_on_within_seconds_however_slow_the_steps(kit, step_s, acted_at):
    """A SIGTERM after step 2: fast steps agree at step 1, then every 10 steps (step 11); steps
    of 4 s agree at every step, so the save starts 4 s after the signal, not 40 s (torchrun's
    grace is 30 s: with a check every 10 steps, such a job was killed with nothing saved)."""
    now = [0.0]
    checks = kit.StopCheck(torch.device("cpu"), clock=lambda: now[0])
    try:
        for step in range(1, 30):
            now[0] += step_s
            if step == 3:
                checks._handle(signal.SIGTERM, None)  # the signal, between steps 2 and 3
            if checks.check(step).stop:
                break
        assert step == acted_at, f"acted on at step {step}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_the_loss_check_alone_stops_a_divergence(kit):
    """No weights given (the weight check off): a non-finite loss seen at step 3 stops the
    run at the next agreement, naming step 3."""
    checks = kit.StopCheck(torch.device("cpu"))
    try:
        for step, loss in ((1, 2.0), (2, 1.5), (3, float("nan")), (4, 1.0)):
            checks.observe(step, torch.tensor(loss))
        with pytest.raises(kit.DivergedError, match="at step 3"):
            checks.check(10)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_the_weight_check_alone_stops_a_divergence(kit):
    """Finite losses, one weight gone inf: the forced check before a save or an evaluation
    names this step (a generator of parameters, as ``ddp.parameters()`` gives)."""
    checks = kit.StopCheck(torch.device("cpu"))
    weights = [torch.ones(3), torch.tensor([1.0, math.inf])]
    try:
        checks.observe(1, torch.tensor(0.5))
        assert not checks.check(1, True, (w for w in weights[:1])).stop  # finite: trains on
        with pytest.raises(kit.DivergedError, match="at step 2"):
            checks.check(2, True, (w for w in weights))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_the_forced_check_sees_a_batchnorm_statistic_gone_inf(template, kit):
    """Helper 150: one outlier sample made running_var inf with the loss finite, and every
    saved file held it. The template checks its model's buffers with its weights."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    checks = kit.StopCheck(torch.device("cpu"))
    try:
        assert not checks.check(1, True, template.weights(model)).stop
        model.register_buffer("mask", torch.full((3,), -math.inf))  # rightly not finite
        assert not checks.check(2, True, template.weights(model)).stop
        model[1].running_var[0] = math.inf
        with pytest.raises(kit.DivergedError, match="the buffers stopped being finite at step 3"):
            checks.check(3, True, template.weights(model))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_rerun_of_a_finished_max_steps_job_trains_nothing(template, kit, tmp_path, one_rank,
                                                            capsys):  # fmt: skip
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--max-steps", "3", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main(argv)
    final = (tmp_path / "final.pt").read_bytes()
    written = (tmp_path / "final.pt").stat()
    capsys.readouterr()
    template.main(argv)
    assert "nothing left to train" in capsys.readouterr().out
    assert snapshot_steps(kit, tmp_path) == [3], "no step 4"
    assert (tmp_path / "final.pt").read_bytes() == final, "final.pt left as it was"
    now = (tmp_path / "final.pt").stat()  # the same bytes saved again: a new file renamed in
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns), "not rewritten"
    # helper 150: a final.pt that is not this model (an older run's, left by a rerun stopped
    # before it wrote its own; or cut short) is written again, not reported as saved
    model = torch.load(tmp_path / "final.pt", weights_only=True)
    for older in ({k: v + 1 if v.is_floating_point() else v for k, v in model.items()}, None):
        if older is None:
            (tmp_path / "final.pt").write_bytes(final[: len(final) // 2])
        else:
            torch.save(older, tmp_path / "final.pt")
        template.main(argv)
        assert (tmp_path / "final.pt").read_bytes() == final, "final.pt is the run's model again"


def test_a_resume_refuses_another_optimizer_and_takes_a_new_weight_decay(
    template, kit, tmp_path, one_rank, capsys
):
    """A practitioner's review: --optimizer sgd on an AdamW snapshot crashed inside torch
    (KeyError: 'momentum'), and --weight-decay 0.5 was silently the snapshot's 0.05. Now the
    first is refused naming the file and what to do (no failed.json: the flag is the fix), the
    second warned and applied (the next snapshot's optimizer holds it); and a snapshot of
    another model names its file."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--save-every", "2", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "2"])
    refused = "holds adamw's state, which sgd cannot continue: resume with --optimizer adamw"
    stops_with(template, [*argv, "--optimizer", "sgd"], capsys, "CheckpointError", refused)
    assert not (tmp_path / "failed.json").exists()
    template.main([*argv, "--max-steps", "4", "--weight-decay", "0.5"])
    assert "WARNING: resumed with --weight-decay 0.05 -> 0.5: it applies from step 2" in (
        capsys.readouterr().out
    )
    state = torch.load(kit.snapshot_path(tmp_path, 4), weights_only=True)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.5, 0.0]
    stops_with(template, [*argv, "--model", "cnn"], capsys, "CheckpointError",
               f"{kit.snapshot_path(tmp_path, 4)}: the given state does not fit")  # fmt: skip


def test_weights_gone_non_finite_under_a_finite_loss_are_never_scored(
    template, kit, tmp_path, one_rank, monkeypatch, capsys
):
    """A weight turned inf by the epoch's last step (4), whose loss was computed before it: no
    loss check can see it, and the periodic check comes at steps 1 and 11. The evaluation's
    own check reads the weights, so the model is never scored nor kept as best.pt (helper 165:
    with that check reading the loss alone, the suite passed; this test then finds best.pt)."""
    real, steps = kit.build_optimizer, []

    def poisoned(*args, **kwargs):
        optimizer = real(*args, **kwargs)
        step = optimizer.step

        def stepped(*a, **k):
            done = step(*a, **k)
            steps.append(1)
            if len(steps) == 4:  # after the step: that step's loss was finite
                with torch.no_grad():
                    optimizer.param_groups[0]["params"][0].fill_(math.inf)
            return done

        optimizer.step = stepped
        return optimizer

    monkeypatch.setattr(kit, "build_optimizer", poisoned)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path)]  # 4 steps, then the evaluation  # fmt: skip
    stops_with(template, argv, capsys, "DivergedError", "stopped being finite at step 4")
    assert len(steps) == 4, "the weights went inf after the epoch's last step"
    assert not (tmp_path / "best.pt").exists(), "a model with an inf weight was scored and kept"
    assert not snapshot_steps(kit, tmp_path)


def test_a_timed_save_on_a_controllable_clock_and_none_without_a_folder(
    template, kit, tmp_path, one_rank, monkeypatch
):
    """--save-minutes 1 on a clock that moves 4 s with every step: the ranks agree at step 1,
    then every 10 steps (within_s makes these steps count as fast), at 4, 44, 84, 124 s. The
    save is due at 84 s (step 21); the timer restarts there, so 124 s is only 40 s later: no
    save at step 31 (a mutation review: with a clock that jumped 61 s at every reading, a
    timer that never restarted saved at every check and passed). Then the epoch's end, 32.
    Without --checkpoint-dir nothing could be saved: no timed save at all. The clock starts far
    from 0, as time.monotonic() does (helper 165: a timer started at 0, not at the clock's
    reading, saved at step 1 of every real run and passed on a clock that started at 0)."""
    made, now = [], [10_000.0]

    class Clocked(kit.StopCheck):
        def __init__(self, device, every=10, save_minutes=0.0, clock=None, within_s=0.0):
            super().__init__(device, every, save_minutes, lambda: now[0], within_s=1e9)
            made.append(self)

        def observe(self, step, loss):
            now[0] += 4.0  # each step takes 4 s
            super().observe(step, loss)

    monkeypatch.setattr(kit, "StopCheck", Clocked)
    base = [*TINY, "--num-samples", "256", "--batch-size", "8", "--epochs", "1",
            "--save-minutes", "1", "--keep", "9"]  # 32 steps  # fmt: skip
    template.main([*base, "--checkpoint-dir", str(tmp_path)])
    assert snapshot_steps(kit, tmp_path) == [21, 32], "timed at 84 s, then 60 s later; the epoch"
    template.main(base)
    assert made[-1].save_s == 0, "no folder: the timed save is off"


def test_a_save_due_at_an_epochs_end_writes_its_snapshot_once(template, kit, tmp_path, one_rank,
                                                                monkeypatch):  # fmt: skip
    """Helper 107: --save-every dividing the epoch (and --max-steps ending on a save) wrote the
    same snapshot twice: in the loop, then again at the epoch's end."""
    written = []
    real = kit.atomic_save
    monkeypatch.setattr(kit, "atomic_save",
                        lambda obj, path, *a, **k: written.append(Path(path).name)
                        or real(obj, path, *a, **k))  # fmt: skip
    argv = [
        *TINY,
        "--num-samples",
        "64",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--keep",
        "3",
        "--save-every",
        "4",
        "--checkpoint-dir",
        str(tmp_path),
    ]  # 8 steps an epoch
    template.main(argv)
    snapshots = [n for n in written if n.startswith("snapshot-")]
    assert len(snapshots) == len(set(snapshots)) == 4, snapshots  # 4, 8, 12, 16
    # --keep 3: the three newest (helper 170: keep + 1 passed while every test kept 9)
    assert snapshot_steps(kit, tmp_path) == [8, 12, 16]
    second = torch.load(kit.snapshot_path(tmp_path, 8), weights_only=True)
    assert (second["epoch"], second["extra"]["consumed"]) == (1, 0), "the epoch-end form"


def test_a_resume_on_other_data_says_so_and_starts_a_changed_epoch_over(
    template, tmp_path, one_rank, capsys
):
    """Helper 107: a resume with another --seed or --num-samples (or images added to the
    folder) said nothing, and the epoch's position pointed at other samples (256 reads, 219
    distinct). Now it warns, and an epoch whose training set changed size starts over."""
    argv = [*TINY, "--batch-size", "8", "--epochs", "1", "--checkpoint-dir", str(tmp_path)]
    template.main([*argv, "--num-samples", "64", "--max-steps", "3"])  # 8 steps an epoch
    capsys.readouterr()
    template.main([*argv, "--num-samples", "72"])  # 9 steps an epoch
    out = capsys.readouterr().out
    assert "WARNING: resumed with --num-samples 64 -> 72: other samples" in out, out
    assert "64 training samples then, 72 now: epoch 0's position" in out, out
    assert "done: 12 steps" in out, "3 before, then all 9 of the changed epoch"


def test_a_resume_on_another_validation_set_lets_the_next_evaluation_replace_best(
    template, tmp_path, one_rank, capsys
):
    """Helper 113: after --num-val changed on a resume, best.pt's score (the old set's) was
    compared with the new set's without a word; an explicit --data synthetic (the default)
    warned of other samples. Now the validation flags warn and reset best; the default does not."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--eval-every", "2", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "4"])
    best = json.loads((tmp_path / "best.json").read_text())
    capsys.readouterr()
    template.main([*argv, "--data", "synthetic", "--max-steps", "5"])
    assert "WARNING" not in capsys.readouterr().out  # the same data, said explicitly
    template.main([*argv, "--num-val", "40", "--max-steps", "6"])
    out = capsys.readouterr().out
    assert "WARNING: resumed with --num-val 16 -> 40: another validation set" in out, out
    now = json.loads((tmp_path / "best.json").read_text())
    assert now["step"] == 6 and best["step"] <= 4, (best, now)  # replaced by the new set's


def test_a_mid_epoch_resume_with_workers_says_what_is_not_exact(template, tmp_path, one_rank,
                                                                capsys):  # fmt: skip
    """Helper 107: the docstrings promise an exact resume, and with workers a mid-epoch one
    is exact in its samples only (lesson 08 measures it): the run now says so."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--num-workers", "1", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "3"])
    capsys.readouterr()
    template.main(argv)
    assert "WARNING: a mid-epoch resume with --num-workers > 0" in capsys.readouterr().out


def test_a_second_job_on_the_same_folder_is_refused_and_touches_nothing(
    template, kit, tmp_path, one_rank, capsys
):
    """Helper 107: a job started on a folder another job used deleted that job's save in
    progress (its temporary file), then pruned its snapshots. Rank 0 now locks the folder."""
    argv = [*TINY, "--num-samples", "32", "--batch-size", "8", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    other = kit.hold_folder(tmp_path)  # the other job, alive
    saving = tmp_path / ".snapshot-000000040.pt.424242.deadbeef.tmp"
    saving.write_bytes(b"the other job's save in progress")
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "is in use by another job (host " in err, err[-2000:]
    assert saving.exists() and not (tmp_path / template.FAILED).exists()
    other.close()  # that job ended: this one runs, and a rerun after it too
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()  # helper 108: IsADirectoryError; now unguarded, and it runs
    template.main(argv)
    (tmp_path / ".lock").rmdir()
    template.main(argv)
    template.main(argv)
    assert (tmp_path / "final.pt").is_file() and not saving.exists(), "its temp: stale now"


def test_a_resume_says_that_pretrain_weights_are_not_what_it_continues(
    template, tmp_path, one_rank, capsys
):
    """Helper 107: --pretrain was silently replaced by the snapshot's weights on a resume."""
    argv = [*TINY, "--num-samples", "32", "--batch-size", "8", "--checkpoint-dir", str(tmp_path)]
    template.main([*argv, "--max-steps", "2"])
    weights = tmp_path / "pre.pt"
    weights.write_bytes((tmp_path / "final.pt").read_bytes())
    capsys.readouterr()
    template.main([*argv, "--pretrain", str(weights)])
    assert "NOTE: --pretrain " in capsys.readouterr().out


def test_bf16_on_a_gpu_without_it_is_one_line(template, kit, one_rank, monkeypatch, capsys):
    """Helper 107 (a V100 or T4, which this machine lacks: amp_dtype's refusal is simulated,
    its own rule is tested in tests/test_training.py): the ValueError came as a traceback."""

    def v100(device, amp, native_bf16=None):
        raise ValueError("--amp trains in bfloat16, which this GPU does not support natively")

    monkeypatch.setattr(kit, "amp_dtype", v100)
    with pytest.raises(SystemExit) as stopped:
        template.main([*TINY, "--num-samples", "32", "--batch-size", "8", "--amp"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "train.py: error: --amp trains in bfloat16" in err, err
    assert "Traceback" not in err


def test_nccl_asked_for_without_gpus_is_one_line(template, tmp_path, one_rank, capsys):
    """Helper 107: the message was clear, but it came as a BackendError traceback."""
    argv = [*TINY, "--num-samples", "32", "--batch-size", "8", "--backend", "nccl"]
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "train.py: error: " in err and "Traceback" not in err, err


def test_a_data_error_on_another_rank_than_0_stops_the_restarts(template, kit, tmp_path):
    """Helper 107: a file only rank 1's shard holds fails rank 1 alone (rank 0 sees a peer
    gone), and only rank 0 wrote failed.json: every restart met the file again."""
    template.stopped_for_good(kit.DataError("img/train/b/014.png cannot be decoded"), tmp_path,
                              rank=1, step=3)  # fmt: skip
    assert "014.png" in json.loads((tmp_path / template.FAILED).read_text())["error"]
    (tmp_path / template.FAILED).unlink()
    template.stopped_for_good(kit.DivergedError("loss nan"), tmp_path, rank=1, step=3)
    assert not (tmp_path / template.FAILED).exists(), "rank 0 says why the job diverged"


class Payload:
    """What a malicious checkpoint holds: unpickling it would run code (here: make a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("where", ["--pretrain", "a snapshot to resume"])
def test_a_file_that_would_run_code_is_refused_not_run(template, kit, tmp_path, one_rank, where,
                                                       capsys):  # fmt: skip
    marker, ckpt = tmp_path / "code-ran", tmp_path / "ckpt"
    ckpt.mkdir()
    evil = tmp_path / "evil.pt" if where == "--pretrain" else kit.snapshot_path(ckpt, 1)
    torch.save({"model": Payload(marker)}, evil)
    argv = [*TINY, "--num-samples", "32", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-dir", str(ckpt)]  # fmt: skip
    if where == "--pretrain":
        argv += ["--pretrain", str(evil)]
    stops_with(template, argv, capsys, "CheckpointError", "weights_only=True")
    assert not marker.exists(), "the file's code ran"


def test_an_exact_resume_of_a_model_with_dropout(template, kit, tmp_path, one_rank, monkeypatch):
    """Dropout draws from the global RNG at every step: a resume must put each rank's back."""
    real = kit.build_model

    def with_dropout(name, num_classes, image_size=32, in_channels=3):
        return torch.nn.Sequential(torch.nn.Dropout(0.5), real(name, num_classes, image_size))

    monkeypatch.setattr(kit, "build_model", with_dropout)
    argv = [*TINY, "--num-samples", "128", "--batch-size", "8", "--epochs", "2", "--warmup", "0"]
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "straight")])
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "cut"), "--max-steps", "11"])
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "cut")])
    a, b = (torch.load(tmp_path / n / "final.pt", weights_only=True) for n in ("straight", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a), "bitwise, dropout included"


def test_an_epoch_boundary_resume_with_workers_that_augment_is_exact(
    template, kit, tmp_path, one_rank, monkeypatch
):
    """Workers draw their augmentation from the seeds the loader's generator hands them at each
    epoch's start: the loop reseeds it per epoch, so a rerun starting at epoch 1 gives them
    the same seeds (helper 170: without that line every test passed - no test's workers drew)."""
    from test_training import NoisyImages  # a module's class: the workers receive it pickled

    real = kit.build_datasets

    def noisy(args, rank=0, world_size=1):
        train, val, classes = real(args, rank, world_size)
        return NoisyImages(len(train), args.image_size, classes), val, classes

    monkeypatch.setattr(kit, "build_datasets", noisy)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "2", "--warmup", "0",
            "--num-workers", "1"]  # fmt: skip
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "straight")])
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "cut"), "--max-steps", "8"])
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "cut")])  # from epoch 1's start
    a, b = (torch.load(tmp_path / n / "final.pt", weights_only=True) for n in ("straight", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a), "bitwise, the workers' draws included"


def test_the_wrapped_model_broadcasts_no_buffers_in_its_forward(template, tmp_path, one_rank,
                                                                  monkeypatch):  # fmt: skip
    """Each rank keeps its own BatchNorm statistics (averaged at saves and evaluations): no
    broadcast of rank 0's buffers before every forward, a collective per step (helper 170:
    broadcast_buffers = True passed every test, the ranks' statistics differing anyway)."""
    wrapped = []

    class Recorded(template.DDP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            wrapped.append(self)

    monkeypatch.setattr(template, "DDP", Recorded)
    template.main([*TINY, "--model", "cnn", "--num-samples", "16", "--batch-size", "8",
                   "--epochs", "1", "--checkpoint-dir", str(tmp_path)])  # fmt: skip
    [ddp] = wrapped
    assert not ddp.will_sync_module_buffers() and ddp.modules_buffers, "buffers, not broadcast"


@pytest.mark.parametrize("written_by", ["this template", "a template before --best-by"])
def test_best_json_keeps_a_better_best_pt_from_an_older_snapshot(template, kit, tmp_path,
                                                                one_rank, written_by,
                                                                capsys):  # fmt: skip
    """After a crash the newest snapshot can be older than best.pt: the score best.pt holds
    (best.json) is the bar, not the snapshot's. Files from before --best-by (no best_by, no
    score; a review of the change that added them) are an accuracy's, not another score's."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "16", "--checkpoint-dir", str(tmp_path)]
    template.main([*argv, "--epochs", "1"])
    best = (tmp_path / "best.pt").read_bytes()
    [(_, path)] = kit.list_snapshots(tmp_path)
    older = torch.load(path, weights_only=True)  # as a snapshot older than best.pt would be
    older["extra"]["best"] = -1.0
    held = {"step": 4, "best_by": "val_accuracy", "score": 1.5}  # better than any accuracy
    if written_by != "this template":
        del older["extra"]["config"]["best_by"]
        held = {"step": 4, "val_accuracy": 1.5}
    torch.save(older, path)
    (tmp_path / "best.json").write_text(json.dumps(held))
    capsys.readouterr()
    template.main([*argv, "--epochs", "2"])
    assert (tmp_path / "best.pt").read_bytes() == best, "overwritten by a worse model"
    assert "WARNING: --best-by" not in capsys.readouterr().out, "the same score, not another"


def test_best_by_val_loss_keeps_the_lowest_loss_for_a_regression(template, kit, tmp_path,
                                                                  one_rank, capsys):  # fmt: skip
    """A practitioner's review: with a regression's loss, every accuracy is 0 and best.pt stayed
    the first evaluation's model. --best-by val_loss keeps the lowest validation loss; a resume
    with the other choice says best.pt will be replaced, instead of comparing the two scores."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "16", "--eval-every", "2",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--epochs", "2", "--best-by", "val_loss"])
    [(_, path)] = kit.list_snapshots(tmp_path)[-1:]
    history = torch.load(path, weights_only=True)["extra"]["history"]
    lowest = min(history, key=lambda h: h["val_loss"])
    assert len({h["val_loss"] for h in history}) > 1, "the losses differ: the choice matters"
    held = json.loads((tmp_path / "best.json").read_text())
    assert (held["step"], held["score"]) == (lowest["step"], -lowest["val_loss"]), history
    capsys.readouterr()
    template.main([*argv, "--epochs", "3"])
    assert "WARNING: --best-by val_accuracy now: the next evaluation replaces" in (
        capsys.readouterr().out
    )
    assert json.loads((tmp_path / "best.json").read_text())["best_by"] == "val_accuracy"
    # and back: a loss's score (negative) never beats an accuracy's, so without the reset to
    # -inf best.pt would stay the accuracy's (helper 170: only this direction shows it)
    template.main([*argv, "--epochs", "4", "--best-by", "val_loss"])
    assert json.loads((tmp_path / "best.json").read_text())["best_by"] == "val_loss"


REGRESSION_DATA = """

def regression_data(args, shape=(1,), val=None):  # float targets, (n, 1) like the outputs
    g = torch.Generator().manual_seed(args.seed)
    size, val = args.image_size, args.num_val if val is None else val
    x = torch.randn(args.num_samples + val, 3, size, size, generator=g)
    y = x.flatten(1)[:, :4].sum(1).reshape(-1, *shape)
    data = torch.utils.data.TensorDataset
    n = args.num_samples
    return data(x[:n], y[:n]), data(x[n:], y[n:]), 1
"""


def adapted_copy(folder: Path, edits: dict[str, str], code: str, name: str):
    """The template and ddp_kit.py copied into ``folder`` as a practitioner adapts them: each
    edit replaces text the template holds once, ``code`` (theirs: data, a model) goes above
    ``if __name__``, where torchrun finds it too; imported beside ddp_kit.py like a copy."""
    scripts = Path(__file__).parents[1] / "scripts"
    text = (scripts / "train.py").read_text()
    for old, new in edits.items():
        assert text.count(old) == 1, f"the template no longer has {old!r}: update the test"
        text = text.replace(old, new)
    main = '\n\nif __name__ == "__main__":'
    (folder / "train.py").write_text(text.replace(main, code + main))
    (folder / "ddp_kit.py").write_bytes((scripts / "ddp_kit.py").read_bytes())
    return script_module(folder / "train.py", f"{name}_{folder.name}")


def regression_copy(folder: Path, data: str = "regression_data(args)"):
    """The template adapted to a regression: the two edits its docstring names (the loss, the
    data), nothing else."""
    edits = {"nn.CrossEntropyLoss()": "nn.MSELoss()",
             "kit.build_datasets(args, rank, world_size)": data}  # fmt: skip
    return adapted_copy(folder, edits, REGRESSION_DATA, "regression")


def test_a_regression_copy_is_scored_by_its_loss_and_refuses_accuracy(tmp_path, one_rank,
                                                                     capsys):  # fmt: skip
    """A practitioner's review: after the two edits, the default --best-by val_accuracy kept
    the first evaluation (every accuracy 0.0%, or above 100 % for whole-number targets: the
    argmax broadcast against a (B, 1) target), and best.json without the accuracy's key made
    every resume crash. Now the run is refused before training and names the flag; with
    --best-by val_loss, best.pt is the lowest loss, re-evaluated here, and accuracy is nan."""
    template, ckpt = regression_copy(tmp_path), tmp_path / "ckpt"
    argv = [*TINY, "--image-size", "4", "--num-samples", "68", "--num-val", "21",
            "--batch-size", "16", "--eval-every", "2", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        template.main([*argv, "--epochs", "2"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "use --best-by val_loss" in err, err[-2000:]
    assert not template.kit.list_snapshots(ckpt), "refused before training"
    template.main([*argv, "--epochs", "2", "--best-by", "val_loss"])
    out = capsys.readouterr().out
    assert "val loss" in out and "val accuracy" not in out, out
    history = torch.load(template.kit.latest_snapshot(ckpt), weights_only=True)["extra"]["history"]
    assert all(math.isnan(h["val_accuracy"]) for h in history), history
    lowest = min(history, key=lambda h: h["val_loss"])
    assert len({h["val_loss"] for h in history}) > 1, "the losses differ: the choice matters"
    held = json.loads((ckpt / "best.json").read_text())
    assert (held["step"], held["score"]) == (lowest["step"], -lowest["val_loss"]), history
    model = template.kit.build_model("mlp", 1, 4)
    model.load_state_dict(torch.load(ckpt / "best.pt", weights_only=True))
    val_set = template.regression_data(template.parse_args(argv))[1]
    again = template.kit.distributed_evaluate(model, val_set, 8, loss_fn=torch.nn.MSELoss())
    assert again.count == 21 and again.loss == pytest.approx(lowest["val_loss"], rel=1e-5)
    assert "val_accuracy" not in held, "nan: strict JSON parsers refuse it"
    (ckpt / "best.json").write_text(json.dumps({"best_by": "val_loss", "score": held["score"]}))
    template.main([*argv, "--epochs", "3", "--best-by", "val_loss"])  # no key but the score
    assert "done: " in capsys.readouterr().out


def test_an_accuracy_that_cannot_be_counted_stops_the_run_that_would_keep_best_pt_by_it(
    tmp_path, one_rank, capsys
):
    """No validation samples leave every accuracy nan, and best.pt would never be written:
    the first evaluation said so and named the flag, after an epoch with nothing saved
    (helper 107); now the start stops, before training."""
    template = regression_copy(tmp_path, "regression_data(args, val=0)")
    argv = [*TINY, "--image-size", "4", "--num-samples", "32", "--batch-size", "16",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    assert stopped.value.code == 2 and "the validation set is empty" in capsys.readouterr().err
    assert not list((tmp_path / "ckpt").iterdir()), "stopped before anything was written"


def test_accuracy_is_counted_for_class_indices_only(kit):
    """An argmax compared with a regression's targets broadcasts: (B, 1) whole numbers gave a
    review 80 % "accuracy". Only integer targets one dimension below the scores count; a
    model that squeezes its (1, 1) output to () against a (1,) target is no mistake."""
    cpu, x = torch.device("cpu"), torch.randn(10, 4)
    y = torch.randint(0, 3, (10,))
    classify = torch.nn.Linear(4, 3)
    right = (classify(x).argmax(1) == y).sum().item()
    assert kit.local_sums(classify, [(x, y)], cpu)[0].item() == right
    as_counts = kit.local_sums(
        torch.nn.Linear(4, 1), [(x, y[:, None])], cpu, loss_fn=lambda o, t: (o - t).pow(2).mean()
    )
    assert math.isnan(as_counts[0].item()) and as_counts[1].item() == 10

    class Squeezed(torch.nn.Module):
        def forward(self, inputs):
            return inputs.sum(1).squeeze()

    with pytest.warns(UserWarning, match="target size"):  # torch's, and right: 1 element
        last = kit.local_sums(
            Squeezed(), [(x[:1], y[:1].float())], cpu, loss_fn=torch.nn.functional.mse_loss
        )
    assert math.isnan(last[0].item()) and last[1].item() == 1


def test_a_regression_whose_targets_do_not_match_the_outputs_stops_before_training(
    tmp_path, one_rank, capsys
):
    """Targets of shape (B,) against outputs (B, 1): MSE broadcasts them to B x B pairs with a
    warning only, and the loss means nothing. The evaluation named both shapes, but after an
    epoch of that training (helper 67); two samples scored before training name them now."""
    template = regression_copy(tmp_path, "regression_data(args, shape=())")
    argv = [*TINY, "--image-size", "4", "--num-samples", "32", "--batch-size", "16",
            "--log-every", "1", "--best-by", "val_loss",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    out = stops_with(template, argv, capsys, "DataError", "outputs (2, 1) and the targets (2,)")
    assert "step 1:" not in out and not template.kit.list_snapshots(tmp_path / "ckpt"), out


DICT_OUTPUT = """

class Named(torch.nn.Module):  # a model that returns a dict, as many libraries' models do
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        logits = self.body(x)
        return {"logits": logits, "aux": logits.pow(2).mean()}


class NamedLoss(torch.nn.Module):  # the whole output in, a mean over the batch out
    def forward(self, out, y):
        return torch.nn.functional.cross_entropy(out["logits"], y) + 0.01 * out["aux"]
"""


def test_a_model_that_returns_a_dict_is_scored_by_prediction_or_refused_before_training(
    tmp_path, one_rank, capsys
):
    """Helper 67's review: a model returning {"logits": ..., "aux": ...} trained a whole epoch,
    then crashed in the evaluation ('dict' object has no attribute 'dim'), nothing saved. Two
    samples are scored before training: without PREDICTION the run stops before its first
    step and names it; with it, the evaluation scores the logits, and its loss is training's,
    of the whole output."""
    edits = {
        "kit.build_model(args.model, num_classes, args.image_size)":
            "Named(kit.build_model(args.model, num_classes, args.image_size))",
        "nn.CrossEntropyLoss()": "NamedLoss()",
    }  # fmt: skip
    argv = [*TINY, "--num-samples", "64", "--batch-size", "16", "--epochs", "1",
            "--log-every", "1"]  # fmt: skip
    (tmp_path / "plain").mkdir()
    refused = adapted_copy(tmp_path / "plain", edits, DICT_OUTPUT, "dict")
    out = stops_with(
        refused, argv, capsys, "DataError", "a dict, not a tensor of scores: set PREDI"
    )
    assert "step 1:" not in out, f"stopped before training, not after an epoch: {out}"
    edits["\nPREDICTION = None\n"] = "\nPREDICTION = lambda out: out['logits']  # noqa: E731\n"
    (tmp_path / "declared").mkdir()
    template, ckpt = adapted_copy(tmp_path / "declared", edits, DICT_OUTPUT, "dict"), tmp_path / "c"
    template.main([*argv, "--checkpoint-dir", str(ckpt)])
    assert "done: 4 steps" in capsys.readouterr().out
    [scored] = torch.load(template.kit.latest_snapshot(ckpt), weights_only=True)["extra"]["history"]
    model = template.Named(template.kit.build_model("mlp", 10, 8))
    model.load_state_dict(torch.load(ckpt / "final.pt", weights_only=True))
    val_set = template.kit.build_datasets(template.parse_args(argv), 0, 1)[1]
    x, y = torch.utils.data.default_collate(list(val_set))
    with torch.no_grad():
        out = model.eval()(x)
    assert scored["val_loss"] == pytest.approx(template.NamedLoss()(out, y).item(), rel=1e-5)
    assert scored["val_accuracy"] == (out["logits"].argmax(1) == y).float().mean().item()


SEQUENCE_DATA = """

class Tokens(torch.utils.data.Dataset):  # sentences of 2 to 6 tokens, a tag per token
    def __init__(self, count, seed, untagged=()):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 7, (count,), generator=g).tolist()
        self.items = [torch.randint(1, 10, (n,), generator=g) for n in lengths]
        self.untagged = set(untagged)  # sentences whose every tag is -100

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        tags = self.items[i] % 3
        return self.items[i], tags.fill_(-100) if i in self.untagged else tags


def pad_batch(batch):  # ((tokens, lengths), tags): padding is token 0 and target -100
    tokens, tags = zip(*batch)
    pad = torch.nn.utils.rnn.pad_sequence
    lengths = torch.tensor([len(t) for t in tokens])
    return (pad(tokens, batch_first=True), lengths), pad(tags, True, padding_value=-100)


class Tagger(torch.nn.Module):
    def __init__(self, last=False):
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(10, 16), torch.nn.Linear(16, 3)
        self.last = last

    def forward(self, inputs):
        tokens, lengths = inputs
        assert tokens.shape[0] == lengths.shape[0]
        scores = self.out(self.embed(tokens))  # (B, T, classes), as a language model's
        return scores if self.last else scores.transpose(1, 2)  # or (B, classes, T)


class FlatCrossEntropy(torch.nn.CrossEntropyLoss):  # for (B, T, classes): both flattened
    def forward(self, scores, targets):
        return super().forward(scores.flatten(0, 1), targets.flatten())


def sequence_data(args, untagged=()):
    return Tokens(args.num_samples, args.seed, untagged), Tokens(args.num_val, args.seed + 1), 3


COLLATE = pad_batch
"""


def sequence_copy(folder: Path, data: str = "sequence_data(args)", loss: str = "",
                  last: bool = False):  # fmt: skip
    """The template adapted to a tagger over sentences of different lengths, as its docstring
    says: COLLATE, the data, the model (and ``loss``, CrossEntropyLoss's arguments; ``last``:
    scores (B, T, classes), flattened by the loss, and CLASS_DIM -1); nothing else edited."""
    edits = {
        "kit.build_datasets(args, rank, world_size)": data,
        "kit.build_model(args.model, num_classes, args.image_size)": f"Tagger(last={last})",
        "nn.CrossEntropyLoss()": f"{'FlatCrossEntropy' if last else 'nn.CrossEntropyLoss'}({loss})",
        "\nCLASS_DIM = 1\n": f"\nCLASS_DIM = {-1 if last else 1}\n",
        "\nCOLLATE = None\n": "\nCOLLATE = None  # pad_batch, below\n",
    }
    return adapted_copy(folder, edits, SEQUENCE_DATA, "sequence")


@pytest.mark.parametrize("last", [False, True], ids=["classes second", "classes last"])
def test_a_sequence_copy_pads_its_batches_and_scores_each_real_token(
    tmp_path, one_rank, capsys, last
):
    """A practitioner's review: a copy for sequences could not run. The evaluation's own
    DataLoader took no collate_fn (after a whole epoch: "stack expects each tensor to be equal
    size"), inputs of (tokens, lengths) met x.to(device), and padded targets were counted:
    a perfect tagger scored 9 of 12. COLLATE serves both loaders, kit.to_device moves tuples,
    and a target of -100 is not a sample. Classes last (a language model's layout): CLASS_DIM."""
    template, ckpt = sequence_copy(tmp_path, last=last), tmp_path / "ckpt"
    argv = [
        "--num-samples",
        "96",
        "--num-val",
        "37",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--lr",
        "0.5",
        "--no-progress",
        "--backend",
        "gloo",
        "--checkpoint-dir",
        str(ckpt),
    ]
    template.main(argv)
    assert "done: 24 steps" in capsys.readouterr().out
    model, dim = template.Tagger(last=last), template.CLASS_DIM
    model.load_state_dict(torch.load(ckpt / "final.pt", weights_only=True))
    val_set = template.Tokens(37, 1)
    result = template.kit.distributed_evaluate(
        model, val_set, 8, collate_fn=template.pad_batch, class_dim=dim
    )
    tokens = sum(len(t) for t, _ in val_set)
    right = sum(int((model((t[None], torch.tensor([len(t)]))).argmax(dim)[0] == y).sum())
                for t, y in val_set)  # one sentence at a time: no padding at all  # fmt: skip
    assert result.count == tokens and result.correct == right, (result, tokens, right)
    last = torch.load(template.kit.latest_snapshot(ckpt), weights_only=True)["extra"]["history"]
    assert last[-1]["val_accuracy"] == pytest.approx(right / tokens)
    assert right / tokens > 0.9, "the tags are learnable: the padded training learned them"


def test_a_micro_batch_of_padding_alone_trains_on_and_counts_nothing(tmp_path, one_rank, capsys):
    """Helper 66's review: a micro-batch whose every target is -100 (a one-token sentence of a
    language model) has a mean of 0/0: nan in the loss, the log and the divergence check, which
    then stopped the run for good (failed.json) although the gradient is finite."""
    untagged = tuple(range(0, 48, 3))  # a third of the sentences: some micro-batch is all padding
    template = sequence_copy(tmp_path, data=f"sequence_data(args, {untagged})")
    ckpt = tmp_path / "ckpt"
    template.main(["--num-samples", "48", "--num-val", "8", "--batch-size", "1",
                   "--grad-accum", "2", "--epochs", "1", "--no-progress", "--backend", "gloo",
                   "--checkpoint-dir", str(ckpt)])  # fmt: skip
    assert "done: 24 steps" in capsys.readouterr().out and not (ckpt / "failed.json").exists()
    [epoch] = torch.load(template.kit.latest_snapshot(ckpt), weights_only=True)["extra"]["history"]
    assert math.isfinite(epoch["train_loss"]), epoch


def test_the_recorded_step_loss_is_the_last_micro_batchs_mean(tmp_path, one_rank):
    """--record-steps' steps.jsonl: the last micro-batch's mean loss (helper 66: it recorded the
    micro-batch's weighted share times --grad-accum, the same number only for equal batches)."""
    template, out = sequence_copy(tmp_path), tmp_path / "out"
    template.main(["--num-samples", "8", "--num-val", "2", "--batch-size", "1", "--grad-accum",
                   "2", "--max-steps", "1", "--no-progress", "--backend", "gloo",
                   "--out", str(out), "--record-steps"])  # fmt: skip
    [row] = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    train = template.Tokens(8, 0)
    sampler = template.kit.ResumableSampler(train, 1, 0, seed=0)
    sampler.set_epoch(0, 0)
    first, second = (template.pad_batch([train[i]]) for i in list(sampler)[:2])
    assert (first[1] != -100).sum() != (second[1] != -100).sum(), "unequal: the shares differ"
    torch.manual_seed(0)  # the template's initial weights
    model = template.Tagger()
    (x, y) = second  # after step 1's update only; the last micro-batch ran before it
    assert row["loss"] == pytest.approx(torch.nn.functional.cross_entropy(model(x), y).item())


@pytest.mark.torchrun
def test_a_step_on_two_ranks_is_the_token_mean_of_the_global_batch(tmp_path):
    """A practitioner's review: with sentences of different lengths, a step was the mean of each
    rank's and each micro-batch's mean loss, not one process's mean over the global batch's
    tokens (lesson 04, "Tokens, not samples"): 0.23 apart with one sentence per micro-batch.
    Now each micro-batch weighs by its share of every rank's counted targets, and with class
    weights (helper 66: a mean of weighted means, 2.086 for 2.411) by its share of their
    weights: one process's weighted mean over the global batch."""
    weights = torch.tensor([1.0, 5.0, 1.0])
    template = sequence_copy(tmp_path, loss="weight=torch.tensor([1.0, 5.0, 1.0])")
    ckpt = tmp_path / "ckpt"
    world, accum = 2, 3
    torchrun(tmp_path / "train.py", "--num-samples", 24, "--num-val", 5, "--batch-size", 1,
             "--grad-accum", accum, "--max-steps", 1, "--optimizer", "sgd", "--weight-decay", 0,
             "--clip-grad", 0, "--warmup", 0, "--lr", 40, "--no-progress", "--backend", "gloo",
             "--checkpoint-dir", ckpt, nproc=world, timeout=120)  # fmt: skip
    kit, train = template.kit, template.Tokens(24, 0)
    lr = torch.load(kit.latest_snapshot(ckpt), weights_only=True)["optimizer"]["param_groups"]
    torch.manual_seed(0)  # the template's initial weights: --seed 0, then the model
    model = template.Tagger()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    after = torch.cat([t.flatten() for t in torch.load(ckpt / "final.pt").values()])
    stepped = (before - after) / lr[0]["lr"]  # SGD's first step: the momentum buffer is the grad
    micro = []  # every rank's micro-batches of step 1, as its sampler dealt them
    for rank in range(world):
        sampler = kit.ResumableSampler(train, world, rank, seed=0)
        sampler.set_epoch(0, 0)
        micro += [template.pad_batch([train[i]]) for i in list(sampler)[:accum]]

    def gradient(loss: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ce = partial(torch.nn.functional.cross_entropy, weight=weights)
    tokens = sum(weights[y[y != -100]].sum() for _, y in micro)  # the weighted mean's divisor
    token_mean = gradient(sum(ce(model(x), y, reduction="sum") for x, y in micro) / tokens)
    mean_of_means = gradient(sum(ce(model(x), y) for x, y in micro) / len(micro))
    apart = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert apart(mean_of_means, token_mean) > 0.05, "the lengths differ enough to tell them apart"
    assert apart(stepped, token_mean) < 1e-4, apart(stepped, mean_of_means)


def test_padded_targets_are_neither_scored_nor_counted(kit):
    """9 real tokens of 12, every one tagged right: accuracy 1, the loss a mean over the 9."""
    cpu = torch.device("cpu")
    y = torch.tensor([[0, 1, 2, 1], [2, 2, -100, -100], [1, 0, 0, -100]])
    logits = torch.nn.functional.one_hot(y.clamp(min=0), 3).float().transpose(1, 2) * 5
    same = torch.nn.Identity()  # the "model" returns the logits it is given
    by_default = kit.local_sums(same, [(logits, y)], cpu)
    with_loss = kit.local_sums(same, [(logits, y)], cpu,
                               loss_fn=torch.nn.CrossEntropyLoss())  # fmt: skip
    loss_per_token = torch.nn.functional.cross_entropy(logits, y).item()
    for correct, count, loss_sum, divisor in (by_default.tolist(), with_loss.tolist()):
        assert (correct, count, divisor) == (9, 9, 9)
        assert loss_sum == pytest.approx(9 * loss_per_token)
    # the loss's own ignore_index, a class the model may predict: those are not scored either
    padded_as_0 = torch.nn.CrossEntropyLoss(ignore_index=0)
    sums = kit.local_sums(same, [(logits, y.clamp(min=0))], cpu, loss_fn=padded_as_0)
    assert sums[:2].tolist() == [6, 6]
    # class weights: the loss is their weighted mean, as training's (helper 66's review)
    weighted = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 2.0]))
    correct, count, loss_sum, divisor = kit.local_sums(
        same, [(logits[:2], y[:2]), (logits[2:], y[2:])], cpu, loss_fn=weighted
    ).tolist()
    assert (correct, count, divisor) == (9, 9, 1 * 3 + 5 * 3 + 2 * 3)  # three of each class
    assert loss_sum / divisor == pytest.approx(weighted(logits, y).item())
    with pytest.raises(kit.DataError, match="reduction='mean'"):  # a sum would count twice
        kit.local_sums(same, [(logits, y)], cpu, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"))


def test_scores_with_the_classes_last_are_read_there_and_others_named(kit):
    """A language model gives (B, T, V) and flattens both in its loss: the evaluation took the
    argmax over T ("size of tensor a (16) must match ... (22)" after a whole epoch, or a wrong
    accuracy without a word when T == V). CLASS_DIM says where the classes are (guessed from
    the shapes, a batch of T == V tokens read 5 of 8 right: helper 66); scores that do not fit
    it stop the run with both shapes."""
    cpu, same = torch.device("cpu"), torch.nn.Identity()
    y = torch.tensor([[1, 0, 2, 4, 3], [4, 4, 1, -100, -100]])  # (B, T) = (2, 5), 5 classes
    last = torch.nn.functional.one_hot(y.clamp(min=0), 5).float()  # (B, T, V), V == T
    flat = lambda scores, targets: torch.nn.functional.cross_entropy(  # noqa: E731
        scores.flatten(0, 1), targets.flatten()
    )
    cases = [(last, flat, -1), (last[:, :4], flat, -1), (last.transpose(1, 2), None, 1)]
    for scores, loss_fn, dim in cases:  # T == V == 5 in the first and the last
        batch = [(scores, y[:, : scores.shape[1 if dim == -1 else 2]])]
        sums = kit.local_sums(same, batch, cpu, loss_fn=loss_fn, class_dim=dim)
        assert sums[0] == sums[1] == (7 if scores.shape[1] == 4 else 8), (scores.shape, dim)
    with pytest.raises(kit.DataError, match=r"outputs \(2, 3, 5\) do not score the targets"):
        kit.local_sums(same, [(torch.zeros(2, 3, 5), y[:, :4])], cpu, loss_fn=flat, class_dim=-1)


def test_the_atomic_saves_fsyncs_come_in_order(template, kit, tmp_path, monkeypatch):
    """The file's bytes reach the disk before the name points at them; the rename reaches
    it after (the folder's fsync)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "model.pt"
    kit.atomic_save({"w": torch.ones(3)}, target)
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    assert events[0][1].endswith(".tmp") and events[2][1] == str(tmp_path), events
    events.clear()  # the template's best.json and failed.json (helper 165: not watched)
    template.write_json(tmp_path / "best.json", {"score": 0.5})
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"], events
    assert events[0][1].endswith(".tmp") and events[2][1] == str(tmp_path), events
    assert json.loads((tmp_path / "best.json").read_text()) == {"score": 0.5}


def test_each_rank_opens_its_share_of_the_image_headers(kit, tmp_path, monkeypatch):
    """An ImageFolder checked by 2 ranks: each opens half the files (ImageNet: 1.3 M opens
    per rank otherwise, on a shared filesystem)."""
    from PIL import Image

    from ddp_tutorial.real_data import write_example_folder

    root = write_example_folder(tmp_path, train=4, val=2)  # 3 classes: 18 files
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda p, *a: opened.append(p) or real_open(p, *a))
    for rank in (0, 1):
        kit.check_image_folder(root, rank, 2)
    assert len(opened) == 18 == len(set(opened)), "together once each"


def test_counted_targets_are_the_losss_divisor_and_need_no_host_sync(kit):
    """What cross_entropy's mean divides by (padding left out, class weights summed), with
    shapes known before the values: helper 83 found the boolean selection it used before
    (target[target != ignore]), whose size only the host learns, so every micro-batch on a
    GPU waited for the step before it. FakeTensorMode refuses such a data-dependent shape;
    it fails on the old code (DynamicOutputShapeException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    target = torch.tensor([[1, -100, 2], [0, 2, -100]])
    logits = torch.randn(2, 3, 3)
    weight = torch.tensor([0.5, 2.0, 4.0])
    for loss_fn in (torch.nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss(weight=weight)):
        count = kit.counted_targets(target, loss_fn)
        total = torch.nn.functional.cross_entropy(logits, target, weight=loss_fn.weight,
                                                  reduction="sum")  # fmt: skip
        mean = (total / count).float()
        assert count.dtype == torch.float64 and torch.isclose(mean, loss_fn(logits, target))
    assert kit.counted_targets(target, torch.nn.CrossEntropyLoss(weight=weight)) == 2 + 4 + 0.5 + 4
    assert kit.counted_targets(torch.rand(2, 3), torch.nn.MSELoss()) == 6
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        for loss_fn in (torch.nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss(weight=weight)):
            assert kit.counted_targets(fake.from_tensor(target), loss_fn).shape == ()


def test_the_check_sees_the_images_imagefolder_loads_through_a_linked_folder(kit, tmp_path):
    """A class whose images sit in a linked folder (a dataset assembled from symlinks): the
    check walked with Path.rglob, which does not enter one, and refused the folder ("class
    'a' has no images") that ImageFolder, following links, loads. Now both see the same
    files, and the check opens those headers too."""
    from ddp_tutorial.real_data import write_example_folder

    root = write_example_folder(tmp_path / "data", train=4, val=2)
    first = root / "train" / "a"
    (tmp_path / "store").mkdir()
    first.rename(tmp_path / "store" / "a")
    first.mkdir()
    (first / "part1").symlink_to(tmp_path / "store" / "a", target_is_directory=True)
    train, _, _ = kit.image_folder(root, 8)
    assert sum(label == 0 for _, label in train.samples) == 4
    (tmp_path / "store" / "a" / "bad.png").write_bytes(b"not an image")
    with pytest.raises(kit.DataError, match="bad.png is not a readable image"):
        kit.check_image_folder(root)


def test_an_image_cut_short_passes_the_header_check_and_is_named_when_read(kit, tmp_path):
    """A file cut short (a copy that stopped) has a whole header: the check at the start
    passes it, and PIL's error when the epoch reaches it ("image file is truncated") did not
    say which of the dataset's files it was. The loader's error names it."""
    from ddp_tutorial.real_data import write_example_folder

    root = write_example_folder(tmp_path, train=4, val=2)
    train, _, _ = kit.image_folder(root, 8)
    path, _ = train.samples[5]
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) * 2 // 3])
    kit.check_image_folder(root)  # the header is whole
    with pytest.raises(kit.DataError, match=f"{re.escape(path)} cannot be decoded"):
        train[5]
    assert train[4][0].shape == (3, 8, 8), "the others still load"
    Path(path).unlink()  # not an image's fault (helper 86): said as the OS says it
    with pytest.raises(FileNotFoundError):
        train[5]


def test_the_log_line_is_the_windows_mean_and_says_when_clipping_is_off(kit, capsys):
    """Every --log-every steps: the mean loss of the window (not its last step's), and
    "grad norm off" with --clip-grad 0 (no norm was computed: not "nan"). A window that spans
    an epoch's end (the loop zeroes its sums there) is still its steps' mean: epochs of 3
    steps, a line every 4 - before, step 8 printed the mean of step 7 and 8 minus step 4's."""
    sums = torch.zeros(2, dtype=torch.float64)
    log = kit.TrainLog(rank=0, every=4, global_batch=8, sums=sums)
    losses = [1.0, 3.0, 10.0, 20.0, 4.0, 6.0, 8.0, 2.0, 7.0]
    for step, loss in enumerate(losses, 1):
        sums += torch.tensor([loss, 1.0], dtype=torch.float64)
        log.step(step, sums, 0.1, None)
        if step % 3 == 0:  # the epoch's end, as the template's loop does it
            log.epoch_end(sums)
            sums.zero_()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["step 4: loss 8.5000", "step 8: loss 5.0000"]
    assert all("grad norm off" in line for line in lines), lines


def test_a_signal_before_a_due_evaluation_saves_first(template, kit, tmp_path, one_rank,
                                                      monkeypatch, capsys):  # fmt: skip
    """Point 3: SIGTERM lands after step 12; with --eval-every 15, step 15 is an evaluation
    and no periodic stop check (those come every 10 steps). The check before the evaluation
    stops the job there: the snapshot is written, the evaluation never runs inside the grace
    period, and the snapshot says it is owed, so the rerun's first act is step 15's evaluation
    (a mutation review: without the check's save, the evaluation's own stop saved the same;
    and the owed evaluation was lost for good, the rerun's history went 30, 32)."""
    unsignalled = signal_at(kit, monkeypatch, 12)
    argv = [*TINY, "--num-samples", "512", "--batch-size", "16", "--epochs", "1",
            "--eval-every", "15", "--checkpoint-dir", str(tmp_path / "c")]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    out = capsys.readouterr().out
    assert stopped.value.code == kit.PREEMPTED_EXIT, out
    assert "SIGTERM: saved step 15" in out and "val accuracy" not in out, out
    assert snapshot_steps(kit, tmp_path / "c") == [15]
    (path,) = [p for _, p in kit.list_snapshots(tmp_path / "c")]
    assert kit.load_checkpoint(path)["extra"]["eval_owed"], "the snapshot owes step 15's"
    unsignalled()  # the rerun: no signal
    template.main(argv)
    out = capsys.readouterr().out
    evaluated = [int(s) for s in re.findall(r"epoch \d+: step (\d+), loss", out)]
    assert evaluated == [15, 30, 32], out


@pytest.mark.parametrize(
    ("flags", "at"),
    [([], 16), (["--max-steps", "8"], 8), (["--eval-every", "8"], 8)],
    ids=["end of epoch", "--max-steps", "--eval-every"],
)
def test_a_signal_during_a_long_evaluation_stops_it_and_saves(
    template, kit, tmp_path, one_rank, monkeypatch, capsys, flags, at
):
    """SIGTERM lands during an evaluation, in its 3rd of 32 batches: the evaluation stops at the
    next agreement (batch 11: 0, 1, then every 10 when batches are fast), nothing is scored (no
    "val accuracy", no best.pt), the step is saved and the job exits 75. (Without the flag asked
    inside the evaluation all 32 batches run first: on a large validation set, past torchrun's
    30 s grace.) The rerun evaluates that step first, whole, wherever the evaluation was: at an
    epoch's end, after --max-steps (the rerun has nothing left to train), mid-epoch."""
    forward, evaluated, signalled = kit.MLP.forward, [], []

    def forward_then_signal(self, x):  # the scheduler's SIGTERM, in a known validation batch
        if not self.training and len(x) == 8:  # the evaluation's (2: the check before training)
            evaluated.append(len(x))
            if len(evaluated) == 3 and not signalled:
                signalled.append(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)
        return forward(self, x)

    monkeypatch.setattr(kit.MLP, "forward", forward_then_signal)
    argv = [*TINY, "--num-val", "256", "--num-samples", "64", "--batch-size", "4", "--epochs",
            "1", "--checkpoint-dir", str(tmp_path / "c"), *flags]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    out = capsys.readouterr().out
    assert stopped.value.code == kit.PREEMPTED_EXIT, out
    assert evaluated == [8] * 11, f"the evaluation went on after the signal: {len(evaluated)}"
    assert f"SIGTERM: saved step {at}" in out and "val accuracy" not in out, out
    assert snapshot_steps(kit, tmp_path / "c") == [at]
    assert not (tmp_path / "c" / "best.pt").exists(), "a partial evaluation scored nothing"
    evaluated.clear()
    template.main(argv)  # the rerun: no signal this time
    out = capsys.readouterr().out
    assert f"resumed from snapshot-{at:09d}.pt" in out and f"epoch 0: step {at}," in out, out
    assert evaluated[:32] == [8] * 32 and (tmp_path / "c" / "best.pt").is_file(), evaluated


def _cut(path: Path) -> None:
    """Half of the file: what a copy onto a full disk leaves (the atomic save never does)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _zeroed(path: Path) -> None:
    """Zeros of the file's size: what some filesystems leave of a file written just before
    a crash (a practitioner's review: this stopped the job as "the tar format of the earliest
    torch releases", and failed.json then stopped every rerun)."""
    path.write_bytes(bytes(path.stat().st_size))


def _flipped(path: Path) -> None:
    """Eight bytes of a tensor changed on disk, the zip intact: torch.load reads no checksum,
    so this loaded as other weights, or as NaNs that stopped the run for good (helper 82)."""
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda i: i.file_size)  # the largest tensor
    data = bytearray(path.read_bytes())
    start = member.header_offset + 30 + len(member.filename) + len(member.extra) + 64
    data[start : start + 8] = bytes.fromhex("0000c07f0000c07f")  # two NaNs
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_cut, _zeroed, _flipped], ids=["cut", "zeroed", "flipped"])
def test_a_damaged_newest_snapshot_is_passed_over_for_the_one_before(
    template, kit, tmp_path, one_rank, capsys, damage
):
    """Snapshots at steps 2 and 4, the newest cut in half or zeroed: the rerun warns, renames
    it .corrupt and resumes from step 2, to end where an uninterrupted run ends, bitwise."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--save-every", "2"]  # 8 steps  # fmt: skip
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "straight")])
    job = tmp_path / "job"
    template.main([*argv, "--checkpoint-dir", str(job), "--max-steps", "4"])
    assert snapshot_steps(kit, job) == [2, 4]
    damage(kit.snapshot_path(job, 4))
    capsys.readouterr()
    template.main([*argv, "--checkpoint-dir", str(job)])
    out = capsys.readouterr().out
    assert "WARNING: snapshot-000000004.pt could not be loaded" in out, out
    assert "resumed from snapshot-000000002.pt" in out, out
    assert (job / "snapshot-000000004.pt.corrupt").is_file(), "kept to look at, never tried again"
    straight = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    resumed = torch.load(job / "final.pt", weights_only=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "the same run, bitwise"


def test_a_damaged_only_snapshot_stops_the_run_and_every_restart(template, kit, tmp_path, one_rank,
                                                                 capsys):  # fmt: skip
    """Nothing older to fall back to: the error, failed.json (a restart would repeat it), and
    the file left where it was."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "2", "--save-every", "2"])
    _cut(kit.snapshot_path(tmp_path, 2))
    stops_with(template, argv, capsys, "CorruptCheckpointError", "truncated or corrupt")
    assert snapshot_steps(kit, tmp_path) == [2], "not renamed: nothing else to resume from"
    assert "truncated or corrupt" in json.loads((tmp_path / "failed.json").read_text())["error"]
    assert not kit.stale_temp_files(tmp_path), "written aside, then renamed"
    (tmp_path / "failed.json").write_text("")  # damaged (a hand edit): still a clear refusal
    with pytest.raises(SystemExit) as refused:
        template.main(argv)
    assert refused.value.code == 2 and "stopped for good: (the file says no more)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("best_by", ["val_accuracy", "val_loss"])
def test_best_pt_holds_the_weights_of_the_best_evaluation(template, kit, tmp_path, one_rank,
                                                          monkeypatch, best_by):  # fmt: skip
    """Three evaluations scored 0.5, 0.9, 0.7 (losses 1.0, 0.2, 0.6): best.pt holds the weights
    the second one evaluated, and best.json says so; not the last evaluation's (a mutation
    review: with scores that only rose, "the best" and "the last" could not be told apart)."""
    evaluate, seen = kit.distributed_evaluate, []
    scores = iter([(0.5, 1.0), (0.9, 0.2), (0.7, 0.6)])

    def scripted(model, *args, **kwargs):
        result = evaluate(model, *args, **kwargs)
        accuracy, loss = next(scores)
        seen.append({k: v.clone() for k, v in model.module.state_dict().items()})
        return kit.EvalResult(accuracy, loss, result.correct, result.count, result.local_count)

    monkeypatch.setattr(kit, "distributed_evaluate", scripted)
    argv = [*TINY, "--num-samples", "96", "--batch-size", "8", "--epochs", "1", "--eval-every",
            "4", "--best-by", best_by, "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main(argv)
    assert len(seen) == 3, "evaluated at steps 4, 8 and 12 (the epoch's end)"
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert all(torch.equal(best[k], seen[1][k]) for k in best), "the second evaluation's weights"
    assert not all(torch.equal(best[k], seen[2][k]) for k in best), "training moved on after it"
    note = json.loads((tmp_path / "best.json").read_text())
    assert (note["step"], note["val_accuracy"], note["val_loss"]) == (8, 0.9, 0.2), note


def test_a_loss_that_diverges_with_finite_weights_stops_the_template(
    template, kit, tmp_path, one_rank, monkeypatch, capsys
):
    """From step 3 on the training loss is inf while the gradients, and so the weights, stay
    finite (``loss + inf``, the constant has no gradient): only the loss check can see it, and
    the template feeds it every step (a mutation review: its one test of the loss check drove
    StopCheck alone, and the template's divergence test made the weights non-finite too)."""
    calls = []

    class InfFromStep3(torch.nn.CrossEntropyLoss):
        def forward(self, logits, target):
            loss = super().forward(logits, target)
            if logits.grad_fn is not None:  # training: not evaluation, nor the scoring
                calls.append(1)  # check's backward into a detached copy (a leaf)
                if len(calls) >= 3:
                    return loss + torch.tensor(float("inf"))
            return loss

    monkeypatch.setattr(torch.nn, "CrossEntropyLoss", InfFromStep3)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "2",
            "--checkpoint-dir", str(tmp_path / "c")]  # fmt: skip
    stops_with(template, argv, capsys, "DivergedError", "at step 3")
    assert not (tmp_path / "c" / "best.pt").exists() and not snapshot_steps(kit, tmp_path / "c")


def test_tensorboard_scalars_reach_the_disk_on_a_preemptions_exit_75(
    template, kit, tmp_path, one_rank, monkeypatch
):
    """SIGTERM after step 5: the ranks save step 11 and exit 75, and the writer is closed on
    that path too, every step's scalars on disk (a mutation review: only the divergence exit
    was checked; a writer closed on errors alone passed)."""
    import torch.utils.tensorboard as tb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opened = []

    class Writer(tb.SummaryWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(tb, "SummaryWriter", Writer)
    signal_at(kit, monkeypatch, 5)
    argv = [*TINY, "--num-samples", "256", "--batch-size", "8", "--epochs", "1",
            "--log-every", "1", "--checkpoint-dir", str(tmp_path / "c"),
            "--tensorboard", str(tmp_path / "tb")]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    assert stopped.value.code == kit.PREEMPTED_EXIT
    assert len(opened) == 1 and opened[0].file_writer is None, "the writer was left open"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 12))


LOG_ON_RANKS = """
import torch
from ddp_tutorial._kit import kit
from ddp_tutorial.distributed import process_group

with process_group(backend="gloo") as info:
    sums = torch.zeros(2, dtype=torch.float64)
    log = kit.TrainLog(info.rank, every=2, global_batch=8, sums=sums)
    for step in (1, 2):
        sums += torch.tensor([10.0 * info.rank + step, 1.0], dtype=torch.float64)
        log.step(step, sums, 0.1, None)
"""


@pytest.mark.torchrun
def test_the_log_line_is_the_mean_over_every_rank(tmp_path, write_script):
    """3 gloo ranks whose losses are 10 r + 1 and 10 r + 2: rank 0's line at step 2 is the
    mean over the ranks' windows, 11.5, not its own 1.5 (a mutation review: the in-process
    test has no group, so the all_reduce could go unnoticed)."""
    result = torchrun(write_script("log_ranks.py", LOG_ON_RANKS), nproc=3,
                      run_dir=tmp_path / "run", timeout=120, echo=False)  # fmt: skip
    assert "step 2: loss 11.5000" in result.output, result.output[-2000:]


def test_without_a_checkpoint_dir_the_template_says_that_nothing_is_saved(
    template, kit, tmp_path, one_rank, monkeypatch, capsys
):
    """A new user's review: with no --checkpoint-dir a finished run wrote no file and said
    nothing, and a preemption printed "SIGTERM: saved step 346" with nothing on the disk (a
    rerun started from step 0). Both now say so, and the start warns."""
    monkeypatch.chdir(tmp_path)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1"]
    template.main(argv)
    out = capsys.readouterr().out
    assert "WARNING: no --checkpoint-dir: nothing is saved" in out, out
    assert re.search(r"done: 8 steps, .*, nothing saved\n", out), out
    signal_at(kit, monkeypatch, 2)
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    out = capsys.readouterr().out
    assert stopped.value.code == kit.PREEMPTED_EXIT
    assert (
        "SIGTERM: nothing saved (no --checkpoint-dir), exit 75" in out and "saved step" not in out
    )
    assert list(tmp_path.iterdir()) == [], "no file written anywhere"


def test_a_finished_run_says_where_it_saved(template, tmp_path, one_rank, monkeypatch, capsys):
    """Helper 103: the last line of a run with --checkpoint-dir did not say where its files
    went (final.pt, best.pt, the snapshots)."""
    monkeypatch.chdir(tmp_path)
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1"]
    template.main([*argv, "--checkpoint-dir", "ck"])
    out = capsys.readouterr().out
    assert re.search(r"done: 8 steps, .*, saved in ck/ \(final\.pt, best\.pt, snapshots\)\n", out)
    assert (tmp_path / "ck" / "final.pt").is_file() and (tmp_path / "ck" / "best.pt").is_file()


def test_a_ranks_error_line_is_one_write(tmp_path, one_rank, monkeypatch):
    """Two ranks failing together printed "...(y.view_as(output))[rank0]: train.py: error: ..."
    on one line (a learner's review): print() writes the text and the newline apart, and the
    other rank's line came between. The line is written whole now."""
    template = load_script("train.py")
    kit = template.kit

    def unscorable(*args, **kwargs):
        raise kit.DataError("these targets cannot be scored")

    monkeypatch.setattr(kit, "distributed_evaluate", unscorable)
    writes: list[str] = []

    class Stderr(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Stderr())
    argv = [*TINY, "--image-size", "4", "--num-samples", "32", "--batch-size", "16",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    with pytest.raises(SystemExit):
        template.main(argv)
    (line,) = [w for w in writes if "train.py: error:" in w]
    assert line.startswith("[rank0]: train.py: error: DataError: ") and line.endswith("\n")


def test_help_shows_every_default_zero_included(template):
    """`action.default not in (None, False)` also skipped 0 (0 == False): --seed, --num-workers,
    --save-every and --eval-every showed no default though the comment says "every default"."""
    shown = {a.dest: a.help for a in template.parser()._actions}
    for dest in ("seed", "num_workers", "save_every", "eval_every"):
        assert "(default: %(default)s)" in shown[dest], (dest, shown[dest])
    assert "default" not in (shown["checkpoint_dir"] or ""), "None: no default to show"


def evaluated_steps(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"epoch \d+: step (\d+),", out)]


@pytest.mark.parametrize(
    ("flags", "at", "evaluations"),
    [(["--eval-every", "10"], 20, [10, 20, 30, 32]), (["--max-steps", "11"], 11, [11])],
    ids=["an --eval-every step", "the --max-steps step"],
)
def test_a_preemption_on_a_step_due_for_an_evaluation_owes_it_to_the_rerun(
    template, kit, tmp_path, one_rank, monkeypatch, capsys, flags, at, evaluations
):
    """A production read (helper 76): the stop check saved with nothing owed, so the rerun
    started after the step and its evaluation was never done - at --max-steps no final
    evaluation, no best.pt, and final.pt with one rank's own BatchNorm statistics."""
    argv = [*TINY, "--num-samples", "512", "--num-val", "64", "--batch-size", "16", "--epochs",
            "1", *flags, "--checkpoint-dir", str(tmp_path / "c")]  # fmt: skip
    unsignalled = signal_at(kit, monkeypatch, at)
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    first = capsys.readouterr().out
    assert stopped.value.code == kit.PREEMPTED_EXIT and f"saved step {at}," in first, first
    unsignalled()
    template.main(argv)
    rerun = capsys.readouterr().out
    assert evaluated_steps(first) + evaluated_steps(rerun) == evaluations, (first, rerun)
    assert (tmp_path / "c" / "best.pt").is_file()


def test_the_lr_reaches_zero_at_the_last_step_of_an_uneven_accumulated_run(
    template, tmp_path, one_rank, capsys
):
    """Helper 76: the schedule's length counted every sample, but an epoch trains whole
    accumulation windows of whole batches (1000 samples, 32 x 4: 896): the last step's LR was
    14 % of the peak. It runs over the steps the loop takes now. And each step takes the LR
    of its middle (helper 150): the last step's is small, not 0 (a step trained for nothing)."""
    argv = [*TINY, "--num-samples", "1000", "--batch-size", "32", "--grad-accum", "4",
            "--epochs", "2", "--log-every", "1", "--warmup", "0"]  # fmt: skip
    template.main(argv)
    lrs = [
        float(v)
        for v in re.findall(r"step \d+: loss [0-9.]+, lr ([0-9.e-]+)", capsys.readouterr().out)
    ]
    assert len(lrs) == 14 and 0 < lrs[-1] < 5e-3 * lrs[0], lrs  # cos at 1 - 1/28: 0.3 %


def test_fp16_switched_on_at_a_resume_starts_a_fresh_scaler(template, tmp_path, one_rank, capsys):
    """Helper 76: a snapshot saved without fp16 holds a disabled GradScaler's {}; an enabled
    one refused it with a RuntimeError on every restart."""
    argv = [*TINY, "--num-samples", "256", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path / "c")]  # fmt: skip
    template.main([*argv, "--max-steps", "2"])
    template.main([*argv, "--max-steps", "4", "--amp", "fp16"])
    assert "done: 4 steps" in capsys.readouterr().out


def test_the_first_log_line_after_a_resume_is_the_whole_windows_mean(
    template, kit, tmp_path, one_rank, monkeypatch, capsys
):
    """Helper 76: the log's window restarted at the resume, so step 12's line after a stop at
    step 11 was step 12's loss alone (2.2767 against 2.2989 for steps 9-12). The snapshot keeps
    the window's sums now."""
    argv = [*TINY, "--num-samples", "512", "--num-val", "64", "--batch-size", "16", "--epochs",
            "1", "--max-steps", "16", "--log-every", "4"]  # fmt: skip
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "straight")])
    straight = dict(re.findall(r"step (\d+): loss ([0-9.]+)", capsys.readouterr().out))
    unsignalled = signal_at(kit, monkeypatch, 11)
    with pytest.raises(SystemExit):
        template.main([*argv, "--checkpoint-dir", str(tmp_path / "c")])
    unsignalled()
    capsys.readouterr()
    template.main([*argv, "--checkpoint-dir", str(tmp_path / "c")])
    resumed = dict(re.findall(r"step (\d+): loss ([0-9.]+)", capsys.readouterr().out))
    assert resumed["12"] == straight["12"] and resumed["16"] == straight["16"], (resumed, straight)


@pytest.mark.torchrun
def test_a_snapshot_holds_the_averaged_batchnorm_statistics_and_each_ranks_own(tmp_path):
    """Helper 76: the snapshot's model shares storage with the live buffers, and each rank's
    own statistics were put back before the file was written: a mid-epoch snapshot held rank
    0's own running statistics, not their average (what a resume on another world size, or
    --pretrain from a snapshot, starts from)."""
    ckpt = tmp_path / "c"
    torchrun(REPO / "scripts" / "train.py", "--model", "cnn", "--image-size", "8",
             "--num-samples", "512", "--num-val", "16", "--batch-size", "16", "--epochs", "1",
             "--max-steps", "6", "--save-every", "3", "--no-progress",
             "--backend", "gloo", "--checkpoint-dir", ckpt, nproc=2, timeout=120)  # fmt: skip
    state = torch.load(ckpt / "snapshot-000000003.pt", weights_only=True)
    own = state["buffers"]
    names = [k for k in own[0] if k.endswith("running_var")]
    assert names and not torch.equal(own[0][names[0]], own[1][names[0]]), "the ranks differ"
    for name in names:
        average = (own[0][name] + own[1][name]) / 2
        assert torch.allclose(state["model"][name], average), name


@pytest.mark.torchrun
def test_a_crash_with_dataloader_workers_ends_the_rank_in_seconds(tmp_path):
    """Helper 82: a rank that raised with --num-workers 2 (here a truncated image) never
    exited: its traceback kept the loader alive, the workers ignore SIGTERM, and
    multiprocessing's exit handler joined them for ever; torchrun could not restart it."""
    from ddp_tutorial.real_data import write_example_folder

    folder = write_example_folder(tmp_path / "images", size=16)
    png = sorted((folder / "train" / "a").glob("*.png"))[0]
    png.write_bytes(png.read_bytes()[: png.stat().st_size // 2])  # its header intact
    command = [sys.executable, str(REPO / "scripts" / "train.py"), "--data-dir", str(folder),
               "--num-workers", "2", "--batch-size", "4", "--epochs", "1", "--image-size", "8",
               "--no-progress", "--backend", "gloo"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0 and "truncated" in run.stderr, run.stderr[-2000:]


def test_hidden_class_folders_are_refused_before_they_shift_the_labels(kit, tmp_path):
    """Helper 82: train/.ipynb_checkpoints/ is a class to ImageFolder but not to the folder
    check: "a" became label 1 in training and 0 in validation."""
    from ddp_tutorial.real_data import write_example_folder

    folder = write_example_folder(tmp_path / "images", size=8)
    png = sorted((folder / "train" / "a").glob("*.png"))[0]
    (folder / "train" / ".ipynb_checkpoints").mkdir()
    (folder / "train" / ".ipynb_checkpoints" / png.name).write_bytes(png.read_bytes())
    with pytest.raises(kit.DataError, match="train/ has the class folders"):
        kit.image_folder(folder, 8)


def test_a_damaged_best_json_is_warned_of_not_a_crash_on_every_restart(
    template, tmp_path, one_rank, capsys
):
    """Helper 82: an empty best.json (a crash right after it was created) made every resume
    raise a JSONDecodeError; torchrun's restarts replayed it."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "2",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "8"])
    (tmp_path / "best.json").write_text("")
    capsys.readouterr()
    template.main([*argv, "--max-steps", "12"])
    out = capsys.readouterr().out
    assert "WARNING: best.json is damaged" in out and "done: 12 steps" in out, out
    (tmp_path / "best.json").write_text("[]")  # JSON, not a record (helper 150: AttributeError)
    template.main(argv)
    out = capsys.readouterr().out
    assert "WARNING: best.json is damaged" in out and "done: 16 steps" in out, out


def test_tensorboard_drops_what_a_crashed_attempt_logged_after_its_snapshot(
    template, kit, tmp_path, one_rank, monkeypatch
):
    """Helper 82: a restart from the step-4 snapshot of an attempt that had logged step 6 wrote
    step 6 twice (two samples/s values for one step). The resumed writer purges from step 5."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1", "--log-every",
            "2", "--save-every", "4", "--tensorboard", str(tmp_path / "tb"),
            "--checkpoint-dir", str(tmp_path / "c")]  # fmt: skip
    observe = kit.StopCheck.observe

    def crash_at_7(self, step, loss):
        observe(self, step, loss)
        if step == 7:
            raise RuntimeError("a rank crashed")

    monkeypatch.setattr(kit.StopCheck, "observe", crash_at_7)
    with pytest.raises(RuntimeError, match="a rank crashed"):
        template.main(argv)
    monkeypatch.setattr(kit.StopCheck, "observe", observe)
    template.main(argv)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [2, 4, 6, 8], steps


def test_a_download_without_a_network_is_a_data_error(kit, tmp_path, monkeypatch):
    """Helper 82: --download with no network printed urllib's traceback (an OSError the
    RuntimeError handler let through)."""
    import urllib.error

    import torchvision.datasets

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)  # no network here, or in CI
    with pytest.raises(kit.DataError, match="--download: .*Name or service not known"):
        kit.cifar10(tmp_path, 32, download=True)


def test_a_failed_save_in_the_owed_evaluation_stops_every_restart(template, kit, tmp_path,
                                                                  one_rank, capsys):  # fmt: skip
    """A rerun's first act, the evaluation a signal stopped (``eval_owed``), is guarded as
    training is (helper 92: it ran before the guard, so a failed best.pt there exited 1 without
    failed.json, and every --max-restarts attempt repeated it)."""
    argv = [*TINY, "--num-samples", "64", "--batch-size", "8", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--max-steps", "2", "--save-every", "2"])
    path = kit.snapshot_path(tmp_path, 2)
    state = torch.load(path, weights_only=True)
    state["extra"].update(eval_owed=True, best=-math.inf)  # what a signal in the evaluation left
    torch.save(state, path)
    (tmp_path / "best.json").unlink()  # (it would say best.pt is better than what comes)
    (tmp_path / "best.pt").unlink()
    (tmp_path / "best.pt").mkdir()  # the owed evaluation's best.pt: its rename fails
    stops_with(template, [*argv, "--max-steps", "2"], capsys, "CheckpointError", "best.pt")
    assert "best.pt" in json.loads((tmp_path / "failed.json").read_text())["error"]
    # and the deliverable, after the loop: final.pt
    (tmp_path / "failed.json").unlink()
    (tmp_path / "best.pt").rmdir()
    (tmp_path / "final.pt").unlink()
    (tmp_path / "final.pt").mkdir()
    stops_with(template, [*argv, "--max-steps", "2"], capsys, "CheckpointError", "final.pt")
    assert "final.pt" in json.loads((tmp_path / "failed.json").read_text())["error"]


# -- a practitioner's copy (helper 125, twenty-fifth session) ------------------------------


def test_dict_samples_reach_the_template_through_collate(template, kit, one_rank, monkeypatch,
                                                         capsys):  # fmt: skip
    """A Dataset of dict samples with a COLLATE that makes (x, y) pairs stopped with a bare
    ``KeyError: 1`` in the float-target check, which indexed a raw sample: it collates first
    now; without a COLLATE the run stops naming the pair it wants."""
    real = kit.build_datasets

    class Dicts(torch.utils.data.Dataset):
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return {"x": x, "y": y}

    def dicts(args, rank=0, world_size=1):
        train, val, classes = real(args, rank, world_size)
        return Dicts(train), Dicts(val), classes

    monkeypatch.setattr(kit, "build_datasets", dicts)
    argv = [*TINY, "--num-samples", "32", "--batch-size", "8", "--max-steps", "2"]
    with pytest.raises(SystemExit) as stopped:
        template.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "is not (inputs, target)" in err and "COLLATE" in err, err
    pairs = lambda batch: (torch.stack([s["x"] for s in batch]),  # noqa: E731
                           torch.tensor([s["y"] for s in batch]))  # fmt: skip
    monkeypatch.setattr(template, "COLLATE", pairs)
    template.main(argv)
    assert "val accuracy" in capsys.readouterr().out


def test_a_target_dtype_the_losss_backward_refuses_is_named_before_training(kit):
    """float64 or int64 targets of a regression passed the forward-only scoring check and
    failed in the first step's backward ("Found dtype Double but expected Float", 15 lines of
    autograd frames on every rank): check_scoring runs the loss's backward too, on a detached
    copy of the outputs, and names the dtypes. The model's gradients stay untouched."""
    model = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    for dtype in (torch.float64, torch.int64):
        data = list(zip(x, torch.ones(4, 1, dtype=dtype), strict=True))
        with pytest.raises(kit.DataError, match=re.escape(f"the targets {dtype} - return")):
            kit.check_scoring(model, data, torch.device("cpu"), loss_fn=torch.nn.HuberLoss())
    data = list(zip(x, torch.ones(4, 1), strict=True))
    kit.check_scoring(model, data, torch.device("cpu"), loss_fn=torch.nn.HuberLoss())
    assert model.weight.grad is None, "the check never reaches the model's parameters"


def test_a_resume_with_the_same_global_batch_warns_of_no_schedule_jump(
    template, tmp_path, one_rank, capsys
):
    """--batch-size 16 resumed as 8 x --grad-accum 2 (a global batch of 16 both times) was
    warned "the LR schedule jumps": the peak LR and the steps follow the global batch alone. A
    global batch that changes is still warned."""
    argv = [*TINY, "--num-samples", "128", "--epochs", "1", "--save-every", "2",
            "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    template.main([*argv, "--batch-size", "16", "--max-steps", "2"])
    capsys.readouterr()
    template.main([*argv, "--batch-size", "8", "--grad-accum", "2", "--max-steps", "4"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "schedule jumps" not in out, out
    template.main([*argv, "--batch-size", "4", "--grad-accum", "2", "--max-steps", "6"])
    out = capsys.readouterr().out
    assert "WARNING: resumed with --batch-size 8 -> 4: the LR schedule jumps" in out, out


def test_keep_1_and_an_evaluation_past_the_run_are_refused_before_training(template):
    """--keep 1 was taken though its help says 2 or more (a damaged newest snapshot then has
    none to fall back to); --eval-every past the run's end was taken, --save-every refused;
    --download without --data cifar10 was taken and ignored."""
    problem = template.check_run(template.parse_args(["--keep", "1"]), 1, None) or ""
    assert "--keep 1 leaves no snapshot to fall back to" in problem, problem
    short = ["--batch-size", "8", "--epochs", "1", "--max-steps", "3"]
    problem = template.check_run(template.parse_args([*short, "--eval-every", "1000"]), 1, 64)
    assert problem == "--eval-every 1000 is beyond the run's 3 steps (--max-steps): lower it, or 0"
    assert template.check_run(template.parse_args([*short, "--eval-every", "3"]), 1, 64) is None
    problem = template.check_run(template.parse_args(["--download"]), 1, None)  # was ignored
    assert problem.startswith("--download fetches --data cifar10 only, not synthetic"), problem
    cifar = template.parse_args(["--data", "cifar10", "--download"])
    assert template.check_run(cifar, 1, None) is None
