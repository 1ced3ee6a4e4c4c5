"""Input pipelines that go wrong per rank and per worker: random augmentation, streams.

Two datasets lesson 02 runs in every rank, each through a DataLoader with
several workers, where the mistake is invisible in a single process:

* :class:`RandomCrops` draws a crop offset (from a numpy generator the
  dataset owns, as many augmentation libraries do) and a flip (from torch's
  generator) for every item. Seed every rank with the same number and leave
  the loader alone, and every rank draws the same crops; a dataset that
  owns a generator is also copied into every worker *with its state*, so every
  worker draws the same crops too. N ranks × W workers then add the variety
  of one. The fix is :mod:`ddp_tutorial.seeding`: a per-rank seed, a loader
  ``generator`` and ``worker_init_fn=seed_worker`` (which calls ``reseed``).
* :class:`NumberStream` is an ``IterableDataset`` (records read from a file
  or a web stream, in order). A ``DistributedSampler`` cannot split it —
  there are no indices to hand out — so every rank reads the whole stream,
  and every DataLoader worker of every rank reads it again. ``sharded=True``
  keeps every ``readers``-th record, where the readers are all workers of all
  ranks (:func:`shard_of`): every record is read exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RandomCrops(Dataset[dict[str, int]]):
    """Item ``i``: the random crop and flip an augmentation would apply to image ``i``.

    Only the random draws are returned (no pixels): they are what must differ
    between ranks and workers. ``seed`` seeds the dataset's own numpy generator.
    """

    def __init__(self, length: int, image_size: int = 32, crop: int = 24, seed: int = 0) -> None:
        self.length, self.span = length, image_size - crop + 1
        self.rng = np.random.default_rng(seed)

    def reseed(self, seed: int) -> None:
        """A new generator: :func:`ddp_tutorial.seeding.seed_worker` calls it in each worker."""
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, int]:
        top, left = (int(v) for v in self.rng.integers(0, self.span, size=2))
        flip = int(torch.randint(0, 2**16, ()).item())  # torch's generator: seeded per worker
        info = get_worker_info()
        worker = info.id if info is not None else -1  # -1: the rank's own process
        return {"index": index, "worker": worker, "crop": top * self.span + left, "flip": flip}


class OnePicture(Dataset[tuple[torch.Tensor, int]]):
    """Every item: one fixed picture, randomly cropped and maybe flipped, label 0.

    The crop and flip are drawn from torch's global generator, as torchvision's
    transforms draw them: whatever differs between two batches is augmentation,
    so two ranks' batches show whether their random streams differ (lesson 06).
    """

    picture = torch.linspace(0, 1, 3 * 24 * 24).reshape(3, 24, 24)

    def __init__(self, length: int = 64, crop: int = 16) -> None:
        self.length, self.crop = length, crop

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        span = self.picture.shape[-1] - self.crop + 1
        top, left = torch.randint(0, span, (2,)).tolist()
        image = self.picture[:, top : top + self.crop, left : left + self.crop]
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), 0


def shard_of(rank: int, world_size: int) -> tuple[int, int]:
    """``(reader, readers)`` of the calling DataLoader worker: which slice of a stream is its.

    Each of ``world_size`` ranks has ``num_workers`` workers (or reads in its
    main process: one reader); reader ``rank * num_workers + worker_id`` of
    ``world_size * num_workers`` takes every ``readers``-th record.
    """
    info = get_worker_info()
    workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
    return rank * workers + worker_id, world_size * workers


class NumberStream(IterableDataset[int]):
    """Records ``0 … length-1`` in order, as a file or network stream yields them.

    ``sharded=False`` is the mistake: every rank and every worker yields all
    of them. ``sharded=True`` yields this reader's slice only (:func:`shard_of`).
    Slices differ in length by at most one record when ``length`` is not a
    multiple of the readers: drop the remainder, or ranks run uneven steps
    (lesson 09's "uneven inputs").
    """

    def __init__(self, length: int, rank: int = 0, world_size: int = 1, sharded: bool = True):
        self.length, self.rank, self.world_size, self.sharded = length, rank, world_size, sharded

    def __iter__(self) -> Iterator[int]:
        records = iter(range(self.length))
        if not self.sharded:
            return records
        reader, readers = shard_of(self.rank, self.world_size)
        return islice(records, reader, None, readers)
