"""Which device each rank should use: LOCAL_RANK, not the global RANK.

Run it on one node, or as two "nodes" of one job (on two machines, or twice
on this one, as lesson 03 does):

    torchrun --standalone --nproc-per-node 2 scripts/demos/device_report.py
    # a 2-node job: run the same line on each machine
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 --rdzv-id job1 scripts/demos/device_report.py

No ``--node-rank``: with a c10d rendezvous torchrun ignores it (and warns, for
any value but 0); the rendezvous numbers the nodes itself (torch 2.14 sorts
them by host name, then the agent's process id) and sets GROUP_RANK from that.
Each rank reports what torchrun told it (RANK, LOCAL_RANK, GROUP_RANK = node),
the device seed 000's rule would pick (``cuda:{dist.get_rank()}``: the global
rank), and the device the package picks (``cuda:{LOCAL_RANK}``). On a 2-GPU
node, global rank 2 lives on the second node as local rank 0: seed 000 asks
for ``cuda:2``, which that node does not have.

``--seed-000-set-device`` runs seed 000's line itself where the rank has a GPU,
``torch.cuda.set_device(dist.get_rank())``, and records what CUDA answered
(lesson 03 runs it as two one-GPU "nodes" on a GPU machine, with gloo).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.devices import DeviceError, device_for_local_rank, visible_gpu_count
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record
from ddp_tutorial.settings import DEVICE_ORDER_ENV, VISIBLE_DEVICES_ENV


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="judge the device rules for nodes with this many GPUs (default: this node's count)",
    )
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument(
        "--seed-000-set-device", action="store_true", help="call set_device(get_rank()) for real"
    )
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def seed_000_set_device() -> str | None:
    """Seed 000's line, run: ``set_device`` with the GLOBAL rank. None where CUDA is absent."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.set_device(dist.get_rank())
        return "ok"
    except RuntimeError as exc:  # torch.AcceleratorError on recent torch: a RuntimeError
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"


def rule_outcome(device: str, gpus: int) -> str:
    """Whether ``cuda:i`` exists on a node with ``gpus`` GPUs."""
    index = int(device.split(":")[1])
    return "ok" if index < gpus else f"no such GPU (node has {gpus})"


@record
def main() -> None:
    args = parse_args()
    gpus = visible_gpu_count() if args.gpus_per_node is None else args.gpus_per_node
    with process_group(backend=args.backend) as info:
        seed_000 = f"cuda:{dist.get_rank()}"  # seed 000: device from the GLOBAL rank
        try:
            package = device_for_local_rank(info.local_rank, gpus)  # cuda:LOCAL_RANK
        except DeviceError as exc:
            package = f"error: {exc}"
        total = torch.tensor([float(info.rank)], device=info.device)
        dist.all_reduce(total)  # one job: every rank on every node takes part
        tried = seed_000_set_device() if args.seed_000_set_device else None
        write_rank_record(
            args.out,
            {
                "local_rank": info.local_rank,
                "group_rank": int(os.environ["GROUP_RANK"]),
                "world_size": info.world_size,
                "local_world_size": info.local_world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get(VISIBLE_DEVICES_ENV),
                "cuda_device_order": os.environ.get(DEVICE_ORDER_ENV),  # the launcher's default
                "gpus_per_node": gpus,
                "seed_000_device": seed_000,
                "seed_000_outcome": rule_outcome(seed_000, gpus),
                "package_device": package,
                "device_used": str(info.device),
                "backend": info.backend,
                "all_reduce_sum": total.item(),
                "seed_000_set_device": tried,
            },
        )
        print(
            f"RANK {info.rank} LOCAL_RANK {info.local_rank} GROUP_RANK {os.environ['GROUP_RANK']}:"
            f" seed 000 would use {seed_000}, the package uses {package}",
            flush=True,
        )


if __name__ == "__main__":
    main()
