"""What torchrun gives each rank, and what the four collectives do to its tensors.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/collectives.py

Each rank
1. reports the environment contract torchrun prepared for it (MASTER_ADDR,
   MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, ...);
2. joins the process group (``init_process_group(backend, timeout=...)``
   inside ``ddp_tutorial.distributed.setup``) and runs all_reduce, broadcast,
   all_gather and reduce once each, recording before/after;
3. leaves the group (``destroy_process_group``) and records that it did.

It also prints four ways: a line from every rank (N copies), a line guarded by
``if rank == 0`` and a ``logging`` INFO message that only rank 0 lets through
(:func:`rank_zero_logging`): one copy each; and a ``logging`` WARNING, which every
rank lets through (N copies, each tagged with its rank). And it records which process listens
on MASTER_PORT (the store): under torchrun, the agent (every rank's parent).

With ``--out DIR`` each rank writes ``DIR/rank{r}.json`` for the notebook.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import setup
from ddp_tutorial.lessons.collectives import run_collectives, store_listener
from ddp_tutorial.records import write_rank_record

# The variables torchrun sets for every worker (the "environment contract").
CONTRACT = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",  # index of this node (torchrun calls a node a "group")
    "ROLE_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",  # "True": the store at MASTER_ADDR:MASTER_PORT is torchrun's
    "OMP_NUM_THREADS",
)


def rank_zero_logging(rank: int) -> logging.Logger:
    """INFO from rank 0 only; warnings and errors from every rank, each tagged with its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(levelname)s %(message)s",
    )
    return logging.getLogger("train")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout, seconds")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    # Read the contract *before* joining: this is all a rank knows about the job.
    env = {name: os.environ.get(name) for name in CONTRACT}
    info = setup(backend=args.backend, timeout_s=args.timeout)
    log = rank_zero_logging(info.rank)
    try:
        store = store_listener(int(os.environ["MASTER_PORT"]))  # while the group exists
        results = run_collectives(info.rank, info.world_size, info.device)
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()  # always: frees sockets/communicators, no warning at exit
    # every rank prints: N copies of this line
    print(
        f"rank {info.rank}/{info.world_size} local {info.local_rank}: backend {backend}, "
        f"all_reduce(SUM) {results['all_reduce_sum']['before']} -> "
        f"{results['all_reduce_sum']['after']}",
        flush=True,
    )
    if info.rank == 0:  # one copy: only rank 0 prints
        print(f"done: {info.world_size} ranks ran {len(results)} collectives", flush=True)
    log.info("logged once, by rank 0: backend %s", backend)  # dropped on ranks != 0
    log.warning("warned by every rank")  # WARNING passes the level on every rank
    write_rank_record(
        args.out,
        {
            "env": env,
            "local_rank": info.local_rank,
            "world_size": info.world_size,
            "backend": backend,
            "backend_reason": info.reason,
            "device": str(info.device),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),  # torch's intra-op threads (OMP_NUM_THREADS)
            "store": store,
            "collectives": results,
            "initialized_after_destroy": dist.is_initialized(),
        },
    )


if __name__ == "__main__":
    main()
