"""Data for the lessons: deterministic learnable datasets, sampler helpers, exact evaluation.

Three jobs, one module:

* **Datasets** that every rank can build on its own and get the *same*
  sample for the same index (generated from a seed and the index; nothing
  is downloaded), and that a model can actually learn — a course that
  trains on noise (seed 001's ``torch.rand`` images with random labels)
  cannot show a loss falling.
* **Sampler helpers** that compute what :class:`DistributedSampler` hands
  each rank, epoch by epoch, and count the padding it adds — the numbers
  lesson 02 asserts and draws.
* **Exact distributed evaluation.** ``DistributedSampler`` pads the dataset
  to a multiple of the world size by repeating indices, so a validation
  metric summed over ranks counts some samples twice.
  :class:`UnpaddedDistributedSampler` shards without padding (ranks may get
  one sample more or less), and :func:`distributed_evaluate` sums correct
  counts and losses with one ``all_reduce`` — every sample counted once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.models import unwrap_model

# --------------------------------------------------------------------------- datasets


class IndexDataset(Dataset[int]):
    """Item ``i`` is ``i``: lets a rank report exactly which indices its loader yielded."""

    def __init__(self, length: int):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for length {self.length}")
        return index


class GaussianBlobs(Dataset[tuple[torch.Tensor, int]]):
    """``num_classes`` overlapping Gaussian clusters in ``num_features`` dimensions.

    Built from ``seed`` alone, so every rank holds identical tensors. The
    clusters overlap on purpose (``spread``): a trained MLP gets most but not
    all samples right, so an accuracy that counts a sample twice is visibly
    different from the true one.
    """

    def __init__(
        self,
        num_samples: int,
        num_features: int = 16,
        num_classes: int = 4,
        seed: int = 0,
        spread: float = 1.5,
    ):
        if num_samples < 1 or num_features < 1 or num_classes < 2:
            raise ValueError(
                "GaussianBlobs needs num_samples >= 1, num_features >= 1, num_classes >= 2; "
                f"got {num_samples}, {num_features}, {num_classes}"
            )
        # The class centres do not depend on `seed`: seed=0 (train) and seed=1
        # (validation) draw different samples from the *same* clusters.
        gen = torch.Generator().manual_seed(7919 * num_classes + num_features)
        centers = torch.randn(num_classes, num_features, generator=gen)
        gen.manual_seed(seed)
        self.targets = torch.randint(0, num_classes, (num_samples,), generator=gen)
        noise = torch.randn(num_samples, num_features, generator=gen) * spread
        self.data = centers[self.targets] + noise
        self.num_classes = num_classes
        self.num_features = num_features

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.data[index], int(self.targets[index])


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Learnable synthetic images: each class is a coloured stripe pattern, plus noise.

    Class ``c`` has its own stripe orientation, stripe frequency and colour;
    each sample draws a random phase, contrast, colour jitter and pixel noise
    from a generator seeded with ``(seed, index)``; the class recipes are the
    same for every ``seed``, so use ``seed=0`` for training and ``seed=1`` for
    validation. So

    * sample ``i`` is the same tensor on every rank and in every epoch (no
      storage, no download, no shared random state to keep in sync);
    * a small CNN separates the classes within a few epochs (local stripe
      orientation and colour survive global pooling), while the noise keeps
      it from being instant.

    Images are ``float32`` of shape ``(channels, image_size, image_size)``,
    roughly zero-mean and unit-variance. ``difficulty`` scales the noise.
    """

    def __init__(
        self,
        num_samples: int = 2048,
        image_size: int = 32,
        num_classes: int = 10,
        channels: int = 3,
        seed: int = 0,
        difficulty: float = 1.0,
    ):
        if num_samples < 1 or image_size < 4 or num_classes < 2 or channels < 1:
            raise ValueError(
                "SyntheticImages needs num_samples >= 1, image_size >= 4, num_classes >= 2, "
                f"channels >= 1; got {num_samples}, {image_size}, {num_classes}, {channels}"
            )
        self.num_samples = num_samples
        self.image_size = image_size
        self.num_classes = num_classes
        self.channels = channels
        self.seed = seed
        self.difficulty = difficulty
        # Class "recipes" do not depend on `seed`: a train set (seed=0) and a
        # validation set (seed=1) must draw different samples of the *same* classes.
        gen = torch.Generator().manual_seed(10_007 * num_classes + channels)
        n_orient = max(2, math.ceil(num_classes / 2))
        c = torch.arange(num_classes)
        self.angles = math.pi * (c % n_orient).float() / n_orient
        self.freqs = torch.where(c < n_orient, 1 / 8, 1 / 4)  # cycles per pixel
        self.colors = torch.rand(num_classes, channels, generator=gen) * 1.5 + 0.25
        gen.manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=gen)
        coords = torch.arange(image_size, dtype=torch.float32)
        self._yy, self._xx = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        label = int(self.labels[index])
        gen = torch.Generator().manual_seed(1_000_003 * self.seed + index)
        phase, contrast, jitter = torch.rand(3, generator=gen)
        angle = self.angles[label] + (jitter - 0.5) * 0.2  # a little orientation jitter
        proj = self._xx * torch.cos(angle) + self._yy * torch.sin(angle)
        stripes = torch.sin(2 * math.pi * (self.freqs[label] * proj + phase))
        color = self.colors[label] * (0.8 + 0.4 * torch.rand(self.channels, generator=gen))
        image = (0.6 + 0.6 * contrast) * stripes * color[:, None, None]
        noise = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        image = image + self.difficulty * noise
        return image, label


# --------------------------------------------------------------------------- samplers


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
    dataset = IndexDataset(length)
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
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.length = len(dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        self.rank = rank
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


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class EvalResult:
    """Metrics over every rank's samples (``count``) and this rank's share."""

    accuracy: float
    loss: float
    correct: int
    count: int  # samples counted over all ranks
    local_count: int  # samples this rank evaluated


@torch.no_grad()
def local_sums(model: nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """``[correct, count, loss_sum]`` over one loader, as float64 (exact for counts < 2**53)."""
    # Evaluate the plain module: a DDP forward may sync buffers, a collective
    # that ranks with different batch counts would not all join.
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            sums[0] += (logits.argmax(dim=1) == y).sum()
            sums[1] += y.numel()
            sums[2] += nn.functional.cross_entropy(logits, y, reduction="sum").double()
    finally:
        model.train(was_training)
    return sums


def distributed_evaluate(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    *,
    exact: bool = True,
    num_workers: int = 0,
) -> EvalResult:
    """Accuracy and mean loss over ``dataset``, split across the ranks of the default group.

    ``exact=True``: :class:`UnpaddedDistributedSampler`, then one
    ``all_reduce(SUM)`` of ``[correct, count, loss_sum]`` — the same numbers a
    single process would compute, for any dataset length. ``exact=False`` is
    the naive version (seed 000's "do the same for val/test"): a padded
    :class:`DistributedSampler`, whose repeated samples are counted twice.
    Without a process group it evaluates the whole dataset in this process.
    Every rank must call it (it ends in a collective).
    """
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if exact:
        sampler: Sampler[int] = UnpaddedDistributedSampler(dataset, world, rank)
    else:
        sampler = DistributedSampler(dataset, world, rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
    sums = local_sums(model, loader, device)
    local_count = int(sums[1])
    if dist.is_initialized():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    correct, count, loss_sum = (float(v) for v in sums.cpu())
    return EvalResult(
        accuracy=correct / count if count else float("nan"),
        loss=loss_sum / count if count else float("nan"),
        correct=int(correct),
        count=int(count),
        local_count=local_count,
    )
