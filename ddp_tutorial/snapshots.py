"""What an exact resume needs, and the folder of snapshots it resumes from.

:mod:`ddp_tutorial.checkpoint` makes a file safe (one atomic writer, safe
loading); this module decides what goes into a resumable snapshot and how a
folder of them is kept:

* :func:`training_state` / :func:`restore_training_state` — model, optimizer,
  AMP scaler, epoch, step, position in the epoch, the sampler's epoch and
  every rank's RNG states;
* :func:`snapshot_path`, :func:`latest_snapshot`, :func:`prune_snapshots`,
  :func:`resume_point` — ``snapshot-<step>.pt`` files in one folder;
* :func:`schedule_changes` — the flags of a resumed run that change its schedule.

A training-state checkpoint is a plain dict (format :data:`FORMAT_VERSION`)::

    {"format": 1, "model": {...}, "optimizer": {...}, "scaler": {...} | None,
     "epoch": int,            # the epoch to run next (or the one in progress)
     "step": int,             # optimizer steps done in total
     "batch_in_epoch": int,   # batches of `epoch` already consumed (0 at an epoch boundary)
     "sampler_epoch": int,    # the value passed to sampler.set_epoch
     "world_size": int, "rng": [per-rank capture_rng_state()], "extra": {...}}
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_tutorial.checkpoint import (
    CheckpointError,
    PathLike,
    group_active,
    load_model_state,
    model_state,
    stale_temp_files,
)

FORMAT_VERSION = 1
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d+)\.pt$")


# --------------------------------------------------------------------------- RNG states


def capture_rng_state() -> dict[str, Any]:
    """This process's random number generator states, as tensors and plain values.

    torch (CPU), this rank's own CUDA device when CUDA is initialised (the
    current device: ``cuda:LOCAL_RANK``), Python's ``random`` and numpy's
    global generator (when numpy is installed). Noise augmentation, dropout and
    DataLoader worker seeds all draw from these: an exact resume must put them
    back. Only the rank's own device: a restart that sees other GPUs, or
    another number of them, still restores the generator this rank used.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` captured (the inverse, exactly)."""
    try:
        torch.set_rng_state(state["torch"].cpu())
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"not an RNG state from capture_rng_state(): {exc}") from None
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, list | tuple):
            raise CheckpointError(
                "this RNG state holds every visible GPU's generator (an older snapshot); "
                "only the rank's own device can be restored safely: resume with "
                "restore_rng=False, or from a snapshot written by this version"
            )
        torch.cuda.set_rng_state(cuda.cpu(), torch.cuda.current_device())
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        import numpy as np

        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].cpu().numpy().astype(np.uint32),  # map_location may be a GPU
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`capture_rng_state`, indexed by rank (a collective in a job).

    Rank 0 writes the checkpoint, but each rank's generators are different
    (different dropout masks, noise): all of them must be saved for an exact
    resume. Without a process group: a list of one.
    """
    mine = capture_rng_state()
    if not group_active() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return [
        {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in states
    ]


# --------------------------------------------------------------------------- training state


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    epoch: int,
    step: int,
    batch_in_epoch: int = 0,
    sampler_epoch: int | None = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything needed to continue training exactly; a collective (gathers RNG states).

    Call on every rank, then pass the result to :func:`save_checkpoint`.
    ``epoch`` is the epoch to run next, or the one in progress with
    ``batch_in_epoch`` batches of it already done (a mid-epoch snapshot).
    """
    world_size = dist.get_world_size() if group_active() else 1
    return {
        "format": FORMAT_VERSION,
        "model": model_state(model),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": int(epoch),
        "step": int(step),
        "batch_in_epoch": int(batch_in_epoch),
        "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
        "world_size": world_size,
        "rng": gather_rng_states(),
        "extra": dict(extra or {}),
    }


def restore_training_state(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    restore_rng: bool = True,
) -> dict[str, int]:
    """Load a :func:`training_state` back; returns its epoch/step/batch_in_epoch/sampler_epoch.

    This rank gets its own RNG state back; with a different world size that
    is impossible and :class:`CheckpointError` says so (pass
    ``restore_rng=False`` to continue with fresh random streams, not exactly).
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"not a training state of format {FORMAT_VERSION} "
            f"(keys: {list(state)[:8] if isinstance(state, Mapping) else type(state).__name__})"
        )
    load_model_state(model, state, strict=True)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise CheckpointError("the training state holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    if restore_rng:
        rank = dist.get_rank() if group_active() else 0
        world_size = dist.get_world_size() if group_active() else 1
        rngs = state["rng"]
        if len(rngs) != world_size:
            raise CheckpointError(
                f"the checkpoint holds RNG states of {len(rngs)} rank(s) but this job has "
                f"{world_size}: an exact resume needs the same world size "
                f"(or pass restore_rng=False)"
            )
        restore_rng_state(rngs[rank])
    return {k: int(state[k]) for k in ("epoch", "step", "batch_in_epoch", "sampler_epoch")}


# --------------------------------------------------------------------------- snapshots


def snapshot_path(directory: PathLike, step: int) -> Path:
    """``directory/snapshot-000000123.pt``: zero-padded so names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(directory) / f"snapshot-{step:09d}.pt"


def list_snapshots(directory: PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every snapshot in ``directory``, oldest first (temp files ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        match = SNAPSHOT_PATTERN.match(p.name)
        if match and p.is_file():
            found.append((int(match.group(1)), p))
    return sorted(found)


def latest_snapshot(directory: PathLike) -> Path | None:
    """The snapshot with the highest step in ``directory``, or None (nothing to resume)."""
    snapshots = list_snapshots(directory)
    return snapshots[-1][1] if snapshots else None


def prune_snapshots(directory: PathLike, keep: int = 2) -> list[Path]:
    """Delete all but the newest ``keep`` snapshots (call on rank 0); returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed = []
    for _, path in list_snapshots(directory)[:-keep]:
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def agreed_latest_snapshot(directory: PathLike | None) -> Path | None:
    """The newest snapshot as global rank 0 sees it, the same path on every rank.

    Each rank listing the folder itself can pick different snapshots: on a
    cached or eventually consistent filesystem a node may not see the newest
    file yet, and ranks that resume from different steps train different
    models without any error. Rank 0 chooses and broadcasts (a collective: call
    it on every rank); a rank that cannot read the chosen file fails with a
    message that says why, instead of resuming from something else.
    """
    choice: list[str | None] = [None]
    if not group_active() or dist.get_rank() == 0:
        latest = latest_snapshot(directory) if directory is not None else None
        choice = [str(latest) if latest is not None else None]
    if group_active() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path = Path(choice[0])
    if not path.is_file():
        rank = dist.get_rank() if group_active() else 0
        raise CheckpointError(
            f"rank {rank} cannot read {path}, the snapshot rank 0 resumes from: every node "
            f"must see the same checkpoint directory (a shared filesystem, not a per-node copy)"
        )
    return path


def resume_point(directory: PathLike | None) -> Path | None:
    """:func:`agreed_latest_snapshot`, after rank 0 removed what killed saves left (a collective).

    A rank killed mid-save leaves a hidden temp file (``checkpoint.temp_path_for``)
    that nothing ever reads; at start-up no save can be running, so rank 0
    deletes them before anyone looks for the newest snapshot.
    """
    if directory is not None and (not group_active() or dist.get_rank() == 0):
        for stale in stale_temp_files(directory):
            stale.unlink(missing_ok=True)
    return agreed_latest_snapshot(directory)


SCHEDULE_FLAGS = ("epochs", "batch_size", "grad_accum", "lr", "warmup", "optimizer")
"""Flags whose change moves the LR schedule or the steps of an epoch under a resumed run."""


def schedule_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``["--epochs 3 -> 5", ...]``: what a resume changes of the saved run's schedule.

    Resuming with other values is allowed (extending a run is common) but the
    LR schedule then jumps: the step that resumes sits at another point of it.
    """
    return [
        f"--{k.replace('_', '-')} {saved[k]} -> {now.get(k)}"
        for k in SCHEDULE_FLAGS
        if k in saved and saved[k] != now.get(k)
    ]
