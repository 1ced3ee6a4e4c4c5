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

from torch.utils.data import get_worker_info  # noqa: F401  lesson 02's stand-in patches it

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
rank_seed = kit.rank_seed
seed_everything = kit.seed_everything
loader_generator = kit.loader_generator
seed_worker = kit.seed_worker


def seed_rank(seed: int, rank: int) -> int:
    """Give this rank its own streams (call *after* building the model); returns the seed."""
    own = rank_seed(seed, rank)
    seed_everything(own)
    return own
