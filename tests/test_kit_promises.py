"""Promises of the template's sidecar (``scripts/ddp_kit.py``) that no other test held.

Each test here failed on a deliberate break of the function it names while every other test
passed (helper 173's mutation audit of the sidecar: 40 mutants, 20 caught before these). All
run in this process, on the kit ``train.py`` imports, in well under a second each.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import math
import signal
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from conftest import load_script


@pytest.fixture(scope="module")
def kit():
    return load_script("train.py").kit


def test_numpys_cached_gaussian_is_restored_with_its_state(kit):
    """numpy draws gaussians in pairs and keeps the second: ``has_gauss`` is part of the state
    (mutant: restored as 0, the next randn after a resume differs)."""
    np.random.seed(5)
    np.random.randn()  # an odd number drawn: one cached
    state = kit.capture_rng_state()
    expected = np.random.randn(3)
    np.random.seed(9)
    kit.restore_rng_state(state)
    assert np.array_equal(np.random.randn(3), expected)


def test_counted_targets_follow_the_losss_own_ignore_index(kit):
    """The divisor skips what the loss skips: its ignore_index, not always -100."""
    targets = torch.tensor([0, 1, 0, 2])
    assert int(kit.counted_targets(targets, nn.CrossEntropyLoss(ignore_index=0))) == 2
    assert int(kit.counted_targets(targets, nn.CrossEntropyLoss())) == 4


def test_prefixes_of_a_compiled_ddp_model_are_stripped_in_any_order(kit):
    """``torch.compile(DDP(m))`` saves ``_orig_mod.module.*``: both prefixes go, one pass each."""
    weights = nn.Linear(2, 2).state_dict()
    saved = OrderedDict((f"_orig_mod.module.{k}", v) for k, v in weights.items())
    assert list(kit.strip_prefixes(saved)) == ["weight", "bias"]


def test_a_weight_of_another_shape_is_named_not_loaded(kit):
    """A transposed weight has as many numbers: the check compares shapes, not sizes."""
    wrong = {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}
    with pytest.raises(kit.CheckpointError, match="shape mismatches"):
        kit.load_model_state(nn.Linear(3, 2), wrong)


def test_nccl_chosen_with_a_gpu_per_rank_warns_of_nothing(kit):
    """A fallback warning is for gloo chosen where nccl was possible, not for nccl itself."""
    with (mock.patch.object(torch.cuda, "is_available", lambda: True),
          mock.patch.object(torch.cuda, "device_count", lambda: 2)):  # fmt: skip
        assert kit.fallback_warning("auto", "nccl", "2 GPU(s) for 2 local rank(s): nccl") is None


def test_the_optimizer_decays_weights_only_and_skips_frozen_parameters(kit):
    """SGD with momentum 0.9; weight decay on matrices, none on biases; frozen ones left out."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    optimizer = kit.build_optimizer("sgd", model, 0.1, 0.05, fused=False)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert optimizer.defaults["momentum"] == 0.9
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2, "the frozen layer is out"


def test_a_log_window_spanning_epochs_is_the_mean_of_all_its_steps(kit):
    """Epochs of one step, a line every 4 steps: the line is the mean of 1, 2, 3, 4 (the
    epochs' ends carry their steps into the window; mutant: only the last epoch's, 3.5)."""
    sums = torch.zeros(2, dtype=torch.float64)
    log = kit.TrainLog(0, 4, 8, sums=sums)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for step, loss in enumerate([1.0, 2.0, 3.0, 4.0], 1):
            sums += torch.tensor([loss, 1.0], dtype=torch.float64)
            log.step(step, sums, 0.1, None)
            log.epoch_end(sums)
            sums.zero_()
    assert printed.getvalue().startswith("step 4: loss 2.5000"), printed.getvalue()


def test_a_divergence_is_reported_at_its_first_bad_step(kit):
    """Two non-finite losses in a window: the message names the first (mutant: the last)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        check = kit.StopCheck(torch.device("cpu"))
        for step, loss in ((1, 1.0), (2, math.nan), (3, math.nan)):
            check.observe(step, torch.tensor(loss))
        with pytest.raises(kit.DivergedError, match="at step 2"):
            check.check(10)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_job_store_gives_up_on_a_missing_rank_in_time(kit, monkeypatch):
    """Rank 0 waits for every rank's arrival up to its timeout, then names the missing ones
    (mutant: no deadline - it waited for ever)."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       timeout=timedelta(seconds=10))  # fmt: skip
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    raised: list[BaseException] = []

    def rank_0() -> None:
        try:
            kit.job_store(0, 2, timeout_s=1)
        except BaseException as exc:  # noqa: BLE001 - read below
            raised.append(exc)

    waiting = threading.Thread(target=rank_0, daemon=True)  # a daemon: a hang fails, not hangs
    started = time.monotonic()
    waiting.start()
    waiting.join(10)
    assert not waiting.is_alive(), "rank 0 still waiting for rank 1 after 10 s (timeout 1 s)"
    assert time.monotonic() - started < 5
    assert isinstance(raised[0], TimeoutError) and "ranks [1] did not reach" in str(raised[0])


def test_another_users_read_only_lock_still_refuses_a_second_job(kit, tmp_path, monkeypatch):
    """A .lock this user cannot open for writing (another user's, in a shared folder) is still
    locked, read-only (mutant: the folder left unguarded)."""
    held = kit.hold_folder(tmp_path)

    def read_only(path, mode="r", *args, **kwargs):
        if mode == "a+":
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(kit, "open", read_only, raising=False)
    try:
        with pytest.raises(kit.FolderInUse):
            kit.hold_folder(tmp_path)
    finally:
        held.close()


def test_an_evaluation_sampler_that_shuffles_takes_each_epochs_order(kit):
    """``shuffle=True`` draws with seed + epoch, as DistributedSampler does."""
    ranks = [kit.UnpaddedDistributedSampler(range(40), num_replicas=2, rank=r, shuffle=True)
             for r in (0, 1)]  # fmt: skip
    first = list(ranks[0])
    for sampler in ranks:
        sampler.set_epoch(1)
    assert list(ranks[0]) != first, "a new order"
    assert sorted([*ranks[0], *ranks[1]]) == list(range(40)), "each index once"


def test_a_flag_the_snapshot_never_had_is_no_schedule_change(kit):
    """A snapshot from before a flag existed: nothing to compare, no KeyError."""
    assert kit.schedule_changes({"epochs": 1}, {"epochs": 1, "warmup": 0.05}) == []
    assert kit.schedule_changes({"epochs": 1}, {"epochs": 3}) == ["--epochs 1 -> 3"]
