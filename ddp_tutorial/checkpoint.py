"""Checkpoints that survive DDP: one atomic writer, safe loading, exact resume.

Three things go wrong when every rank of a DDP job calls ``torch.save``:

* **Concurrent writers.** Every rank (or, with seed 000's ``local_rank == 0``
  guard, one rank per node) opens the same path on a shared disk and writes it
  at the same time. The file that is left can interleave bytes from different
  writers: a load fails (``PytorchStreamReader failed …``, seed 000's
  "storage has wrong size") or, worse, silently returns a mix of two states.
* **Crashes mid-save.** ``torch.save(obj, path)`` truncates ``path`` first and
  then writes it; a process killed in between leaves neither the old nor the
  new checkpoint, only a file cut short.
* **Unsafe loading.** ``torch.load`` unpickles, and unpickling can run any
  code the file names. ``weights_only=True`` only rebuilds tensors and plain
  Python values, so checkpoints must contain nothing else.

This module is what every script in the course uses:

* :func:`save_checkpoint` — call it on **every** rank; only global rank 0 writes,
  atomically (temp file, fsync, ``os.replace``), then all ranks learn its outcome:
  nobody reads early, and a failure on rank 0 is raised on every rank, not a hang.
* :func:`load_checkpoint` — ``weights_only=True`` and ``map_location``;
  every problem becomes a :class:`CheckpointError` that names the file and says
  what is wrong (missing, truncated/corrupt, an object ``weights_only`` refuses).
* :func:`load_model_state` — strips ``module.`` (DDP/DataParallel) and
  ``_orig_mod.`` (``torch.compile``) with torch's
  ``consume_prefix_in_state_dict_if_present`` and checks keys strictly,
  listing missing/unexpected keys and shape mismatches.

What goes *into* a resumable checkpoint (optimizer, position, RNG states) and how
snapshot folders are kept is :mod:`ddp_tutorial.snapshots`; this module makes files safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
CheckpointError = kit.CheckpointError
PathLike = kit.PathLike
TEMP_SUFFIX = kit.TEMP_SUFFIX
WRAPPER_PREFIXES = kit.WRAPPER_PREFIXES
find_unsafe = kit.find_unsafe
atomic_save = kit.atomic_save
temp_path_for = kit.temp_path_for
group_active = kit.group_active
share_outcome = kit.share_outcome
load_checkpoint = kit.load_checkpoint
model_state = kit.model_state
strip_prefixes = kit.strip_prefixes
describe_mismatch = kit.describe_mismatch
load_model_state = kit.load_model_state
stale_temp_files = kit.stale_temp_files


def save_checkpoint(path: PathLike, state: Any, check_plain: bool = True) -> Path:
    """Save ``state`` to ``path`` from global rank 0, atomically; a collective in a job.

    Call it on **every** rank: rank 0 writes with :func:`atomic_save`, then
    :func:`share_outcome`. Not ``local_rank == 0``: one writer per node, and nodes
    sharing a disk write one file at once. Other ranks may pass ``state=None``.
    """
    path, failure = Path(path), None
    if not group_active():
        return atomic_save(state, path, check_plain)
    if dist.get_rank() == 0:
        try:
            atomic_save(state, path, check_plain)
        except Exception as exc:  # reported to every rank below
            failure = exc
    share_outcome(failure, path)
    return path


def is_save_epoch(epoch: int, epochs: int, every: int) -> bool:
    """Should the end of 0-based ``epoch`` (of ``epochs``) be saved, saving every ``every``?

    Seed 001 saves when ``epoch % save_epoch == 0 and epoch != 0``: with 100
    epochs and ``save_epoch=10`` it saves after epochs 10, 20, … 90 (0-based,
    so after 11, 21, … 91 epochs of training) and **never** the last nine:
    the final model is lost. Count finished epochs instead, and always save
    the last one.
    """
    if every < 1:
        raise ValueError(f"save interval must be >= 1 epoch, got {every}")
    if not 0 <= epoch < epochs:
        raise ValueError(f"epoch {epoch} is outside 0..{epochs - 1}")
    done = epoch + 1
    return done % every == 0 or done == epochs
