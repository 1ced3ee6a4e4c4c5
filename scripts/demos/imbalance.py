"""Load imbalance: rank 0 does extra work every step, and everyone else waits for it.

    torchrun --standalone --nproc-per-node 2 scripts/demos/imbalance.py --eval rank0    # the bug
    torchrun --standalone --nproc-per-node 2 scripts/demos/imbalance.py --eval sharded  # the fix

A DDP step holds collectives that complete only when *every* rank has reached
them: the gradient all_reduce in backward and, for a model with buffers such as
BatchNorm's running statistics, a broadcast of rank 0's buffers at the start of
every forward (``broadcast_buffers=True``, the default). If rank 0 evaluates on
a validation batch before each step (a habit: "only the main process
evaluates"), the other ranks sit in the first of those collectives waiting for
it; the whole job runs at the slow rank's pace. The fix
is to share the extra work: every rank evaluates its own shard and the counts
are summed with all_reduce. Each rank records how long its forward, backward
(which includes waiting for the others) and evaluation took.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.distributed import process_group, wrap
from ddp_tutorial.lessons.perf import clock
from ddp_tutorial.models import build_model
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval", choices=["none", "rank0", "sharded"], default="rank0")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--eval-batch", type=int, default=256, help="validation samples per step")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--out", default=None)
    return p.parse_args()


@torch.no_grad()
def count_correct(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> int:
    model.eval()
    correct = (model(images).argmax(1) == labels).sum().item()
    model.train()
    return int(correct)


@record
def main() -> None:
    args = parse_args()
    with process_group() as info:
        device = info.device  # cuda:LOCAL_RANK with nccl: every tensor a collective sees goes there
        torch.manual_seed(0)
        model = wrap(build_model("cnn", 10, args.image_size), device)  # .to(device), then DDP
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = SyntheticImages(args.steps * args.batch_size * info.world_size, args.image_size, 10)
        val = SyntheticImages(args.eval_batch, args.image_size, 10, seed=1)
        val_x = torch.stack([val[i][0] for i in range(len(val))]).to(device)
        val_y = torch.tensor([val[i][1] for i in range(len(val))]).to(device)
        # Each rank's slice of the validation batch, for the sharded fix.
        shard = slice(info.rank, None, info.world_size)
        times: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "eval": []}
        start = time.time()
        for step in range(args.steps):
            idx = [
                (step * info.world_size + info.rank) * args.batch_size + j
                for j in range(args.batch_size)
            ]
            x = torch.stack([data[i][0] for i in idx]).to(device)
            y = torch.tensor([data[i][1] for i in idx]).to(device)
            t0 = clock(device)  # on a GPU: after the queued work, or the times mean nothing
            if args.eval == "rank0" and info.rank == 0:
                count_correct(model.module, val_x, val_y)  # only rank 0 works; others wait
            elif args.eval == "sharded":
                correct = torch.tensor(
                    count_correct(model.module, val_x[shard], val_y[shard]), device=device
                )
                dist.all_reduce(correct)  # every rank gets the full count
            t1 = clock(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)  # broadcasts buffers first
            t2 = clock(device)
            opt.zero_grad()
            loss.backward()  # gradient all_reduce: blocks until every rank gets here
            opt.step()
            t3 = clock(device)
            times["eval"].append(t1 - t0)
            times["forward"].append(t2 - t1)
            times["backward"].append(t3 - t2)
            times["step"].append(t3 - t0)
        end = time.time()
        write_rank_record(args.out, {"eval": args.eval, "start": start, "end": end, **times})
        per_step = {k: 1000 * sum(v) / args.steps for k, v in times.items()}
        print(
            f"rank {info.rank}: eval={args.eval} {per_step['step']:.1f} ms/step, of which "
            f"DDP forward+backward (incl. waiting) "
            f"{per_step['forward'] + per_step['backward']:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
