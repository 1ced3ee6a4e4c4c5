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

import torch
from torch.utils.data import Dataset

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
SyntheticImages = kit.SyntheticImages
EvalResult = kit.EvalResult
local_sums = kit.local_sums
distributed_evaluate = kit.distributed_evaluate

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


# --------------------------------------------------------------------------- evaluation
