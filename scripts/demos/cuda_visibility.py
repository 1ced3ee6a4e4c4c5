"""When ``CUDA_VISIBLE_DEVICES`` takes effect: before CUDA initialises, never after.

GPU only; plain Python, one process:

    python scripts/demos/cuda_visibility.py --when before   # hides every GPU: 0 devices
    python scripts/demos/cuda_visibility.py --when after    # too late: still every GPU

Seed 000 sets ``os.environ["CUDA_VISIBLE_DEVICES"]`` inside the training
script. That works only if nothing has initialised CUDA yet in that process
— an import that touches the GPU is enough to make it silently useless. The
reliable place is the launcher's environment:
``CUDA_VISIBLE_DEVICES=5,6,7 torchrun ...``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--when", choices=("before", "after"), required=True)
    args = parser.parse_args()
    if args.when == "after":
        torch.zeros(1, device="cuda")  # CUDA initialises here, seeing every GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # "hide every GPU" — honoured only before init
    print(
        json.dumps(
            {
                "when": args.when,
                "cuda_available": torch.cuda.is_available(),
                "device_count": torch.cuda.device_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
