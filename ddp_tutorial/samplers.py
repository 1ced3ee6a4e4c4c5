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
from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
UnpaddedDistributedSampler = kit.UnpaddedDistributedSampler
ResumableSampler = kit.ResumableSampler


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
