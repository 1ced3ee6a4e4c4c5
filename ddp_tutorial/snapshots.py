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

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
FORMAT_VERSION = kit.FORMAT_VERSION
SNAPSHOT_PATTERN = kit.SNAPSHOT_PATTERN
SCHEDULE_FLAGS = kit.SCHEDULE_FLAGS
capture_rng_state = kit.capture_rng_state
restore_rng_state = kit.restore_rng_state
gather_rng_states = kit.gather_rng_states
training_state = kit.training_state
restore_training_state = kit.restore_training_state
snapshot_path = kit.snapshot_path
list_snapshots = kit.list_snapshots
latest_snapshot = kit.latest_snapshot
from_rank0 = kit.from_rank0
prune_snapshots = kit.prune_snapshots
agreed_latest_snapshot = kit.agreed_latest_snapshot
resume_point = kit.resume_point
schedule_changes = kit.schedule_changes
