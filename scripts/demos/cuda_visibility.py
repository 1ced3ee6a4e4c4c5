"""When ``CUDA_VISIBLE_DEVICES`` takes effect: before CUDA initialises, never after.

GPU only; plain Python, one process:

    python scripts/demos/cuda_visibility.py --when before   # hides every GPU: 0 devices
    python scripts/demos/cuda_visibility.py --when after    # too late: still every GPU
    python scripts/demos/cuda_visibility.py --when after-is-available   # too late as well

Seed 000 sets ``os.environ["CUDA_VISIBLE_DEVICES"]`` inside the training
script. That works only if nothing has initialised CUDA yet in that process
— an import that touches the GPU is enough to make it silently useless, and so
is ``torch.cuda.is_available()``: it asks the CUDA runtime for the GPU count,
which starts the driver, and the driver reads the variable then, though torch
still says CUDA is not initialised (and ``device_count()``, which asks NVML
until torch initialises CUDA, counts the new value: 0 here). The
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
    parser.add_argument("--when", choices=("before", "after", "after-is-available"), required=True)
    args = parser.parse_args()
    if args.when == "after":
        torch.zeros(1, device="cuda")  # CUDA initialises here, seeing every GPU
    elif args.when == "after-is-available":
        torch.cuda.is_available()  # the driver starts here, seeing every GPU
    report = {"when": args.when, "initialized_before": torch.cuda.is_initialized()}
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # "hide every GPU" — honoured only before init
    report["device_count"] = torch.cuda.device_count()  # before torch initialises CUDA: NVML's
    try:
        torch.zeros(1, device="cuda")  # a GPU still usable if the setting came too late
        report["tensor_on_gpu"] = True
    except RuntimeError as exc:
        report["tensor_on_gpu"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    report["device_count_in_use"] = torch.cuda.device_count() if torch.cuda.is_initialized() else 0
    print(json.dumps(report))


if __name__ == "__main__":
    main()
