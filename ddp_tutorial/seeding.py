"""Random streams per rank and per DataLoader worker: the same model, different noise.

A DDP job wants *one* random thing shared and everything else different:

* the initial weights: the same on every rank (``torch.manual_seed(seed)``
  before building the model; DDP's constructor broadcasts rank 0's weights
  anyway, but identical construction makes that a no-op you can check);
* dropout masks and data augmentation: *different* on every rank, or the
  ranks augment their shards in lock-step — N ranks then add the variety of
  one. Seeding every rank with the same number (the usual
  ``torch.manual_seed(42)`` at the top of a script) does exactly that;
* DataLoader workers: torch seeds each worker's ``torch``, ``random`` and
  ``numpy`` from a *base seed* plus the worker id, and draws the base seed
  from the loader's ``generator`` (else from the global generator, which is
  the same on every identically seeded rank). :func:`loader_generator` makes
  it a function of ``(seed, rank, epoch)``: different per rank, reproducible
  on a rerun and after a restart.

A dataset that owns a generator (``np.random.default_rng(seed)`` built in
``__init__``) is copied into every worker *with its state*: every worker
then draws the same numbers. :func:`seed_worker` calls its ``reseed(seed)``
with the worker's own seed.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import get_worker_info


def rank_seed(seed: int, rank: int, *streams: int) -> int:
    """A 63-bit seed derived from ``(seed, rank, *streams)``: distinct inputs, unrelated seeds.

    ``seed + rank`` would make rank 1 of seed 0 the same stream as rank 0 of
    seed 1; a hash of the tuple (numpy's ``SeedSequence``) does not.
    """
    words = np.random.SeedSequence([seed, rank, *streams]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), Python's ``random`` and numpy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def seed_rank(seed: int, rank: int) -> int:
    """Give this rank its own streams (call *after* building the model); returns the seed."""
    own = rank_seed(seed, rank)
    seed_everything(own)
    return own


def loader_generator(seed: int, rank: int, epoch: int = 0) -> torch.Generator:
    """A DataLoader ``generator`` whose worker seeds depend on ``(seed, rank, epoch)`` only."""
    return torch.Generator().manual_seed(rank_seed(seed, rank, epoch, 1))


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: hand the worker's own seed to a dataset that keeps a generator.

    torch has already seeded ``torch``, ``random`` and ``numpy`` in the worker
    (base seed + ``worker_id``); a ``reseed(seed)`` method on the dataset is
    how a generator the dataset owns gets a different seed in every worker.
    """
    info = get_worker_info()
    reseed = getattr(info.dataset, "reseed", None) if info is not None else None
    if callable(reseed):
        reseed(info.seed)
