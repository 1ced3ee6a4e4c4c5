"""A plain single-process training loop: the starting point of the course.

    python scripts/single_process.py --batch-size 64 --out /tmp/single.pt

Its DDP twin is scripts/minimal_ddp.py: the same loop with the few lines DDP needs
(lesson 00 shows the diff). Only torch and the standard library.
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


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
    p.add_argument("--batch-size", type=positive, default=64)
    p.add_argument("--lr", type=rate, default=0.05)
    p.add_argument("--num-samples", type=positive, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="model.pt", help="where the trained weights go")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_set = make_data(args.num_samples, args.seed)
    generator = torch.Generator()  # the shuffle: re-seeded every epoch, so it is reproducible
    sampler = RandomSampler(train_set, generator=generator)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        generator.manual_seed(args.seed + epoch)  # a new order every epoch
        loss_sum = torch.zeros(2, device=device)  # [sum of losses, samples]
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
        print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)

    tmp = args.out + ".tmp"  # aside, then renamed: a killed process never leaves half a file
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
