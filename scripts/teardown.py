"""Leave the process group after DDP, then look for what is left of it.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/teardown.py --init plain
    torchrun --standalone --nproc-per-node 2 scripts/teardown.py --init package

Each rank wraps a small model in DDP, trains a few steps, gathers a result
(as a training script's last steps do), and calls ``destroy_process_group``.
Then it lists the process group's threads that are still alive (Linux).

``--init plain`` joins the usual way, ``dist.init_process_group`` first. DDP's
constructor then imports ``torch.distributed.nn``, whose functions take
``group=group.WORLD`` as a default argument evaluated at import: they hold the
default group, ``destroy_process_group`` cannot free it, and its threads run
on into interpreter shutdown. There a gloo worker that drops a finished
collective's tensor needs the GIL, Python ends that thread inside a C++
destructor, and the rank dies by SIGABRT ("terminate called without an active
exception") after the work was done. ``--init package`` uses
``ddp_tutorial.distributed.setup``, which imports that module first: the
defaults are ``None`` and leaving the group joins its threads.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.distributed import backend_threads, cleanup, setup
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=["plain", "package"], default="package")
    parser.add_argument("--steps", type=int, default=3, help="training steps before leaving")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def group_pinned_by_defaults() -> bool:
    """Does a torch.distributed.nn default argument hold a process group right now?

    Call it only after DDP: importing the module is itself what pins the
    group, and DDP's constructor has imported it by then anyway.
    """
    import torch.distributed.nn.functional as F

    return any(isinstance(d, dist.ProcessGroup) for d in F.all_reduce.__defaults__ or ())


def train_a_little(steps: int) -> float:
    """A few DDP steps and a gathered result: the collectives a real run ends with."""
    torch.manual_seed(dist.get_rank())
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
    losses: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(losses, float(model(torch.randn(16, 32)).square().mean()))
    return sum(losses) / len(losses)  # type: ignore[arg-type]


@record
def main() -> None:
    args = parse_args()
    if args.init == "plain":
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    else:
        setup(backend="gloo")
    rank = dist.get_rank()
    loss = train_a_little(args.steps)  # the model is gone when this returns
    threads_in_group = backend_threads()
    pinned = group_pinned_by_defaults()
    cleanup(barrier=True)  # barrier, then destroy_process_group
    left = backend_threads(settle_s=1.0)  # a pinned group's threads stay; joined ones go
    print(f"rank {rank} ({args.init}): backend threads after leaving: {left}", flush=True)
    write_rank_record(
        args.out,
        {
            "init": args.init,
            "final_loss": loss,
            "threads_in_group": threads_in_group,
            "threads_after_leaving": left,
            "group_pinned_by_defaults": pinned,
            "pid": os.getpid(),
        },
        rank=rank,
    )


if __name__ == "__main__":
    main()
