"""Seed 002's "2 MB on every card": which GPU a checkpoint lands on, and who holds contexts.

GPU only. Run it on a machine with at least 2 GPUs:

    torchrun --standalone --nproc-per-node 2 scripts/demos/cuda_contexts.py --mode stray
    torchrun --standalone --nproc-per-node 2 scripts/demos/cuda_contexts.py --mode clean

Rank 0 saves a checkpoint from ``cuda:0``; the storage remembers that device.
``--mode stray`` loads it the way seed 001 loads its pretrained weights
without a ``map_location``: every rank's copy lands on ``cuda:0``, so every
rank creates a CUDA context on GPU 0 — next to rank 0's. Seed 002 saw about
2 MB per card; a context is far larger today: when torch made lazy module
loading its default (pytorch/pytorch#86509, torch 1.13), a process holding one
small tensor used 287 MB of its GPU with it and 667 MB without, and the size
varies with the GPU, the driver and the CUDA version. ``--mode clean`` loads
with ``map_location=<this rank's device>``. After the load each rank reports
NVML's view: memory used and the pids with a context, per physical GPU, so the
run shows the size on your GPUs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.devices import gpu_memory_report
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("stray", "clean"), required=True)
    parser.add_argument(
        "--out", default="runs/cuda_contexts", help="run directory (also holds the checkpoint)"
    )
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_contexts.py needs CUDA GPUs; on a CPU there are no contexts to see")
    with process_group(backend="nccl") as info:  # binds cuda:LOCAL_RANK before init
        path = Path(args.out) / "weights.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        if info.is_main:
            torch.save({"w": torch.randn(1 << 20, device=info.device)}, path)  # from cuda:0
        dist.barrier()
        if args.mode == "stray":
            state = torch.load(path, weights_only=True)  # restores onto cuda:0, on every rank
        else:
            state = torch.load(path, map_location=info.device, weights_only=True)
        torch.cuda.synchronize()
        dist.barrier()  # every rank has loaded before anyone looks
        nvml_problems: list[str] = []  # a cgroup-restricted NVML refuses some GPUs: said, not fatal
        write_rank_record(
            args.out,
            {
                "mode": args.mode,
                "pid": os.getpid(),
                "device": str(info.device),
                "loaded_on": str(state["w"].device),
                "cuda_visible_devices": os.environ.get(VISIBLE_DEVICES_ENV),
                "nvml": gpu_memory_report(nvml_problems),
                "nvml_problems": nvml_problems,
            },
        )
        dist.barrier()  # nobody exits (and frees its context) before everyone has looked


if __name__ == "__main__":
    main()
