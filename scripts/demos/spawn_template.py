"""Starting ranks with ``torch.multiprocessing.spawn`` and a hand-set MASTER_ADDR/MASTER_PORT.

This is how seed 001 starts its workers. Run it with plain python (no torchrun):

    python scripts/demos/spawn_template.py --nprocs 2

``mp.spawn(fn, nprocs=N)`` starts N children with the *spawn* start method
(not fork: each is a fresh interpreter that imports this file again, as
``__mp_main__``, so everything at module level runs again in every child) and
calls ``fn(index, *args)`` in each; the child's rank is that ``index``. Nothing else is set for you:
the parent must export MASTER_ADDR and MASTER_PORT itself (seed 001 also
exports ``RANK='0'`` — which every child then inherits, so anything that
reads RANK from the environment believes it is rank 0), and each child
passes ``rank`` and ``world_size`` to ``init_process_group`` by hand.

It works, for one node. What torchrun adds on top (lesson 01 compares them):
a free port (``--standalone``), LOCAL_RANK/LOCAL_WORLD_SIZE and the rest of
the environment contract, multi-node rendezvous, restarts, and a summary
naming the rank that failed.

``--bars`` adds seed 001's progress bar: a ``tqdm`` bar on *every* rank, all
drawing over the one terminal the children share, then the fix, a bar on
rank 0 only (``disable=rank != 0``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from ddp_tutorial.lessons.collectives import store_listener
from ddp_tutorial.records import write_rank_record

ENV_SEEN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


def free_port() -> int:
    """A port nobody listens on right now (seed 001 hard-codes 29500: two jobs collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress_bars(rank: int, steps: int = 8) -> None:
    """Seed 001's bar on every rank, then the fix: the same loop with a bar on rank 0 only."""
    for label, shown in (("every rank", True), ("rank 0 only", rank == 0)):
        bar = tqdm(range(steps), desc=f"{label}, rank {rank}", disable=not shown, mininterval=0)
        for _ in bar:
            time.sleep(0.03)  # a training step, which under DDP ends in the gradient
            dist.barrier()  # all_reduce: every step waits for every rank, and so do the bars
        bar.close()
        dist.barrier()  # the next loop starts together


def main_worker(index: int, world_size: int, out: str | None, bars: bool = False) -> None:
    """Runs in every child. ``index`` (0..nprocs-1) is all mp.spawn tells it."""
    env = {name: os.environ.get(name) for name in ENV_SEEN}
    dist.init_process_group(
        backend="gloo",  # CPU; seed 001 uses nccl + torch.cuda.set_device(index) on GPUs
        init_method="env://",  # read MASTER_ADDR / MASTER_PORT from the environment
        world_size=world_size,
        rank=index,  # explicit: the inherited RANK='0' must not be used
        timeout=timedelta(seconds=30),
    )
    try:
        value = torch.tensor([float(index)])
        dist.all_reduce(value)
        rank = dist.get_rank()
        store = store_listener(int(os.environ["MASTER_PORT"]))  # who hosts it: rank 0 itself
        if bars:
            progress_bars(rank)
        print(
            f"spawned worker {index}: rank {rank}/{world_size}, env RANK={env['RANK']}, "
            f"LOCAL_RANK={env['LOCAL_RANK']}, all_reduce sum {value.item():g}",
            flush=True,
        )
        write_rank_record(
            out,
            {
                "index": index,
                "env": env,
                "world_size": dist.get_world_size(),
                "all_reduce_sum": value.item(),
                "pid": os.getpid(),
                "store": store,
                # "__mp_main__": this file was imported afresh (spawn); a forked child
                # would still run the parent's "__main__"
                "main_module": sys.modules["__main__"].__name__,
                "start_method": mp.get_start_method(allow_none=True),
            },
            rank=rank,
        )
    finally:
        dist.destroy_process_group()  # seed 001 never calls it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="processes to spawn")
    parser.add_argument("--address", default="127.0.0.1", help="MASTER_ADDR")
    parser.add_argument("--port", type=int, default=0, help="MASTER_PORT (0: pick a free one)")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    parser.add_argument("--bars", action="store_true", help="seed 001's tqdm bar on every rank")
    args = parser.parse_args()
    if args.nprocs < 1:
        parser.error("--nprocs must be >= 1")
    # The hand-made part of the contract, exactly as seed 001 does it:
    os.environ["MASTER_ADDR"] = args.address
    os.environ["MASTER_PORT"] = str(args.port or free_port())
    os.environ["WORLD_SIZE"] = str(args.nprocs)
    os.environ["RANK"] = "0"  # seed 001's line: every child inherits it
    print(
        f"parent pid {os.getpid()}: MASTER_ADDR={os.environ['MASTER_ADDR']} "
        f"MASTER_PORT={os.environ['MASTER_PORT']}",
        flush=True,
    )
    mp.spawn(main_worker, args=(args.nprocs, args.out, args.bars), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
