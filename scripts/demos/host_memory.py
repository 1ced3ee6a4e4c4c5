"""Host memory per node: ranks x DataLoader workers, for a dataset of Python objects or arrays.

    torchrun --standalone --nproc-per-node 2 scripts/demos/host_memory.py --kind list
    torchrun --standalone --nproc-per-node 2 scripts/demos/host_memory.py --kind tensor

Each rank builds the index of an image dataset — ``--samples`` (path, label) pairs, as
torchvision's ``ImageFolder`` keeps them in ``.samples`` — reads its shard once through a
DataLoader with ``--num-workers`` workers, and records the memory of itself and of each worker
(psutil: USS, the pages only that process holds; PSS, its own pages plus its share of the
shared ones — summed over processes, what the node really uses).

``list``: a Python list of tuples. A forked worker shares the rank's pages until it writes
one, and reading a Python object writes to it (its reference count): each worker ends up
with its own copy of every page it read. ``tensor``: the same index in two tensors;
reading an item writes nothing, and the pages stay shared.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def image_index(samples: int) -> list[tuple[str, int]]:
    """(path, label) pairs of a 1000-class image folder."""
    return [(f"train/n{i % 1000:08d}/img_{i:08d}.JPEG", i % 1000) for i in range(samples)]


class ListIndex(Dataset):
    """The usual way: a list of Python tuples (ImageFolder's ``samples``)."""

    def __init__(self, samples: int) -> None:
        self.samples = image_index(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        path, label = self.samples[i]  # a real dataset would open the file here
        return len(path) + label


class TensorIndex(Dataset):
    """The same index in two tensors (the paths' bytes, one row each; the labels): no Python
    object per sample. numpy arrays behave the same under fork."""

    def __init__(self, samples: int) -> None:
        pairs = image_index(samples)
        paths = np.array([p for p, _ in pairs], dtype=np.bytes_)  # fixed width
        self.paths = torch.from_numpy(paths.view(np.uint8).reshape(len(pairs), -1))
        self.labels = torch.tensor([c for _, c in pairs], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> int:
        path = bytes(self.paths[i].numpy()).rstrip(b"\0").decode()
        return len(path) + int(self.labels[i])


def memory(process: psutil.Process) -> dict[str, int]:
    info = process.memory_full_info()  # reads /proc/PID/smaps_rollup on Linux
    return {"uss": info.uss, "pss": info.pss, "rss": info.rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=["list", "tensor"], required=True)
    p.add_argument("--samples", type=int, default=300_000)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--out", type=Path, default=Path("host_memory"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, me = dist.get_rank(), psutil.Process()
    before = memory(me)["uss"]
    dataset = ListIndex(args.samples) if args.kind == "list" else TensorIndex(args.samples)
    built = memory(me)["uss"] - before  # what the index costs one process
    if isinstance(dataset, TensorIndex):  # the temporary list's freed memory is not the index
        built = dataset.paths.nbytes + dataset.labels.nbytes
    loader = DataLoader(
        dataset,
        batch_size=512,
        sampler=DistributedSampler(dataset, shuffle=True, seed=0),
        num_workers=args.num_workers,
        persistent_workers=True,  # alive after the pass: measured below
        multiprocessing_context="fork",  # Linux's default up to Python 3.13: the rank's pages
    )
    seen = sum(int(batch.numel()) for batch in loader)  # one epoch of this rank's shard
    record = {
        "rank": rank,
        "kind": args.kind,
        "samples": args.samples,
        "seen": seen,
        "index_bytes": built,
        "self": memory(me),
        "workers": [memory(child) for child in me.children()],
        "total_ram": psutil.virtual_memory().total,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    del loader  # the workers end
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
