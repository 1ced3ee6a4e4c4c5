"""An inference script that never saw FSDP: load a saved model into a plain one (lesson 12).

    python scripts/demos/load_plain.py runs/sharding/final.pt

What a user runs after training: build the model, ``torch.load(...,
weights_only=True)``, ``load_state_dict``. It works on ``final.pt`` (a full
state_dict of plain tensors, from ``get_model_state_dict(...,
full_state_dict=True)``) and fails on rank 0's ``model.state_dict()`` of an
FSDP2 model (DTensors, and only rank 0's shards of them). ``torch.load``
refuses that file first because DTensor's class is not registered as safe
until ``torch.distributed.tensor`` is imported; ``--import-dtensor`` imports
it (``weights_only=True`` kept, the safe way past the refusal), and the load
then fails at ``load_state_dict``. Otherwise it imports nothing of
torch.distributed on purpose: neither does a user's inference script.
"""

from __future__ import annotations

import argparse
import importlib

import torch

from ddp_tutorial.lessons.anatomy import deep_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a file written by torch.save")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--import-dtensor",
        action="store_true",
        help="import torch.distributed.tensor first (DTensors safe to load)",
    )
    args = parser.parse_args()
    if args.import_dtensor:
        importlib.import_module("torch.distributed.tensor")  # registers DTensor as safe
    model = deep_mlp(0, width=args.width, depth=args.depth)
    state = torch.load(args.path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    count = sum(p.numel() for p in model.parameters())
    print(f"{args.path}: {len(state)} tensors, {count} parameters loaded into a plain model")


if __name__ == "__main__":
    main()
