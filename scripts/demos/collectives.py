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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import setup
from ddp_tutorial.lessons.collectives import SRC, rank_loss, rank_value, store_listener
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


# The collectives, one function each: lesson 01 shows these lines (a test keeps them equal).
# Every rank calls each one: a collective completes only when every rank of the group has.
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # every rank: the sum of every rank's t
    return t


def all_reduce_avg(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # nccl; gloo since pytorch#149781 (not int64)
    return t


def broadcast(t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, src=SRC)  # every rank: rank SRC's t (DDP does this to the weights)
    return t


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]  # same shape!
    dist.all_gather(gathered, t)  # every rank: [rank 0's t, rank 1's t, ...]
    return gathered


def reduce(t: torch.Tensor) -> torch.Tensor:
    dist.reduce(t, dst=SRC, op=dist.ReduceOp.SUM)  # only rank SRC is promised the sum
    return t


def reduce_loss_seed001(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """Seed 001's ``reduce_loss``, verbatim: only ``dst=0`` is promised the result."""
    with torch.no_grad():
        dist.reduce(tensor, dst=0)
        if rank == 0:
            tensor /= world_size


def average_all_ranks(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """The portable average: all_reduce(SUM), then divide - every rank gets it.

    ReduceOp.AVG works on nccl, and on gloo since pytorch#149781 (March 2025: a SUM, then a
    division in float, which an integer tensor cannot hold: gloo refuses AVG on int64, in
    the call itself - lesson 01 asserts its error). SUM works everywhere.
    """
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= world_size
    return tensor


def values(t: torch.Tensor | list[torch.Tensor]) -> list:
    """A tensor (or a list of them) as plain floats, for the JSON record."""
    if isinstance(t, list):
        return [values(x) for x in t]
    return [float(v) for v in t.detach().cpu().flatten().tolist()]


def run_collectives(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """Each collective once, from an input known from the rank: ``{op: {"before", "after"}}``."""
    out: dict[str, Any] = {}
    for name, op in (("all_reduce_sum", all_reduce_sum), ("broadcast", broadcast),
                     ("all_gather", all_gather), ("reduce", reduce)):  # fmt: skip
        t = torch.tensor(rank_value(rank), device=device)
        before = values(t)
        out[name] = {"before": before, "after": values(op(t))}
    t = torch.tensor(rank_value(rank), device=device)
    try:
        out["all_reduce_avg"] = {"before": values(t), "after": values(all_reduce_avg(t)),
                                 "error": None}  # fmt: skip
    except (RuntimeError, ValueError) as exc:  # backends without AVG say so here
        out["all_reduce_avg"] = {"before": values(t), "after": None, "error": str(exc)[:300]}
    if dist.get_backend() == "gloo":  # an integer tensor cannot hold AVG's float division
        try:
            dist.all_reduce(torch.tensor([rank + 1]), op=dist.ReduceOp.AVG)
            out["avg_int64_error"] = None
        except (RuntimeError, ValueError) as exc:
            out["avg_int64_error"] = str(exc)[:300]
    # Every rank raised in the call, so the ranks are in step. No barrier here: gloo's barrier
    # also waits on the operations still in flight, and may raise the failed AVG once more.
    loss = torch.tensor([rank_loss(rank)], device=device)
    before = values(loss)
    reduce_loss_seed001(loss, rank, world_size)
    fixed = average_all_ranks(torch.tensor([rank_loss(rank)], device=device), world_size)
    out["reduce_loss"] = {"before": before, "after": values(loss), "fixed": values(fixed)}
    return out


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
