"""What DistributedSampler gives each rank, and why validation needs a different sampler.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/sampling.py --length 21 --epochs 3

Part 1, sampling. Every rank builds the same ``DataLoader`` over a dataset
whose item ``i`` is ``i`` (so a rank can report exactly what it received)
with a ``DistributedSampler``, and records the indices of each epoch three
ways: with ``sampler.set_epoch(epoch)`` (correct), without it (seed 001),
and with ``drop_last=True``.

Part 2, evaluation (with ``--model PATH``). Every rank loads the same
trained MLP and evaluates it (in a training script: the plain model inside
DDP, ``ddp_model.module``) on a validation set of ``--val-length`` samples,
with the functions lesson 02 shows (``validation_shard``, ``evaluate_sums``,
``gather_predictions``; torch only, to copy): accuracy the naive way (the
padded DistributedSampler, sums all-reduced) and the exact way (no padding),
and macro F1, a metric that is not a sum, from every rank's predictions
gathered with their sample indices, next to the mean of the ranks' own F1s.

Part 3, pipelines (with ``--pipelines``). Every rank reads
``ddp_tutorial.pipelines.RandomCrops`` through a DataLoader with ``--workers``
workers (``--draws`` items per worker, whatever the world size),
seeded as most scripts do (``torch.manual_seed(42)`` everywhere) and as
``ddp_tutorial.seeding`` does (a seed per rank, a loader ``generator``,
``worker_init_fn=seed_worker``), and records every random crop and flip;
then reads ``NumberStream``, an IterableDataset of ``--stream-per-reader``
records per reader (world size x workers readers, so every rank gets as many),
unsharded and sharded by rank and worker, and records every number it got.
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.data import GaussianBlobs, IndexDataset
from ddp_tutorial.distributed import process_group
from ddp_tutorial.lessons.sampling import macro_f1
from ddp_tutorial.models import MLP
from ddp_tutorial.pipelines import NumberStream, RandomCrops
from ddp_tutorial.records import write_rank_record
from ddp_tutorial.seeding import loader_generator, seed_rank, seed_worker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=21, help="dataset length (try an odd one)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (same on every rank)")
    parser.add_argument("--model", default=None, help="state_dict of the MLP to evaluate")
    parser.add_argument("--val-length", type=int, default=301)
    parser.add_argument("--val-seed", type=int, default=1)
    parser.add_argument("--val-batch-size", type=int, default=64, help="per rank, in evaluation")
    parser.add_argument("--pipelines", action="store_true", help="part 3: augmentation, streams")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers in part 3")
    parser.add_argument("--draws", type=int, default=4, help="augmented items per worker")
    parser.add_argument("--stream-per-reader", type=int, default=3, help="stream records")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def epoch_indices(length: int, args: argparse.Namespace, *, set_epoch: bool, drop_last: bool):
    """The indices this rank's loader yields in each epoch (a list per epoch)."""
    dataset = IndexDataset(length)
    # num_replicas / rank default to the process group's world size and rank.
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    epochs = []
    for epoch in range(args.epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # reshuffle: a different order every epoch
        epochs.append([int(i) for batch in loader for i in batch])
    return epochs


def augmentations(rank: int, per_rank_seed: bool, workers: int, length: int) -> list[dict]:
    """Every random draw this rank's loader made over its shard of ``RandomCrops``."""
    if per_rank_seed:  # ddp_tutorial.seeding: after the model is built, before the loaders
        seed_rank(42, rank)
        extra = {"generator": loader_generator(42, rank, epoch=0), "worker_init_fn": seed_worker}
    else:  # what most scripts do: the same seed on every rank, and nothing for the workers
        torch.manual_seed(42)
        extra = {}
    dataset = RandomCrops(length, seed=42)
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers, **extra)
    return list(loader)


def stream(rank: int, world_size: int, sharded: bool, workers: int, length: int) -> list[int]:
    """The records this rank's loader read from ``NumberStream`` (no sampler can split it)."""
    dataset = NumberStream(length, rank, world_size, sharded=sharded)
    loader = DataLoader(dataset, batch_size=4, num_workers=workers)
    return [int(i) for batch in loader for i in batch]


def validation_shard(dataset: Dataset, padded: bool = False) -> list[int]:
    """The validation samples this rank evaluates."""
    if padded:  # "the same way as training": repeats samples until the ranks have as many
        return list(DistributedSampler(dataset, shuffle=False))
    return list(range(dist.get_rank(), len(dataset), dist.get_world_size()))  # r, r+N, ...


def evaluate_sums(
    model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int, padded: bool = False
) -> torch.Tensor:
    """[correct, count, loss sum] over every rank's shard, on every rank: a collective.

    Pass the plain model (``ddp_model.module``): the ranks may run different numbers of
    batches, which is safe only while no batch runs a collective.
    """
    loader = DataLoader(Subset(dataset, validation_shard(dataset, padded)), batch_size=batch_size)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            sums[0] += (logits.argmax(dim=1) == y).sum()
            sums[1] += len(y)
            sums[2] += nn.functional.cross_entropy(logits, y, reduction="sum")
    dist.all_reduce(sums)  # sums add up over ranks: accuracy = correct / count, once
    return sums


def gather_predictions(
    model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 256
) -> torch.Tensor:
    """Every rank: the model's prediction for every sample of ``dataset``, in dataset order."""
    sampler = DistributedSampler(dataset, shuffle=False)  # padded: one shape on every rank
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    index = torch.tensor(list(sampler), device=device)  # this rank's samples, in loader order
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x.to(device)).argmax(dim=1) for x, _ in loader])
    mine = torch.stack([index, pred])  # [2, samples per rank]
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)  # a collective: every rank calls it
    index, pred = torch.cat(parts, dim=1)
    order = torch.argsort(index, stable=True)
    index, pred = index[order], pred[order]
    first = torch.ones_like(index, dtype=torch.bool)
    first[1:] = index[1:] != index[:-1]  # the padding repeats a sample: keep each index once
    return pred[first]


TAUGHT = (validation_shard, evaluate_sums, gather_predictions)  # lesson 02 shows these


def evaluate(args: argparse.Namespace, device: torch.device) -> dict:
    """Part 2: accuracy naive and exact, macro F1 gathered and averaged over ranks."""
    val = GaussianBlobs(args.val_length, seed=args.val_seed)
    model = MLP(val.num_features, val.num_classes)
    model.load_state_dict(torch.load(args.model, weights_only=True, map_location=device))
    model.to(device)  # the plain model: after training with DDP, pass ddp_model.module
    out: dict = {"ran": {f.__name__: inspect.getsource(f) for f in TAUGHT}}
    forwards: list[int] = []  # one per batch this rank ran (the lesson counts them)
    counting = model.register_forward_hook(lambda *_: forwards.append(1))
    for name, padded in (("naive", True), ("exact", False)):
        forwards.clear()
        correct, count, loss_sum = evaluate_sums(model, val, device, args.val_batch_size, padded)
        local_count = len(validation_shard(val, padded))
        out[name] = {
            "correct": int(correct),
            "count": int(count),
            "local_count": local_count,
            "batches": len(forwards),
            "accuracy": (correct / count).item(),
            "loss": (loss_sum / count).item(),
        }
        print(
            f"rank {dist.get_rank()}: {name:5s} evaluation counted {int(count)} samples "
            f"({local_count} here), accuracy {out[name]['accuracy']:.4f}",
            flush=True,
        )
    counting.remove()
    pred = gather_predictions(model, val, device)  # every sample once, in order
    mine = validation_shard(val)  # this rank's own samples, no padding
    shard_f1 = macro_f1(pred[mine].cpu(), val.targets[mine], val.num_classes)
    shard_f1 = torch.tensor(shard_f1, dtype=torch.float64, device=device)
    dist.all_reduce(shard_f1)  # the tempting shortcut: the mean of every rank's own F1
    out["f1"] = {
        "gathered": macro_f1(pred.cpu(), val.targets, val.num_classes),
        "mean_of_ranks": shard_f1.item() / dist.get_world_size(),
        "predictions": pred.tolist(),
    }
    return out


@record
def main() -> None:
    args = parse_args()
    with process_group() as info:
        record_ = {
            "world_size": info.world_size,
            "with_set_epoch": epoch_indices(args.length, args, set_epoch=True, drop_last=False),
            "without_set_epoch": epoch_indices(args.length, args, set_epoch=False, drop_last=False),
            "drop_last": epoch_indices(args.length, args, set_epoch=True, drop_last=True),
        }
        if args.model:
            record_.update(evaluate(args, info.device))
        if args.pipelines:
            readers = info.world_size * max(1, args.workers)  # every worker of every rank
            crops = args.draws * readers  # so that each worker draws --draws items
            record_["augment"] = {
                name: augmentations(info.rank, per_rank, args.workers, crops)
                for name, per_rank in (("same seed", False), ("seeded per rank", True))
            }
            record_["stream_length"] = length = args.stream_per_reader * readers
            record_["stream"] = {
                name: stream(info.rank, info.world_size, sharded, args.workers, length)
                for name, sharded in (("unsharded", False), ("sharded", True))
            }
        first = record_["with_set_epoch"][0]
        print(f"rank {info.rank}: epoch 0 indices {first}", flush=True)
        write_rank_record(args.out, record_)


if __name__ == "__main__":
    main()
