"""The rank side of ``ddp-tutorial doctor``: every rank all_reduces its rank, writes the sum.

Run by the doctor as ``torchrun --nproc-per-node N -m ddp_tutorial.probe
--backend gloo --out DIR`` (as a module, so that nothing in this package's
folder shadows another package on ``sys.path``). It can be run by hand the
same way to test one machine's backend.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ddp-tutorial doctor: all_reduce probe")
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--out", required=True, help="run directory for per-rank JSON records")
    args = parser.parse_args(argv)
    with process_group(backend=args.backend) as info:
        value = torch.tensor([float(info.rank)], device=info.device)
        dist.all_reduce(value)
        write_rank_record(args.out, {"sum": value.item(), "device": str(info.device)})


if __name__ == "__main__":
    main()
