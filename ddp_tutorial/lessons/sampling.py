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


def draw_streams(records: list[dict], setting: str, key: str) -> dict[tuple[int, int], list[int]]:
    """``{(rank, worker): draws}``: what each DataLoader worker of each rank drew, in order.

    ``records`` are ``scripts/demos/sampling.py --pipelines`` rank records; ``key``
    is ``"crop"`` (the dataset's own numpy generator) or ``"flip"`` (torch's).
    """
    streams: dict[tuple[int, int], list[int]] = {}
    for record in records:
        for item in record["augment"][setting]:
            streams.setdefault((record["rank"], item["worker"]), []).append(item[key])
    return dict(sorted(streams.items()))
