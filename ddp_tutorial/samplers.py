"""Samplers: what each rank reads, epoch by epoch — counted, exact, resumable.

* :func:`sampler_shards`, :func:`shard_report`, :func:`expected_padding`,
  :func:`batch_plan` compute what :class:`DistributedSampler` hands each rank
  and count the padding it adds — the numbers lesson 02 asserts and draws.
* :class:`UnpaddedDistributedSampler` shards without padding, for exact
  evaluation (:func:`ddp_tutorial.data.distributed_evaluate`).
* :class:`ResumableSampler` is the training template's sampler: the same
  shards as ``DistributedSampler``, but it can start part-way into an epoch,
  on the same or a different number of ranks, and still hand out every
  sample of that epoch once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


def sampler_shards(
    length: int,
    world_size: int,
    epochs: int = 1,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    set_epoch: bool = True,
) -> list[list[list[int]]]:
    """``shards[epoch][rank]``: the indices a real :class:`DistributedSampler` yields.

    Built with explicit ``num_replicas``/``rank``, so no process group is
    needed: this is exactly what each rank of a ``world_size`` job sees.
    ``set_epoch=False`` reproduces a loop that forgets ``sampler.set_epoch``.
    """
    if world_size < 1 or epochs < 1:
        raise ValueError(f"world_size and epochs must be >= 1, got {world_size}, {epochs}")
    dataset = range(length)  # all a sampler needs is len()
    samplers = [
        DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=r,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        for r in range(world_size)
    ]
    shards = []
    for epoch in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(epoch)
        shards.append([list(s) for s in samplers])
    return shards


@dataclass(frozen=True)
class ShardReport:
    """How one epoch's shards relate to the dataset ``range(length)``."""

    length: int
    world_size: int
    per_rank: list[int]  # samples each rank receives
    total: int  # sum over ranks
    duplicates: list[int]  # indices handed out more than once (padding)
    missing: list[int]  # indices nobody receives (drop_last)

    @property
    def disjoint(self) -> bool:
        """No index goes to two ranks (or twice to one)."""
        return not self.duplicates

    @property
    def covering(self) -> bool:
        """Every index goes to some rank."""
        return not self.missing

    @property
    def partition(self) -> bool:
        """Disjoint and covering: each sample seen exactly once per epoch."""
        return self.disjoint and self.covering

    @property
    def padded(self) -> int:
        """Extra samples handed out beyond the dataset (repeats)."""
        return self.total - (self.length - len(self.missing))


def shard_report(shards: Sequence[Sequence[int]], length: int) -> ShardReport:
    """Check one epoch's ``shards[rank]`` against ``range(length)``."""
    counts = Counter(i for shard in shards for i in shard)
    outside = sorted(i for i in counts if not 0 <= i < length)
    if outside:
        raise ValueError(f"shards contain indices outside range({length}): {outside[:5]}")
    return ShardReport(
        length=length,
        world_size=len(shards),
        per_rank=[len(s) for s in shards],
        total=sum(counts.values()),
        duplicates=sorted(i for i, n in counts.items() if n > 1),
        missing=[i for i in range(length) if i not in counts],
    )


def expected_padding(length: int, world_size: int, drop_last: bool = False) -> dict[str, int]:
    """DistributedSampler's arithmetic: per-rank size, and how many samples it adds or drops."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if drop_last:
        per_rank = length // world_size
        return {"per_rank": per_rank, "padded": 0, "dropped": length - per_rank * world_size}
    per_rank = math.ceil(length / world_size)
    return {"per_rank": per_rank, "padded": per_rank * world_size - length, "dropped": 0}


def batch_plan(
    length: int, per_rank_batch: int, world_size: int, drop_last: bool = False
) -> dict[str, int]:
    """How one epoch is cut into steps: in DDP ``batch_size`` is *per process*.

    Every step consumes ``per_rank_batch`` samples on each of ``world_size``
    ranks, so the global batch (what the optimizer effectively averages over)
    is their product, and the steps per epoch shrink as ranks are added.
    (``DataParallel`` is the opposite: one process, and its ``batch_size`` is
    the global batch that it splits across ``device_ids``.)
    """
    if per_rank_batch < 1 or world_size < 1:
        raise ValueError(f"batch and world size must be >= 1, got {per_rank_batch}, {world_size}")
    per_rank = expected_padding(length, world_size, drop_last)["per_rank"]
    return {
        "world_size": world_size,
        "per_rank_batch": per_rank_batch,
        "global_batch": per_rank_batch * world_size,
        "samples_per_rank": per_rank,
        "steps_per_epoch": math.ceil(per_rank / per_rank_batch),
    }


class UnpaddedDistributedSampler(Sampler[int]):
    """Like :class:`DistributedSampler`, but no padding: every index exactly once in total.

    Rank ``r`` takes ``order[r::world_size]``, so ranks differ by at most
    one sample. Use it for **evaluation** only: in training, DDP needs every
    rank to run the same number of backward passes (each one is an
    all_reduce), and a rank with one batch fewer would leave the others
    waiting — that is why the training sampler pads.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.length = len(dataset)  # type: ignore[arg-type]
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen).tolist()
        else:
            order = list(range(self.length))
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit values, else the default group's (a world of one without a group)."""
    if num_replicas is None:
        num_replicas = dist.get_world_size() if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    return num_replicas, rank


class ResumableSampler(Sampler[int]):
    """``DistributedSampler(shuffle=True)``'s shards, resumable mid-epoch on any world size.

    An epoch's order is one seeded permutation of the whole dataset, the same
    on every rank (``seed + epoch``). Rank ``r`` of ``N`` takes positions
    ``r, r+N, r+2N, …``, so after ``k`` steps of per-rank batch ``B`` the job
    has consumed exactly the first ``k·B·N`` positions of that order —
    whatever ``N`` was. ``set_epoch(epoch, consumed)`` starts there: the rest
    of the order is padded the way ``DistributedSampler`` pads (repeating its
    start) to a multiple of *this* world size and dealt out again. A restart
    on 4 ranks of an epoch that 8 began sees every remaining sample once; with
    ``consumed=0`` it yields exactly what ``DistributedSampler`` yields.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.length = len(dataset)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Start ``epoch`` after its first ``consumed`` samples (counted over all ranks).

        ``consumed`` counts the padding too: a snapshot of an epoch's last step can
        hold more than the dataset (9 samples on 2 ranks are dealt out as 10), and
        then nothing of the epoch is left, on any number of ranks.
        """
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        self.epoch, self.consumed = epoch, min(consumed, self.length)

    def _rest(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen).tolist()
        else:
            order = list(range(self.length))
        rest = order[self.consumed :]
        padding = -len(rest) % self.num_replicas
        if rest and padding:
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._rest()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return math.ceil((self.length - self.consumed) / self.num_replicas)
