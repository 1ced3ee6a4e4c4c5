"""Train, save at epoch ends, and resume in a new launch exactly where training stopped.

Run it from the shell — two epochs straight:

    torchrun --standalone --nproc-per-node 2 scripts/demos/resume.py --epochs 2 \\
        --checkpoint-dir /tmp/a

or one epoch, stop (as a job hitting its time limit), then a *new* launch that
finds the snapshot and runs the second epoch:

    torchrun --standalone --nproc-per-node 2 scripts/demos/resume.py --epochs 2 --stop-after 1 \\
        --checkpoint-dir /tmp/b
    torchrun --standalone --nproc-per-node 2 scripts/demos/resume.py --epochs 2 \\
        --checkpoint-dir /tmp/b

Both leave ``final.pt`` (the plain model ``state_dict()``) in the checkpoint
directory; on the CPU the two are bitwise equal. What makes that possible is
what the snapshot holds (:func:`ddp_tutorial.snapshots.training_state`):
the weights, the optimizer's momentum buffers, the epoch (so the
DistributedSampler gets the same ``set_epoch`` and the same shuffle), the
step, and every rank's RNG states (this script adds random noise to its
inputs, as augmentation does — without the RNG states the resumed run would
draw different noise). ``--no-restore-rng`` shows that.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.checkpoint import is_save_epoch, load_checkpoint, model_state, save_checkpoint
from ddp_tutorial.distributed import print0, process_group, wrap
from ddp_tutorial.models import MLP
from ddp_tutorial.numerics import make_deterministic
from ddp_tutorial.records import write_rank_record
from ddp_tutorial.snapshots import (
    agreed_latest_snapshot,
    list_snapshots,
    restore_training_state,
    snapshot_path,
    training_state,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True, help="snapshots and final.pt")
    parser.add_argument("--epochs", type=int, default=2, help="epochs in the whole training")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after N epochs")
    parser.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-restore-rng", action="store_true", help="resume without RNG states")
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    """Generated, identical on every rank: 4 classes from a fixed random projection."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


@record
def main() -> None:
    args = parse_args()
    make_deterministic()  # the point of this script is bitwise equality, on GPUs too
    with process_group(backend=args.backend) as info:
        torch.manual_seed(args.seed)  # same initial weights on every rank (DDP checks)
        model = MLP(16, 4).to(info.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        dataset = make_dataset(args.num_samples, args.seed)
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        torch.manual_seed(args.seed + info.rank)  # from here on, each rank its own random stream

        start_epoch, step, resumed_from = 0, 0, None
        snapshot = agreed_latest_snapshot(args.checkpoint_dir)  # rank 0 decides for all
        if snapshot is not None:  # load into the plain model, before DDP wraps it
            state = load_checkpoint(snapshot, map_location=info.device)
            position = restore_training_state(
                state, model, optimizer, restore_rng=not args.no_restore_rng
            )
            start_epoch, step, resumed_from = position["epoch"], position["step"], snapshot.name
            print0(f"resumed from {snapshot} at epoch {start_epoch}, step {step}")
        ddp_model = wrap(model, info.device)  # on this rank's device, then DDP

        stop = args.epochs if args.stop_after is None else min(args.epochs, args.stop_after)
        losses = []
        for epoch in range(start_epoch, stop):
            sampler.set_epoch(epoch)  # a different, agreed shuffle each epoch
            for x, y in loader:
                x, y = x.to(info.device), y.to(info.device)
                x = x + 0.1 * torch.randn_like(x)  # noise from the global RNG: per-rank state
                loss = F.cross_entropy(ddp_model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                losses.append(loss.item())
            # Every rank calls these (collectives); only global rank 0 writes.
            if is_save_epoch(epoch, args.epochs, args.save_every):
                state = training_state(ddp_model, optimizer, epoch=epoch + 1, step=step)
                save_checkpoint(snapshot_path(args.checkpoint_dir, step), state)
                print0(f"epoch {epoch}: saved snapshot at step {step}")
        finished = stop == args.epochs
        if finished:
            save_checkpoint(f"{args.checkpoint_dir}/final.pt", model_state(ddp_model))
        write_rank_record(
            args.out,
            {
                "local_rank": info.local_rank,
                "world_size": info.world_size,
                "pid": os.getpid(),
                "resumed_from": resumed_from,
                "start_epoch": start_epoch,
                "epochs_run": list(range(start_epoch, stop)),
                "steps": step,
                "finished": finished,
                "losses": losses,
                "ddp_keys": list(ddp_model.state_dict())[:2],
                "plain_keys": list(model_state(ddp_model))[:2],
                "snapshots": [p.name for _, p in list_snapshots(args.checkpoint_dir)],
            },
        )


if __name__ == "__main__":
    main()
