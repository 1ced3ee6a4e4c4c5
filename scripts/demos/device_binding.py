"""What ``init_process_group(device_id=...)`` binds, and what it leaves alone.

GPU only, at least 2 GPUs; plain Python, one process:

    python scripts/demos/device_binding.py                # device_id=cuda:1 alone
    python scripts/demos/device_binding.py --set-device   # set_device(cuda:1) first

The process joins a process group of one (nccl, an in-memory store) with
``device_id=cuda:1``: the group is bound to that GPU and its NCCL
communicator is created there at once. Then it reports the current CUDA
device before and after, and where ``torch.ones(1).cuda()`` lands. The
current device is what ``set_device`` sets and ``device_id`` does not: with
``device_id`` alone, ``.cuda()`` and new CUDA tensors still go to ``cuda:0``
(a second CUDA context on GPU 0 in every rank of a real job). Prints one
JSON line. Lesson 03 runs both forms on a GPU machine.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set-device", action="store_true", help="torch.cuda.set_device first")
    parser.add_argument("--index", type=int, default=1, help="the GPU to bind (not 0)")
    args = parser.parse_args()
    if torch.cuda.device_count() <= args.index:
        raise SystemExit(f"needs cuda:{args.index}; {torch.cuda.device_count()} GPU(s) visible")
    device = torch.device("cuda", args.index)
    if args.set_device:
        torch.cuda.set_device(device)  # what the minimal script does first
    before = torch.cuda.current_device()
    dist.init_process_group("nccl", device_id=device, rank=0, world_size=1, store=dist.HashStore())
    after = torch.cuda.current_device()
    tensor = torch.ones(1).cuda()  # "the current device": whatever set_device said, else 0
    print(
        json.dumps(
            {
                "set_device": args.set_device,
                "device_id": str(device),
                "before": before,
                "after": after,
                "tensor": str(tensor.device),
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
