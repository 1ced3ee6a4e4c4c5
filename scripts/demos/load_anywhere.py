"""A checkpoint written by rank 0 on its device, opened by every rank on *its* device.

Run it from the shell (meant for a GPU box; it also runs on CPU, where every
device is the CPU and the lesson is moot):

    torchrun --standalone --nproc-per-node 2 scripts/demos/load_anywhere.py --dir /tmp/anywhere

``torch.save`` records, for every tensor, the device it was on ("cuda:0"
when rank 0 saved from its GPU). ``torch.load`` puts it back there unless
``map_location`` says otherwise, so without it every rank's copy lands on
GPU 0 (extra memory on one card), and on a machine without CUDA the load
fails. Each rank loads the file three ways and records where the tensors
landed: ``map_location=info.device`` (what the course does),
``{"cuda:0": f"cuda:{local_rank}"}`` (seed 001's dict form), and ``"cpu"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.checkpoint import load_checkpoint, load_model_state, model_state, save_checkpoint
from ddp_tutorial.distributed import process_group
from ddp_tutorial.models import MLP
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory for the checkpoint")
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    path = Path(args.dir) / "rank0_weights.pt"
    with process_group(backend=args.backend) as info:
        torch.manual_seed(info.rank)  # different weights per rank: we can tell whose we got
        model = MLP(16, 4).to(info.device)
        save_checkpoint(path, model_state(model) if info.rank == 0 else None)
        saved_on = "cuda:0" if info.device.type == "cuda" else "cpu"
        ways = {
            "device": info.device,
            "dict": {saved_on: str(info.device)},
            "cpu": "cpu",
        }
        landed = {}
        for name, where in ways.items():
            state = load_checkpoint(path, map_location=where)
            landed[name] = sorted({str(t.device) for t in state.values()})
        load_model_state(model, path, map_location=info.device)  # now every rank has rank 0's
        checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        checksums = torch.zeros(info.world_size, dtype=torch.float64, device=info.device)
        checksums[info.rank] = checksum
        dist.all_reduce(checksums)
        write_rank_record(
            args.out,
            {
                "local_rank": info.local_rank,
                "device": str(info.device),
                "saved_on": saved_on,
                "landed": landed,
                "same_weights_everywhere": bool((checksums == checksums[0]).all()),
            },
        )


if __name__ == "__main__":
    main()
