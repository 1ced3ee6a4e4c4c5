"""An inference script that never saw FSDP: load a saved model into a plain one (lesson 12).

    python scripts/demos/load_plain.py runs/sharding/final.pt

What a user runs after training: build the model, ``torch.load(...,
weights_only=True)``, ``load_state_dict``. It works on ``final.pt`` (a full
state_dict of plain tensors, from ``get_model_state_dict(...,
full_state_dict=True)``) and fails on rank 0's ``model.state_dict()`` of an
FSDP2 model (DTensors, and only rank 0's shards of them) — also with
``--trust-file``, the ``weights_only=False`` that torch's error message
suggests (it runs code from the file: only ever for files you wrote). It
imports nothing of torch.distributed on purpose: neither does a user's
inference script.
"""

from __future__ import annotations

import argparse

import torch

from ddp_tutorial.lessons.anatomy import deep_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a file written by torch.save")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--trust-file", action="store_true", help="weights_only=False")
    args = parser.parse_args()
    model = deep_mlp(0, width=args.width, depth=args.depth)
    state = torch.load(args.path, map_location="cpu", weights_only=not args.trust_file)
    model.load_state_dict(state)
    count = sum(p.numel() for p in model.parameters())
    print(f"{args.path}: {len(state)} tensors, {count} parameters loaded into a plain model")


if __name__ == "__main__":
    main()
