"""The first launch: every rank says who it is, then the ranks sum their ranks.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/hello.py

Each rank reads its identity from the environment torchrun prepared (RANK,
LOCAL_RANK, WORLD_SIZE), joins the process group, and takes part in one
all_reduce: the sum of all ranks, 0 + 1 = 1 with two ranks. With ``--out DIR``
each rank also writes ``DIR/rank{r}.json`` for the notebook to check.

The smallest ``torch.distributed`` program: processes that talk, no model and no
DDP yet (``scripts/minimal_ddp.py`` is the smallest DDP training script).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


@record  # on failure, torchrun's summary shows this rank's traceback
def main() -> None:
    args = parse_args()
    with process_group(backend=args.backend) as info:
        value = torch.tensor([float(info.rank)], device=info.device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # every rank receives the sum
        print(
            f"rank {info.rank}/{info.world_size} (local {info.local_rank}) on "
            f"{socket.gethostname()} pid {os.getpid()}: backend {info.backend}, "
            f"device {info.device}, all_reduce(sum of ranks) = {value.item():g}",
            flush=True,
        )
        write_rank_record(
            args.out,
            {
                "local_rank": info.local_rank,
                "world_size": info.world_size,
                "local_world_size": info.local_world_size,
                "backend": info.backend,
                "backend_reason": info.reason,
                "device": str(info.device),
                "host": socket.gethostname(),
                "master_addr": os.environ.get("MASTER_ADDR"),
                "pid": os.getpid(),
                "all_reduce_sum": value.item(),
            },
        )


if __name__ == "__main__":
    main()
