"""ddp_tutorial.checkpoint and ddp_tutorial.snapshots with real files and real gloo ranks.

Lesson 05 (notebooks/05_checkpointing.ipynb) asserts on real launches what
is not repeated here: the save race (seed 000's guard vs rank-0 atomic), the
SIGKILL mid-save (scripts/demos/save_victim.py), and the bitwise resume across two
launches (scripts/demos/resume.py).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import random
import subprocess
import sys
import tarfile
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import DEMOS, REPO
from ddp_tutorial.checkpoint import (
    CheckpointError,
    atomic_save,
    find_unsafe,
    is_save_epoch,
    load_checkpoint,
    load_model_state,
    model_state,
    save_checkpoint,
    stale_temp_files,
    strip_prefixes,
    temp_path_for,
)
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.models import MLP, unwrap_model
from ddp_tutorial.snapshots import (
    capture_rng_state,
    latest_snapshot,
    list_snapshots,
    prune_snapshots,
    restore_rng_state,
    restore_training_state,
    snapshot_path,
    training_state,
)


def small_model(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(8, 3, hidden=16)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Wrapper(nn.Module):
    """Holds the model as ``.module``, as DDP and DataParallel do: their state_dict keys."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model


CUDA_PROBES = ("is_available", "device_count", "get_device_properties", "_lazy_init")


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of the torch.cuda functions that look for GPUs (or start CUDA), recorded.

    ``nn.DataParallel(model)`` calls them in its constructor, and on a GPU
    machine initialises CUDA and moves the model to cuda:0; building
    ``module.``-prefixed keys must not: assert the list is empty.
    """
    calls: list[str] = []
    for name in CUDA_PROBES:
        original = getattr(torch.cuda, name)

        def probe(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.cuda, name, probe)
    return calls


def cpu_data_parallel(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> nn.DataParallel:
    """``nn.DataParallel(model)`` as built on a machine without GPUs: a pass-through, no CUDA."""
    import importlib

    module = importlib.import_module("torch.nn.parallel.data_parallel")  # not the function
    monkeypatch.setattr(module, "_get_available_device_type", lambda: None)
    return nn.DataParallel(model)


def test_cuda_calls_fixture_sees_data_parallel(cuda_calls):
    nn.DataParallel(small_model())  # the constructor the lessons and tests no longer use
    assert "is_available" in cuda_calls


# --------------------------------------------------------------------------- atomic save


def test_atomic_save_round_trip_leaves_no_temp_file(tmp_path):
    path = atomic_save({"model": small_model().state_dict(), "epoch": 3}, tmp_path / "a" / "c.pt")
    assert path == tmp_path / "a" / "c.pt"
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and set(loaded["model"]) == set(small_model().state_dict())
    assert os.listdir(path.parent) == ["c.pt"], "the temp file was renamed, not left behind"


def test_atomic_save_respects_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_save({"x": 1}, tmp_path / "c.pt")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644, "readable by the group, like torch.save's file"


def test_atomic_save_replaces_and_a_failed_save_keeps_the_old_file(tmp_path):
    path = atomic_save({"version": 1}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="argparse.Namespace"):  # refused before writing
        atomic_save({"version": 2, "args": argparse.Namespace(lr=0.1)}, path)
    assert load_checkpoint(path)["version"] == 1
    atomic_save({"version": 3}, path)
    assert load_checkpoint(path)["version"] == 3


def test_a_save_that_fails_while_writing_removes_its_temp_file(tmp_path, monkeypatch):
    """The temp file exists when torch.save fails (here: an object pickle cannot write)."""
    path = atomic_save({"version": 1}, tmp_path / "c.pt")
    created = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a: created.append(p) or real_open(p, *a))
    # "Can't pickle local object" up to Python 3.12, "Can't get local object" from 3.13
    with pytest.raises((AttributeError, pickle.PicklingError, TypeError), match="local object"):
        atomic_save({"version": 2, "hook": lambda: None}, path, check_plain=False)
    assert [p.name for p in created if p.suffix == ".tmp"], "the temp file had been created"
    assert load_checkpoint(path)["version"] == 1, "the old file is intact"
    assert stale_temp_files(tmp_path) == [] and os.listdir(tmp_path) == ["c.pt"]


def test_save_checkpoint_without_process_group_is_atomic_save(tmp_path):
    path = save_checkpoint(tmp_path / "c.pt", {"step": 7})
    assert load_checkpoint(path) == {"step": 7}


def test_find_unsafe_names_the_offending_entries():
    state = {
        "model": OrderedDict(w=torch.zeros(2)),
        "args": argparse.Namespace(a=1),
        "hist": [1.0, np.float64(2.0), frozenset({1})],
        "ok": (1, "x", None, torch.float32, torch.Size([2]), torch.device("cpu")),
        "keys": {0: 1, 2.5: 1, (1, "a"): 1, Payload("x"): 1},  # weights_only refuses the last
    }
    problems = find_unsafe(state)
    assert problems == [
        "state['args'] is argparse.Namespace",
        "state['hist'][1] is numpy.float64",
        "state['hist'][2] is builtins.frozenset",
        "state['keys'] has a key of type Payload",
    ]


def test_keys_find_unsafe_accepts_are_keys_weights_only_loads(tmp_path):
    keys = {0: torch.ones(1), 2.5: "x", (1, "a"): [1], None: True}
    assert find_unsafe(keys) == []
    path = atomic_save(keys, tmp_path / "keys.pt")
    assert load_checkpoint(path).keys() == keys.keys()


def test_temp_path_is_hidden_and_in_the_same_directory(tmp_path):
    tmp = temp_path_for(tmp_path / "c.pt")
    assert tmp.parent == tmp_path and tmp.name.startswith(".c.pt.") and tmp.name.endswith(".tmp")


# --------------------------------------------------------------------------- clear errors


def test_missing_file(tmp_path):
    atomic_save({}, tmp_path / "epoch_1.pt")
    with pytest.raises(CheckpointError, match=r"epoch_9\.pt does not exist.*epoch_1\.pt"):
        load_checkpoint(tmp_path / "epoch_9.pt")
    with pytest.raises(CheckpointError, match="does not exist either"):
        load_checkpoint(tmp_path / "nowhere" / "c.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("keep", [0, 10, 0.5, -30])
def test_truncated_file(tmp_path, keep):
    good = atomic_save({"model": small_model().state_dict()}, tmp_path / "good.pt")
    data = good.read_bytes()
    n = (
        int(len(data) * keep)
        if isinstance(keep, float)
        else keep
        if keep >= 0
        else len(data) + keep
    )
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[:n])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(cut)
    message = str(info.value)
    assert str(cut) in message
    assert "empty" in message if n == 0 else "truncated or corrupt" in message
    assert "\n" not in message.split("torch says:")[-1], "one line, not a traceback"


def test_garbage_file_and_legacy_formats(tmp_path):
    """Damaged files are named damaged (the template then falls back to an older snapshot):
    text, a file of zeros (what some filesystems leave after a crash), random bytes - also
    ones that begin as a pickle does. A practitioner's review found the zeros called "the tar
    format of the earliest torch releases", the JSON "a security feature", and random bytes a
    raw IndexError from inside torch."""
    from ddp_tutorial._kit import kit

    noise = random.Random(2)
    damaged = {
        "text": b"not a checkpoint at all " * 20,
        "json": b'{"oops": 1}\n',
        "zeros": bytes(5000),
        "random": noise.randbytes(5000),
    }
    garbage = tmp_path / "garbage.pt"
    for what, data in damaged.items():
        garbage.write_bytes(data)
        with pytest.raises(kit.CorruptCheckpointError, match="garbage.pt .* truncated or corrupt"):
            load_checkpoint(garbage)
            pytest.fail(f"{what}: loaded")
    for _ in range(20):  # random bytes after a pickle's first two: a CheckpointError, never a
        garbage.write_bytes(b"\x80\x02" + noise.randbytes(5000))  # raw IndexError from torch
        with pytest.raises(CheckpointError, match="garbage.pt"):
            load_checkpoint(garbage)
    legacy = tmp_path / "legacy.pt"  # the pre-1.6 format: current torch reads it safely
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(legacy)["w"], torch.ones(2))
    tar = tmp_path / "tar.pt"  # the earliest releases wrote a tar: weights_only cannot read it
    with tarfile.open(tar, "w") as archive:
        archive.add(legacy, arcname="storages")
    with pytest.raises(CheckpointError, match="tar.pt uses the tar format of the earliest"):
        load_checkpoint(tar)


def test_a_file_saved_on_a_gpu_says_to_pass_map_location(tmp_path, monkeypatch):
    """A real file whose tensors are tagged cuda:0, as rank 0 writes them from its GPU."""
    import torch.serialization

    path = tmp_path / "gpu.pt"
    with monkeypatch.context() as m:  # how torch.save tags each storage with its device
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.ones(2)}, path)
    if torch.cuda.is_available():
        pytest.skip("this machine can load cuda:0 tensors")
    with pytest.raises(CheckpointError, match="gpu.pt holds tensors saved on a GPU.*map_location"):
        load_checkpoint(path, map_location=None)
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(2)), "the default: map onto CPU"


def test_a_file_this_process_may_not_read(tmp_path, monkeypatch):
    path = atomic_save({"w": torch.ones(1)}, tmp_path / "c.pt")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads it anyway: torch.load raises what it would
        denied = PermissionError(13, "Permission denied", str(path))
        monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(denied))
    with pytest.raises(CheckpointError, match="c.pt cannot be read: Permission denied"):
        load_checkpoint(path)


class Payload:
    """Unpickling this runs ``io.open(marker, "w")`` — any call could be made instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (io.open, (self.marker, "w"))


def test_weights_only_refuses_code_and_says_why(tmp_path):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Payload(str(marker))}, evil)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(evil)
    message = str(info.value)
    assert "evil.pt" in message and "io.open" in message and "security feature" in message
    assert not marker.exists(), "nothing from the file ran"
    torch.load(evil, weights_only=False)["x"].close()
    assert marker.exists(), "the unsafe load does run it (why weights_only matters)"


def test_weights_only_refuses_namespace_saved_by_plain_torch_save(tmp_path):
    path = tmp_path / "seed.pt"
    torch.save({"state_dict": {}, "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(CheckpointError, match=r"argparse\.Namespace.*weights_only"):
        load_checkpoint(path)


# --------------------------------------------------------------------------- prefixes and keys


def test_prefixes_module_orig_mod_and_both(tmp_path, cuda_calls):
    reference = small_model(1)
    plain = reference.state_dict()
    variants = {
        "plain": plain,
        "module": Wrapper(reference).state_dict(),
        "compiled": torch.compile(reference).state_dict(),
        "ddp(compile)": Wrapper(torch.compile(reference)).state_dict(),
    }
    assert cuda_calls == [], "building prefixed keys looked for GPUs"
    assert list(variants["module"]) == [f"module.{k}" for k in plain]
    assert list(variants["compiled"]) == [f"_orig_mod.{k}" for k in plain]
    assert list(variants["ddp(compile)"]) == [f"module._orig_mod.{k}" for k in plain]
    for name, state in variants.items():
        path = atomic_save(state, tmp_path / f"{name}.pt")
        fresh = small_model(2)
        assert load_model_state(fresh, path) == ([], []), name
        assert same_weights(fresh, reference), name
        assert list(strip_prefixes(state)) == list(plain), name


def test_strip_only_when_every_key_has_the_prefix():
    """(Lesson 05 shows seed 002's k[7:] on an unprefixed file refused.)"""
    mixed = OrderedDict([("module.a", torch.zeros(1)), ("b", torch.zeros(1))])
    assert list(strip_prefixes(mixed)) == ["module.a", "b"]


def test_model_state_unwraps_and_load_into_wrapped_model(monkeypatch, cuda_calls):
    model = small_model(3)
    assert unwrap_model(cpu_data_parallel(torch.compile(model), monkeypatch)) is model
    assert list(model_state(cpu_data_parallel(model, monkeypatch))) == list(model.state_dict())
    target = cpu_data_parallel(small_model(4), monkeypatch)
    load_model_state(target, {"model": model.state_dict(), "epoch": 1})  # a training state
    assert same_weights(target.module, model)
    assert cuda_calls == []


def test_lesson05_builds_module_keys_without_touching_cuda(cuda_calls):
    """Lesson 05's section-4 cell, run as the kernel runs it, with the CUDA probes recorded."""
    import nbformat

    from ddp_tutorial.records import format_table

    notebook = nbformat.read(REPO / "notebooks" / "05_checkpointing.ipynb", as_version=4)
    (cell,) = [c for c in notebook.cells if "states = {" in c.source and c.cell_type == "code"]
    namespace = {"torch": torch, "MLP": MLP, "format_table": format_table}
    exec(compile(cell.source, "05_checkpointing.ipynb:section 4", "exec"), namespace)
    assert cuda_calls == [], "lesson 05's key-building cell looked for GPUs"
    keys = [next(iter(s)) for s in namespace["states"].values()]
    assert [k.split(".")[0] for k in keys] == ["net", "module", "_orig_mod"]


def test_other_architecture_lists_keys_and_shapes(tmp_path):
    path = atomic_save(small_model().state_dict(), tmp_path / "mlp.pt")
    with pytest.raises(CheckpointError) as info:
        load_model_state(nn.Linear(8, 3), path)
    message = str(info.value)
    assert "mlp.pt" in message and "missing keys (2): weight, bias" in message
    assert "unexpected keys (6): net.1.weight" in message
    for strict in (True, False):  # no strictness loads a tensor of the wrong shape
        with pytest.raises(
            CheckpointError, match=r"shape mismatches.*\(3, 16\) vs model \(5, 16\)"
        ):
            load_model_state(MLP(8, 5, hidden=16), path, strict=strict)
    # non-strict: tolerated differences are returned, shapes still must fit
    bigger = nn.Sequential(OrderedDict(net=small_model().net, extra=nn.Linear(2, 2)))
    missing, unexpected = load_model_state(bigger, path, strict=False)
    assert missing == ["extra.weight", "extra.bias"] and unexpected == []
    with pytest.raises(CheckpointError, match="not a model state_dict"):
        load_model_state(small_model(), {"epoch": 3, "note": "no tensors"})


# --------------------------------------------------------------------------- RNG, epochs, snapshots


def test_rng_state_round_trip_through_a_file(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    path = atomic_save(capture_rng_state(), tmp_path / "rng.pt")
    first = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng_state(load_checkpoint(path))
    again = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    with pytest.raises(CheckpointError, match="not an RNG state"):
        restore_rng_state({"torch": torch.get_rng_state()})


def test_training_state_round_trip_in_one_process(tmp_path):
    model = small_model(6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = training_state(model, optimizer, epoch=2, step=10, batch_in_epoch=3)
    path = save_checkpoint(snapshot_path(tmp_path, 10), state)
    expected_noise = torch.rand(3)
    model2 = small_model(7)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    position = restore_training_state(load_checkpoint(path), model2, optimizer2)
    assert position == {"epoch": 2, "step": 10, "batch_in_epoch": 3, "sampler_epoch": 2}
    assert same_weights(model, model2)
    assert torch.equal(torch.rand(3), expected_noise), "RNG continues where it was saved"
    assert optimizer2.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0
    two_ranks = {**load_checkpoint(path), "rng": [capture_rng_state()] * 2}
    with pytest.raises(CheckpointError, match="RNG states of 2 rank"):
        restore_training_state(two_ranks, model2, optimizer2)
    with pytest.raises(CheckpointError, match="not a training state"):
        restore_training_state(model.state_dict(), model2)
    weights_only = training_state(model, None, epoch=0, step=0)  # no optimizer passed
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        restore_training_state(weights_only, model2, optimizer2)


def test_the_last_epoch_is_always_saved():
    """(Lesson 05 compares it with seed 001's condition on 100 epochs.)"""
    assert [e for e in range(7) if is_save_epoch(e, 7, 3)] == [2, 5, 6], "last one always"
    with pytest.raises(ValueError, match="save interval must be >= 1 epoch"):
        is_save_epoch(0, 10, 0)
    with pytest.raises(ValueError, match="epoch 10 is outside 0..9"):
        is_save_epoch(10, 10, 1)


def test_snapshots_latest_prune_and_stale_temp_files(tmp_path):
    assert latest_snapshot(tmp_path / "none") is None and latest_snapshot(tmp_path) is None
    for step in (5, 100, 20):
        atomic_save({"step": step}, snapshot_path(tmp_path, step))
    stale = temp_path_for(snapshot_path(tmp_path, 999))
    stale.write_bytes(b"half a file")  # what a killed writer leaves
    (tmp_path / "final.pt").write_bytes(b"")
    assert latest_snapshot(tmp_path) == snapshot_path(tmp_path, 100)
    assert [s for s, _ in list_snapshots(tmp_path)] == [5, 20, 100]
    assert stale_temp_files(tmp_path) == [stale]
    assert prune_snapshots(tmp_path, keep=2) == [snapshot_path(tmp_path, 5)]
    assert [s for s, _ in list_snapshots(tmp_path)] == [20, 100]
    with pytest.raises(ValueError, match="step must be >= 0"):
        snapshot_path(tmp_path, -1)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_snapshots(tmp_path, keep=0)  # would delete the snapshot a resume needs
    assert [s for s, _ in list_snapshots(tmp_path)] == [20, 100]


def test_a_resume_first_clears_what_killed_saves_left(tmp_path):
    """At start-up no save can be running: rank 0 deletes the temp files killed saves left."""
    from ddp_tutorial.snapshots import resume_point

    atomic_save({"step": 7}, snapshot_path(tmp_path, 7))
    stale = temp_path_for(snapshot_path(tmp_path, 9))
    stale.write_bytes(b"half a file")
    assert resume_point(tmp_path) == snapshot_path(tmp_path, 7)
    assert not stale.exists() and stale_temp_files(tmp_path) == []
    assert resume_point(None) is None


def test_a_resume_names_the_flags_that_move_its_schedule():
    from ddp_tutorial.snapshots import schedule_changes

    saved = {"epochs": 3, "batch_size": 32, "lr": 0.003, "seed": 0, "log_every": 50}
    now = {**saved, "epochs": 5, "seed": 1, "log_every": 10}
    assert schedule_changes(saved, now) == ["--epochs 3 -> 5"], "seed, logging: no schedule"
    assert schedule_changes(saved, saved) == []


def test_a_failed_save_outcome_raises_with_rank_0s_error():
    from ddp_tutorial.checkpoint import share_outcome

    share_outcome(None, "x.pt")  # success: nothing happens
    with pytest.raises(CheckpointError, match=r"rank 0 failed to save x.pt: OSError: \[Errno 27\]"):
        share_outcome(OSError(27, "File too large"), "x.pt")


# --------------------------------------------------------------------------- real ranks


SAVE_FAILS_ON_RANK0 = """
import argparse, sys
from ddp_tutorial.checkpoint import CheckpointError, save_checkpoint
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record

with process_group(backend="gloo", timeout_s=20) as info:
    try:
        save_checkpoint(sys.argv[1], {"args": argparse.Namespace(lr=1)})
    except CheckpointError as exc:
        write_rank_record(sys.argv[-1], {"error": str(exc)})
        raise
"""


@pytest.mark.gpu
def test_map_location_onto_each_ranks_gpu(tmp_path):
    from conftest import gpu_count

    result = torchrun(
        DEMOS / "load_anywhere.py",
        "--dir",
        tmp_path / "ck",
        nproc=gpu_count(),
        run_dir=tmp_path / "run",
        echo=False,
        timeout=180,
    )
    for record in result.records:
        assert record["saved_on"] == "cuda:0"
        assert record["landed"]["device"] == [record["device"]]
        assert record["landed"]["dict"] == [record["device"]]
        assert record["landed"]["cpu"] == ["cpu"]
        assert record["same_weights_everywhere"]


def test_each_rank_saves_and_restores_its_own_gpu_generator_only(monkeypatch):
    """A restart that sees another set (or number) of GPUs restores what this rank used."""
    calls = {"get": [], "set": []}
    device = {"current": 3}

    def get_rng_state(index):
        calls["get"].append(index)
        return torch.full((8,), index, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["current"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: calls["set"].append((s[0], i)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    state = capture_rng_state()
    assert calls["get"] == [3] and torch.equal(
        state["cuda"], torch.full((8,), 3, dtype=torch.uint8)
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # restarted on a 4-GPU node
    device["current"] = 1  # as local rank 1
    restore_rng_state(state)
    assert calls["set"] == [(3, 1)], "its own generator, onto its own device"
    with pytest.raises(CheckpointError, match="every visible GPU's generator"):
        restore_rng_state({**state, "cuda": [state["cuda"]] * 8})


AGREE = """
import os, sys
from pathlib import Path
from ddp_tutorial import snapshots
from ddp_tutorial.checkpoint import CheckpointError
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record

folder = Path(sys.argv[1])
with process_group(backend="gloo") as info:
    record = {}
    if info.rank == 1:  # this node's view of the folder lags: it sees only the older snapshot
        from ddp_tutorial._kit import kit
        kit.latest_snapshot = lambda d: snapshots.snapshot_path(d, 5)  # the kit's own global
    record["chosen"] = snapshots.agreed_latest_snapshot(folder).name
    record["best"] = snapshots.from_rank0(0.9 if info.rank == 0 else 0.5)  # best.json, lagging
    if info.rank == 1:  # and now the chosen file is not there at all on this node
        Path.is_file = lambda self: False
    try:
        snapshots.agreed_latest_snapshot(folder)
        record["error"] = None
    except CheckpointError as exc:
        record["error"] = str(exc)
    write_rank_record(sys.argv[-1], record)
"""


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """This file's real launches, side by side: most of each is start-up (import torch, join)."""
    from ddp_tutorial.harness.launch import LaunchSpec, run_together

    tmp = tmp_path_factory.mktemp("checkpoint-launches")
    for step in (5, 10):
        atomic_save({"step": step}, snapshot_path(tmp / "ck", step))
    (tmp / "save_fails.py").write_text(SAVE_FAILS_ON_RANK0)
    (tmp / "agree.py").write_text(AGREE)
    specs = {
        "save fails": LaunchSpec(tmp / "save_fails.py", [tmp / "c.pt"]),
        "agree": LaunchSpec(tmp / "agree.py", [tmp / "ck"]),
        # GPU-less here: every device is the CPU; on GPUs test_map_location_onto_each_ranks_gpu
        "load anywhere": LaunchSpec(DEMOS / "load_anywhere.py",
                                    ["--dir", tmp / "anywhere", "--backend", "gloo"]),
    }  # fmt: skip
    results = run_together({
        name: replace(spec, nproc=2, run_dir=tmp / name.replace(" ", "_"), echo=False,
                      timeout=180) for name, spec in specs.items()
    })  # fmt: skip
    results["tmp"] = tmp
    return results


@pytest.mark.torchrun
def test_a_failed_save_on_rank0_raises_on_every_rank_instead_of_hanging(launches):
    result = launches["save fails"]
    assert result.returncode != 0 and {f.rank for f in result.failures} == {0, 1}
    records = result.records
    assert [r["rank"] for r in records] == [0, 1]
    assert "argparse.Namespace" in records[0]["error"]
    assert records[1]["error"].startswith("rank 0 failed to save")
    assert not (launches["tmp"] / "c.pt").exists()


@pytest.mark.torchrun
def test_every_rank_resumes_from_the_snapshot_rank_0_chose(launches):
    result = launches["agree"]
    assert result.ok, result.output[-3000:]
    assert [r["chosen"] for r in result.records] == [snapshot_path(".", 10).name] * 2
    assert [r["best"] for r in result.records] == [0.9, 0.9], "rank 0's reading, on every rank"
    assert result.records[0]["error"] is None
    assert "rank 1 cannot read" in result.records[1]["error"]
    assert "the same checkpoint directory" in result.records[1]["error"]


@pytest.mark.torchrun
def test_each_rank_loads_rank_0s_file_onto_its_own_device_on_the_cpu(launches):
    """scripts/demos/load_anywhere.py on gloo: the three map_location forms, rank 0's weights."""
    result = launches["load anywhere"]
    assert result.ok, result.output[-3000:]
    for record in result.records:
        assert record["saved_on"] == "cpu" and record["device"] == "cpu"
        assert record["landed"] == {"device": ["cpu"], "dict": ["cpu"], "cpu": ["cpu"]}
        assert record["same_weights_everywhere"], "each rank began with its own weights"


REWRAP = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.nn  # noqa: F401  before init: the group can be freed at exit (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def model():  # an embedding, BatchNorm: gradients arrive out of registration order
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(50, 16), nn.Linear(16, 32), nn.BatchNorm1d(32),
                         nn.ReLU(), nn.Linear(32, 4))


def step4_grads(rank, rewrap):
    net = model()
    ddp, opt = DDP(net), torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, 50, (64, 5), generator=g), torch.randint(0, 4, (64,), generator=g)
    for step in range(4):
        if step == 3 and rewrap:  # a restart: the same weights, a new process's wrapper
            fresh = model()
            fresh.load_state_dict(net.state_dict())
            net, ddp = fresh, DDP(fresh)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[16 * step:16 * (step + 1)]),
                                    y[16 * step:16 * (step + 1)]).backward()
        opt.step()
    return [p.grad for p in net.parameters()]


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    same = [torch.equal(a, b) for a, b in zip(step4_grads(rank, False), step4_grads(rank, True))]
    if rank == 0:
        print(f"world {world}: {sum(same)} of {len(same)} gradients bitwise equal", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for world, port in zip((2, 3), sys.argv[1:]):
        mp.spawn(run, args=(world, int(port)), nprocs=world)
"""


@pytest.mark.torchrun
def test_a_restarts_first_step_is_bitwise_on_two_gloo_ranks_and_not_on_three(tmp_path):
    """Lesson 08's "bitwise" has a scope (a practitioner's review found it): DDP sums its first
    step in one bucket, the parameters in reverse registration order, and later steps in
    buckets rebuilt in the order backward produced the gradients. A restart's new wrapper
    sums its first step the first way, the run it continues summed that step the second way.
    Two ranks add a + b either way; three add in an order that follows the layout, so the
    step differs in the last bits (and the weights drift apart by rounding from there)."""
    from ddp_tutorial.distributed import free_port

    script = tmp_path / "rewrap.py"
    script.write_text(REWRAP)
    out = subprocess.run([sys.executable, str(script), str(free_port()), str(free_port())],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "world 2: 7 of 7 gradients bitwise equal" in lines, out.stdout
    assert any(line.startswith("world 3: ") and " 7 of 7 " not in line for line in lines), lines
