"""Leave the process group after DDP, then look for what is left of it.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/teardown.py --init plain
    torchrun --standalone --nproc-per-node 2 scripts/demos/teardown.py --init plain --import-first
    torchrun ... scripts/demos/teardown.py --init plain --import-first-rank 1

Each rank wraps a small model in DDP, trains a few steps, gathers a result
(as a training script's last steps do), and calls ``destroy_process_group``.
Then it lists the process group's threads that are still alive (Linux).

``--init plain`` joins the usual way, ``dist.init_process_group`` first. DDP's
constructor then imports ``torch.distributed.nn`` (through ``torch._dynamo``),
whose functions take ``group=group.WORLD`` as a default argument evaluated at
import: they hold the default group, ``destroy_process_group`` cannot free it,
and its threads run on into interpreter shutdown. There a gloo thread that
needs the GIL (to drop the last reference to a Python-owned buffer) is ended
by Python inside a C++ destructor, and the rank dies by SIGABRT ("terminate
called without an active exception") after the work was done: a race, rare,
but real. ``--import-first`` is the one-line fix in plain torch:
``import torch.distributed.nn`` before ``init_process_group``, so the defaults
hold ``None`` and leaving the group joins its threads. ``--import-first-rank R``
applies it on rank R only: the ranks of one job, one launch, differ in that
line alone (what lesson 09 compares). ``--init package`` joins through
``ddp_tutorial.distributed.setup``, which imports the module first too.

``--skip-destroy`` is seed 001's ending: no ``destroy_process_group`` at all.
The rank lists the group's threads as it returns from ``main``: every one of
them is still running when the interpreter starts to shut down.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.distributed import backend_threads, cleanup, group_held_by_defaults, setup
from ddp_tutorial.lessons.anatomy import global_batch, sgd_step, shard, tiny_model
from ddp_tutorial.records import write_rank_record

PINNING_MODULE = "torch.distributed.nn"  # DDP imports it; its defaults can hold the group


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=["plain", "package"], default="package")
    parser.add_argument("--import-first", action="store_true",
                        help="plain init, fixed: import torch.distributed.nn first")  # fmt: skip
    parser.add_argument("--import-first-rank", type=int, default=None,
                        help="the fix on this rank only (the others as plain)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="training steps before leaving")
    parser.add_argument("--skip-destroy", action="store_true", help="seed 001: never leave")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="nccl (GPU branch): its warning at exit without leaving")  # fmt: skip
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def train_a_little(steps: int, device: torch.device) -> float:
    """A few DDP steps and a gathered result: the collectives a real run ends with."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(tiny_model(seed=rank).to(device), device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = float("nan")
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(step, 16 * world))
        loss = sgd_step(model, shard(x, rank, world), shard(y, rank, world), optimizer)
    losses: list[float] = [0.0] * world
    dist.all_gather_object(losses, loss)
    return sum(losses) / world


@record
def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if args.init == "plain":
        fixed_here = args.import_first_rank == int(os.environ.get("RANK", "0"))
        args.import_first = args.import_first or fixed_here
        if args.import_first:  # the fix: its defaults are evaluated while no group exists
            importlib.import_module(PINNING_MODULE)  # in a script: import torch.distributed.nn
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    else:
        device = setup(backend=args.backend).device  # cuda:LOCAL_RANK with nccl
    rank = dist.get_rank()
    imported_at_init = PINNING_MODULE in sys.modules
    loss = train_a_little(args.steps, device)  # the model is gone when this returns
    imported_after_ddp = PINNING_MODULE in sys.modules
    threads_in_group = backend_threads()
    pinned = group_held_by_defaults()
    if not args.skip_destroy:
        cleanup(barrier=True)  # barrier, then destroy_process_group
    left = backend_threads(settle_s=1.0)  # a pinned group's threads stay; joined ones go
    ending = "at exit, never left" if args.skip_destroy else "after leaving"
    how = f"{args.init}, import first" if args.import_first else args.init
    print(f"rank {rank} ({how}): backend threads {ending}: {left}", flush=True)
    write_rank_record(
        args.out,
        {
            "init": args.init,
            "import_first": args.import_first,
            "destroyed": not args.skip_destroy,
            "final_loss": loss,
            "threads_in_group": threads_in_group,
            "threads_after_leaving": left,
            "nn_imported_at_init": imported_at_init,
            "nn_imported_after_ddp": imported_after_ddp,
            "group_pinned_by_defaults": pinned,
            "pid": os.getpid(),
        },
        rank=rank,
    )


if __name__ == "__main__":
    main()
