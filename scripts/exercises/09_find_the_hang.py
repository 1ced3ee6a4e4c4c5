"""Lesson 09, your turn: this training script hangs. Find where, and fix it.

A small classifier with BatchNorm, trained on 2 ranks: each takes every second sample and
keeps those that have a label; after every epoch rank 0 reports the validation accuracy, and
every rank waits at a barrier before the next epoch. Started as it is, it hangs: a rank waits
in a collective for a peer that never comes. Run the check (or the script) and read the first
failure: which rank waited, at which line. Lesson 09 names the hangs a script like this meets
("6 · Rank 0 evaluates alone", "7 · Uneven inputs"); fix each in the `# YOUR CODE` block
beside it, keeping what the script does: every labelled sample trained on in every epoch, the
same weights on every rank, and the trained model's accuracy on the validation set.

Check it (2 gloo ranks, your file started the way torchrun starts it; a collective that
waits 8 s fails, and the check names the rank and the line it waited at):

    ddp-tutorial check 09

or run it yourself: torchrun --standalone --nproc-per-node 2 scripts/exercises/09_find_the_hang.py
(as it is it hangs, silently: gloo waits 30 minutes by default - Ctrl-C stops it; lesson
09's habit 1 shortens the wait, and the check does)
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
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, seed: int, unlabelled_every: int = 0) -> TensorDataset:
    """n points in 8 dimensions, 3 classes from a random linear teacher, and each one's index;
    label -1 (no label) on every ``unlabelled_every``-th sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    if unlabelled_every:
        y[::unlabelled_every] = -1
    return TensorDataset(x, y, torch.arange(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=5, help="per process")
    p.add_argument("--num-samples", type=int, default=30)
    p.add_argument("--out", default="ex09", help="folder for the check's reports")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set = make_data(args.num_samples, seed=1, unlabelled_every=6)
    val_set = make_data(64, seed=2)
    labels = train_set.tensors[1]

    shard = list(range(rank, len(train_set), world_size))  # every world_size-th sample ...
    shard = [i for i in shard if labels[i] >= 0]  # ... that has a label
    # YOUR CODE: if the ranks hang at the end of an epoch, change `shard` here
    # (hint: lesson 09, "7 · Uneven inputs": what must be the same on every rank - for any
    # number of samples and any batch size, not only for this run's?)
    # END YOUR CODE
    loader = DataLoader(Subset(train_set, shard), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))  # fmt: skip

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    seen: list[list[int]] = []  # the samples this process trained on, per epoch (for the check)
    accuracy: list[float] = []
    for _ in range(args.epochs):
        seen.append([])
        for x, y, index in loader:
            seen[-1] += index.tolist()
            loss = nn.functional.cross_entropy(model(x), y)  # DDP's forward and backward
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:  # one process reports the validation accuracy
            net = model
            # YOUR CODE: if the ranks hang after this evaluation, change `net` here
            # (hint: lesson 09, "6 · Rank 0 evaluates alone")
            # END YOUR CODE
            net.eval()
            with torch.no_grad():
                x, y, _ = val_set.tensors
                accuracy.append((net(x).argmax(dim=1) == y).float().mean().item())
            net.train()
        dist.barrier()  # every rank waits for rank 0's evaluation before the next epoch

    state = {k: v.tolist() for k, v in model.module.state_dict().items()}
    report = {"rank": rank, "seen": seen, "accuracy": accuracy, "state": state}
    (out / f"report-{rank}.json").write_text(json.dumps(report))  # read by the check
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
