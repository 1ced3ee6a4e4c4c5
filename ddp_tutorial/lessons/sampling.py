"""Helpers of lesson 02 (data and sampling): a model trained in one process, quickly."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def train_classifier(
    model: nn.Module,
    dataset: Dataset,
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Single-process Adam training; returns the mean loss of each epoch.

    For lessons and tests that need a trained model quickly (the kernel or a
    test trains it, the ranks evaluate it). Deterministic for a given seed.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    torch.manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(epochs):
        total, n = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            n += len(y)
        losses.append(total / n)
    return losses
