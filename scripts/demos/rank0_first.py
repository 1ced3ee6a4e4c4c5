"""Rank 0 prepares the data (downloads, tokenises, builds a cache) while the others wait.

    torchrun --standalone --nproc-per-node 2 scripts/demos/rank0_first.py --mode naive
    torchrun --standalone --nproc-per-node 2 scripts/demos/rank0_first.py --mode fixes

The preparation takes ``--work`` seconds, longer than the collectives' ``--timeout``
(on a cluster: a tokenised dataset, an hour, against a 10- or 30-minute timeout).

``naive`` is what the trackers report: the others wait for rank 0 at a barrier of the
training group, and fail when its timeout runs out, with rank 0's work half done.

``fixes`` runs three ways out, one after the other, each with a preparation longer
than the timeout, each followed by a barrier of the short-timeout group:
1. ``before init``: rank 0 prepares before ``init_process_group``, which the others
   wait in with the (long) time it takes to join; then the short timeout is set;
2. ``store``: local rank 0 prepares (once per node), the others wait on the store for
   its key, with a timeout of their own;
3. ``long group``: the wait is a barrier of a second group made with a long timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def prepare(out: Path, seconds: float, tag: str) -> None:
    """The slow work only one process does: here a sleep, then the file the others read."""
    time.sleep(seconds)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps({"prepared_by": os.getpid()}))


def naive(args: argparse.Namespace, rank: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    if rank == 0:
        prepare(args.out, args.work, "naive")
    dist.barrier()  # rank 1 waits here; past --timeout it fails (and torchrun stops rank 0)


def before_init(args: argparse.Namespace, rank: int) -> None:
    """1. The work before the group exists: joining waits as long as it must, then the
    collectives get their short timeout."""
    if rank == 0:
        prepare(args.out, args.work, "before_init")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.join_timeout))
    # torch 2.14+: from here on, a collective may wait --timeout only
    dist.set_timeout(timedelta(seconds=args.timeout))


def on_the_store(args: argparse.Namespace, local_rank: int) -> None:
    """2. Local rank 0 first on each node; the others wait for its key on the store."""
    store = dist.TCPStore(  # torchrun's store, as a client; its own timeout
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=args.join_timeout),
    )
    # one key per node and attempt: torchrun's store outlives a restart (--max-restarts), and
    # a key of the attempt before would let the others go on while local rank 0 prepares again
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"prepared/{os.environ.get('GROUP_RANK', '0')}/{attempt}"
    if local_rank == 0:
        prepare(args.out, args.work, "store")
        store.set(key, "1")
    else:
        store.wait([key], timedelta(seconds=args.join_timeout))


def long_group(args: argparse.Namespace, rank: int) -> None:
    """3. A second group, made once by every rank, with a long timeout, for the long wait."""
    patient = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.join_timeout))
    if rank == 0:
        prepare(args.out, args.work, "long_group")
    dist.barrier(group=patient)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["naive", "fixes"], required=True)
    p.add_argument("--work", type=float, default=3.0, help="seconds rank 0 prepares")
    p.add_argument("--timeout", type=float, default=1.5, help="the collectives' timeout")
    p.add_argument("--join-timeout", type=float, default=120, help="joining and long waits")
    p.add_argument("--out", type=Path, default=Path("prepared"), help="where the data goes")
    args = p.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.mode == "naive":
        naive(args, rank)
    else:
        waited = {}
        for name, fix, who in (
            ("before init", before_init, rank),
            ("store", on_the_store, local_rank),
            ("long group", long_group, rank),
        ):
            start = time.monotonic()
            fix(args, who)
            dist.barrier()  # the training group, short timeout: everybody is here now
            waited[name] = round(time.monotonic() - start, 2)
        # what the training group's barriers waited at most: torch's own setting (a private
        # attribute, read only for the lesson's assert), the short --timeout and not --join-timeout
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        record = {"rank": rank, "waited_s": waited, "timeout_s": args.timeout,
                  "group_timeout_s": backend.options._timeout.total_seconds()}  # fmt: skip
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
