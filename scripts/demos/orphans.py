"""A job with DataLoader workers, to stop from outside and see what is left of it.

    torchrun --standalone --nproc-per-node 2 scripts/demos/orphans.py --out runs/orphans
    torchrun --standalone --nproc-per-node 2 scripts/demos/orphans.py --die-with-parent ...

Each rank joins the group, starts a DataLoader with ``--num-workers`` worker processes,
writes who it is (its pid, its session, its workers' pids) to ``--out``, then trains until
``--seconds`` run out: a batch and an all_reduce per step. Stop torchrun while it runs —
Ctrl-C, ``kill PID``, ``kill -9 PID`` — and list what is still running.

``--die-with-parent``: each rank asks the Linux kernel to send it SIGTERM the moment its
parent, torchrun's agent, ends, however it ends (``die_with_parent``); its DataLoader workers
watch the rank and leave when it is gone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent ends — even by
    SIGKILL, which leaves the parent no chance to pass anything on. (Strictly: when the
    parent's thread that started it ends; a fork does not inherit the request.)"""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the request: nobody will send sig now
        os.kill(os.getpid(), sig)


class SlowNumbers(Dataset):
    """Numbers that take a while to load, like images from a disk."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.tensor([float(index)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--seconds", type=float, default=120, help="how long it trains")
    p.add_argument("--die-with-parent", action="store_true", help="SIGTERM when torchrun ends")
    p.add_argument("--out", type=Path, default=Path("orphans"), help="where each rank writes")
    args = p.parse_args()
    if args.die_with_parent:
        die_with_parent()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = iter(
        DataLoader(
            SlowNumbers(),
            batch_size=4,
            num_workers=args.num_workers,
            multiprocessing_context="fork",  # the workers are the rank's children (Linux)
            # each worker too: gone the moment its rank is (else within torch's 5 s check)
            worker_init_fn=(lambda _: die_with_parent()) if args.die_with_parent else None,
        )
    )
    next(batches)  # the workers exist now
    me = psutil.Process()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "pid": me.pid,
        "parent": me.ppid(),
        "session": os.getsid(0),
        "process_group": os.getpgid(0),
        "workers": [child.pid for child in me.children()],
        "worker_groups": [os.getpgid(child.pid) for child in me.children()],
    }
    written = args.out / f"rank{rank}.json.tmp"
    written.write_text(json.dumps(record))
    written.replace(args.out / f"rank{rank}.json")  # whole, for whoever polls the folder
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:  # training: a batch, then an all_reduce
        dist.all_reduce(next(batches).sum().reshape(1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
