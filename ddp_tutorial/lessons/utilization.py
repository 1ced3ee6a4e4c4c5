"""Helpers of lesson 06 (training and utilization): where a step's time goes, per rank."""

from __future__ import annotations

from typing import Any


def step_breakdown(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per rank, mean ms per step of: extra work, DDP forward+backward (incl. waiting), step.

    For records holding per-step lists ``eval``, ``forward``, ``backward`` and
    ``step`` (seconds), as ``scripts/demos/imbalance.py`` writes them. A rank whose
    DDP time exceeds its peers' by roughly another rank's extra work spent that
    time waiting inside a collective.
    """
    rows = []
    for r in records:
        n = len(r["step"])
        rows.append(
            {
                "rank": r["rank"],
                "extra ms": 1000 * sum(r["eval"]) / n,
                "ddp ms": 1000 * (sum(r["forward"]) + sum(r["backward"])) / n,
                "step ms": 1000 * sum(r["step"]) / n,
            }
        )
    return rows
