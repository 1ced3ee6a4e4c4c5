"""all_gather of tensors whose size differs by rank: the fix first, then the mistake.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/uneven_gather.py            # fails
    torchrun --standalone --nproc-per-node 2 scripts/demos/uneven_gather.py --fix-only # passes

Rank r holds ``2 + r`` predictions (rows of ``[index, score]``), as ranks do
after an unpadded evaluation shard. Each rank first gathers them correctly,
twice — ``ddp_tutorial.gather.all_gather_uneven`` (pad, all_gather, trim) and
``dist.all_gather_object`` — and writes its record. Then it makes the common
mistake: ``dist.all_gather(out, local)`` with ``out`` sized like its *own*
tensor. On gloo the rank that receives more bytes than it expected aborts
(``Received data size doesn't match expected size``, SIGABRT), and the other
either fails with a closed connection or returns whatever its buffers held.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import cleanup, setup
from ddp_tutorial.gather import all_gather_uneven
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix-only", action="store_true", help="skip the mistake")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout, s")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def predictions(rank: int) -> torch.Tensor:
    """``2 + rank`` rows of ``[global index, score]``: a different count on every rank."""
    n = 2 + rank
    index = torch.arange(n, dtype=torch.float32) * 2 + rank  # unpadded shard: r, r+2, ...
    return torch.stack([index, index / 10 + 0.5], dim=1)


@record
def main() -> None:
    args = parse_args()
    info = setup(backend="gloo", timeout_s=args.timeout)
    local = predictions(info.rank)
    padded = all_gather_uneven(local)  # the fix
    objects: list[object] = [None] * info.world_size
    dist.all_gather_object(objects, local.tolist())  # the slow but simple way
    write_rank_record(
        args.out,
        {
            "local": local.tolist(),
            "padded_gather": [t.tolist() for t in padded],
            "object_gather": objects,
        },
    )
    if not args.fix_only:
        out = [torch.zeros_like(local) for _ in range(info.world_size)]  # sized like MY tensor
        try:
            dist.all_gather(out, local)
            print(f"rank {info.rank}: all_gather returned {[t.tolist() for t in out]}", flush=True)
        except RuntimeError as exc:
            print(f"rank {info.rank}: all_gather raised {exc}", flush=True)
    cleanup()


if __name__ == "__main__":
    main()
