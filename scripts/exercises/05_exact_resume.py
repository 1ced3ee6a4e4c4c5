"""Lesson 05, your turn: a second launch that carries on exactly where the first one stopped.

The job below snapshots at the end of every epoch (rank 0, atomically): the weights, the
optimizer's state and the epoch it just finished. Write the resume: when ``snapshot.pt``
exists, every rank loads it (``map_location``, ``weights_only=True``), puts back the weights
(before DDP wraps the model) and the optimizer's state (SGD's momentum), and starts at the
epoch *after* the saved one - not at the saved one, which would run it twice (the official
example's ``EPOCHS_RUN`` mistake). Then each epoch's order: ``sampler.set_epoch(epoch)`` with
the epoch's own number, so a resumed epoch is shuffled as it would have been. Done right, a
job stopped after epoch 1 and launched again ends with exactly - bit for bit - the weights of
a run that never stopped.

``main()`` makes the three launches in one process, one after the other (a run straight
through, the job stopped after ``--stop-after-epoch``, the same job again); each writes a
report the check reads. Check it (2 gloo ranks):

    ddp-tutorial check 05

or run it yourself: torchrun --standalone --nproc-per-node 2 scripts/exercises/05_exact_resume.py
"""

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: the group can be freed at exit (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, seed: int) -> TensorDataset:
    """n points in 20 dimensions, 4 classes from a random linear teacher, and each one's index."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(n))


def fingerprint(model: nn.Module) -> str:
    """The weights in a few characters: equal only if every weight is equal, bit for bit."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha1(repr(flat.tolist()).encode()).hexdigest()[:16]


def train(args: argparse.Namespace, folder: Path, name: str, stop_after: int | None = None) -> None:
    """One launch of the job: resume from ``folder``/snapshot.pt if it is there, train to
    ``--epochs``, and snapshot every epoch (``stop_after``: end after that epoch's snapshot,
    as a job killed right after it would)."""
    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    snapshot = folder / "snapshot.pt"
    train_set = make_data(args.num_samples, args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start_epoch = 0
    # YOUR CODE: if `snapshot` exists, load it on every rank (map_location="cpu",
    # weights_only=True), put back the weights and the optimizer's state, and set start_epoch
    # to the first epoch not finished yet (snapshot["epoch"] is the last one that was)
    # END YOUR CODE
    model = DDP(model)  # after the load: DDP starts every rank from rank 0's weights
    report = {"rank": rank, "start_epoch": start_epoch, "optimizer_state": len(optimizer.state),
              "start_weights": fingerprint(model.module), "epochs": []}  # fmt: skip

    for epoch in range(start_epoch, args.epochs):
        # YOUR CODE: this epoch's order (the same in a resumed run as in one that never stopped)
        # END YOUR CODE
        order: list[int] = []
        for x, y, index in loader:
            order += index.tolist()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        report["epochs"].append({"epoch": epoch, "order": order,
                                 "weights": fingerprint(model.module)})  # fmt: skip
        if rank == 0:  # the snapshot: rank 0 alone, atomically (exercise 05_atomic_snapshot)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch}  # fmt: skip
            with open(folder / "snapshot.pt.tmp", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(folder / "snapshot.pt.tmp", snapshot)
        dist.barrier()
        if epoch == stop_after:
            break  # the job is killed here, right after this epoch's snapshot
    out = Path(args.out) / f"report-{name}-rank{rank}.json"  # read by the check
    out.write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--stop-after-epoch", type=int, default=1, help="the first launch ends there")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="ex05", help="folder for the snapshots and the reports")
    args = p.parse_args()
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # a fresh start: no snapshot left from an earlier run of this file
        for folder in ("straight", "job"):
            shutil.rmtree(Path(args.out) / folder, ignore_errors=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Three launches of the same job, one after the other (on a cluster: three torchrun commands)
    train(args, Path(args.out) / "straight", "straight")  # a run that never stops
    train(args, Path(args.out) / "job", "job-1", stop_after=args.stop_after_epoch)  # stopped
    train(args, Path(args.out) / "job", "job-2")  # the same command again: it must resume
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
