"""Seed 001's optimizer fixed: Adam with ``betas=(0.0, 0.999)`` takes two steps.

    python scripts/demos/adam_betas.py

A process of its own, and not lesson 01's kernel, because on a machine with a GPU an Adam
step starts CUDA even for parameters on the CPU: it asks the accelerator's current stream
whether a CUDA graph is being captured (``_accelerator_graph_capture_health_check`` in
``torch/optim/optimizer.py``), and the lesson's kernel must stay free of CUDA. Prints one
JSON line for the lesson to check.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


def two_steps() -> dict[str, bool]:
    """Two steps on two different gradients; with beta1 = 0 the first moment is the latest."""
    layer = nn.Linear(4, 2)
    fixed_adam = torch.optim.Adam(layer.parameters(), lr=1e-3, betas=(0.0, 0.999))  # the fix
    start = layer.weight.detach().clone()
    for step in range(2):
        fixed_adam.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        layer(x).square().sum().backward()
        fixed_adam.step()
    first_moment = fixed_adam.state[layer.weight]["exp_avg"]
    return {
        "stepped": not torch.equal(layer.weight, start),
        "first_moment_is_latest_gradient": torch.equal(first_moment, layer.weight.grad),
        "cuda_initialized": torch.cuda.is_initialized(),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(json.dumps(two_steps()))


if __name__ == "__main__":
    main()
