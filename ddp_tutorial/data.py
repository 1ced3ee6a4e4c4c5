"""Data for the lessons: deterministic learnable datasets and exact evaluation.

Two jobs, one module (what each rank reads is :mod:`ddp_tutorial.samplers`):

* **Datasets** that every rank can build on its own and get the *same*
  sample for the same index (generated from a seed and the index; nothing
  is downloaded), and that a model can actually learn — a course that
  trains on noise (seed 001's ``torch.rand`` images with random labels)
  cannot show a loss falling.
* **Exact distributed evaluation.** ``DistributedSampler`` pads the dataset
  to a multiple of the world size by repeating indices, so a validation
  metric summed over ranks counts some samples twice.
  :class:`~ddp_tutorial.samplers.UnpaddedDistributedSampler` shards without padding (ranks may get
  one sample more or less), and :func:`distributed_evaluate` sums correct
  counts and losses with one ``all_reduce`` — every sample counted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.models import unwrap_model
from ddp_tutorial.samplers import UnpaddedDistributedSampler

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
    pin_memory: bool = False,
) -> EvalResult:
    """Accuracy and mean loss over ``dataset``, split across the ranks of the default group.

    ``exact=True``: :class:`UnpaddedDistributedSampler`, then one
    ``all_reduce(SUM)`` of ``[correct, count, loss_sum]`` — the same numbers a
    single process would compute, for any dataset length. ``exact=False`` is
    the naive version (seed 000's "do the same for val/test"): a padded
    :class:`DistributedSampler`, whose repeated samples are counted twice.
    Without a process group it evaluates the whole dataset in this process.
    Every rank must call it (it ends in a collective). ``num_workers`` and
    ``pin_memory`` (GPUs) go to its DataLoader, as for training.
    """
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if exact:
        sampler: Sampler[int] = UnpaddedDistributedSampler(dataset, world, rank)
    else:
        sampler = DistributedSampler(dataset, world, rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        pin_memory=pin_memory)  # fmt: skip
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
