"""Small models for fast lessons, and torchvision's resnet18 for the template.

Lessons need models that train in seconds on a 2-core CPU; the template needs
a real architecture with BatchNorm (for SyncBatchNorm) that users recognise.
All are built with random weights: nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAMES = ("mlp", "cnn", "resnet18")


class MLP(nn.Module):
    """Flatten, two hidden layers, logits. Enough for the lessons' toy data."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks with BatchNorm, global pooling, a linear head.

    BatchNorm is there on purpose: it is the layer whose statistics differ
    across ranks without SyncBatchNorm (lesson 04).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def resnet18(num_classes: int, image_size: int = 32) -> nn.Module:
    """torchvision's resnet18, random init; small images keep their resolution.

    The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks a 32x32 image to
    8x8 before the first block; for small synthetic images a 3x3 stride-1 stem
    is the usual CIFAR-style adaptation.
    """
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    if image_size < 64:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def build_model(
    name: str, num_classes: int, image_size: int = 32, in_channels: int = 3
) -> nn.Module:
    """Build one of :data:`MODEL_NAMES` for ``in_channels x image_size x image_size`` inputs."""
    if name == "mlp":
        return MLP(in_channels * image_size * image_size, num_classes)
    if name == "cnn":
        return SmallCNN(in_channels, num_classes)
    if name == "resnet18":
        if in_channels != 3:
            raise ValueError(f"resnet18 takes 3 input channels, got {in_channels}")
        return resnet18(num_classes, image_size)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
