"""The smallest correct DDP training script: scripts/single_process.py, distributed.

    torchrun --standalone --nproc-per-node 2 scripts/minimal_ddp.py --out /tmp/ddp.pt

One process per GPU (or N CPU processes with gloo). Every rank runs this same file;
torchrun tells each one who it is through environment variables. Lesson 00 shows the diff
against the single-process loop; 2 ranks x --batch-size 32 train the same weights as one
process with --batch-size 64 (to float rounding; when --num-samples divides by the ranks: else
DistributedSampler pads each epoch with repeated samples). Only torch and the standard library.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: destroy_process_group can free the group
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, seed: int) -> TensorDataset:
    """n points in 20 dimensions, 4 classes given by a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def positive(text: str) -> int:  # --epochs 0 would train nothing, and say nothing
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def rate(text: str) -> float:  # nan, inf or <= 0 would train on as if nothing were wrong
    if not 0 < float(text) < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return float(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument("--batch-size", type=positive, default=32, help="PER PROCESS: x ranks = global")
    p.add_argument("--lr", type=rate, default=0.05)
    p.add_argument("--num-samples", type=positive, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="model.pt", help="where the trained weights go")
    args = p.parse_args()

    if "LOCAL_RANK" not in os.environ:
        sys.exit("start me with torchrun: torchrun --standalone --nproc-per-node 2 " + sys.argv[0])
    rank = int(os.environ["RANK"])  # 0 ... world_size-1, unique in the whole job
    local_rank = int(os.environ["LOCAL_RANK"])  # 0 ... on this machine: picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])  # processes in the job, all machines
    # nccl when every process on this machine can have a GPU of its own; else gloo, on the CPU
    backend = "nccl" if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)  # before anything touches CUDA
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)

    if rank == 0:
        print(f"{world_size} processes, global batch {args.batch_size * world_size}", flush=True)

    train_set = make_data(args.num_samples, args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)  # rank r: every world_size-th sample
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    # DDP copies rank 0's weights to every rank now, and averages the gradients in backward()
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch
        loss_sum = torch.zeros(2, device=device)  # [sum of losses, samples]
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
        dist.all_reduce(loss_sum)  # every rank's sums: the loss over the whole epoch
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)

    if rank == 0:  # one writer; model.module: the weights without DDP's "module." prefix
        tmp = args.out + ".tmp"  # aside, then renamed: a killed process never leaves half a file
        torch.save(model.module.state_dict(), tmp)
        os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
