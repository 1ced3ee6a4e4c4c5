"""Lesson 00, your turn: turn this single-process training loop into DDP.

It is scripts/single_process.py, smaller: generated data, a two-layer classifier, SGD, a
shuffled DataLoader, an atomic save. Started under torchrun as it is, every process trains
alone on all the data and every one writes the same file. Make it the loop lesson 00 showed:
join the process group (rank and world size from torchrun's environment), give each process
its share of the data with a new order every epoch, wrap the model so that backward() averages
the gradients, let rank 0 save the weights without DDP's wrapper, and leave the group at
the end. ``--batch-size`` stays per process: 2 processes x 16 must train what 1 x 32 trains.

Check it (2 gloo ranks, your file started the way torchrun starts it):

    ddp-tutorial check 00

or run it yourself: torchrun --standalone --nproc-per-node 2 scripts/exercises/00_convert_loop.py
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: the group can be freed at exit (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, seed: int) -> TensorDataset:
    """n points in 20 dimensions, 4 classes from a random linear teacher, and each one's index."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="ex00", help="folder for model.pt and the check's reports")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rank, world_size = 0, 1
    # YOUR CODE: join the process group (gloo), then read rank and world_size from the
    # environment torchrun gives every process
    # END YOUR CODE

    train_set = make_data(args.num_samples, args.seed)
    generator = torch.Generator()
    sampler = RandomSampler(train_set, generator=generator)
    # YOUR CODE: replace `sampler` with one that gives this process its share (seed=args.seed)
    # END YOUR CODE
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    # YOUR CODE: wrap the model, so that backward() averages the gradients over the processes
    # END YOUR CODE
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    seen: list[list[int]] = []  # the samples this process trained on, per epoch (for the check)
    for epoch in range(args.epochs):
        generator.manual_seed(args.seed + epoch)  # a new order every epoch (single process)
        # YOUR CODE: a new order every epoch, for your sampler
        # END YOUR CODE
        seen.append([])
        for x, y, index in loader:
            seen[-1] += index.tolist()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    writer, state = True, model.state_dict()
    # YOUR CODE: only rank 0 writes; and `state` must be the weights without the wrapper
    # END YOUR CODE
    if writer:
        torch.save(state, out / "model.pt.tmp")  # write aside, then rename: never half a file
        os.replace(out / "model.pt.tmp", out / "model.pt")
    report = {"rank": rank, "world_size": world_size, "wrote": writer, "seen": seen}
    (out / f"report-{os.getpid()}.json").write_text(json.dumps(report))  # read by the check
    # YOUR CODE: leave the process group
    # END YOUR CODE


if __name__ == "__main__":
    main()
