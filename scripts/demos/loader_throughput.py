"""Per-rank DataLoader throughput for several ``num_workers`` settings.

Run it from the shell:

    torchrun --standalone --nproc-per-node 2 scripts/demos/loader_throughput.py --workers 0 2

Every rank loads ``SyntheticImages`` (each sample is generated on the fly,
a few hundred microseconds of CPU, like decoding a JPEG) through its own
DataLoader with a DistributedSampler, and runs a small CNN training step on
each batch, so loading and compute compete for the CPU as in real training.
For each ``num_workers`` it times ``--epochs`` epochs and records samples
per second, the time to the first batch (worker start-up), and how many worker
processes the rank had started by then.

Every worker is a process: 2 ranks x 2 workers is 6 busy processes. Seed
001 hard-codes ``num_workers=8`` per rank; on a machine with fewer cores
than ranks x workers, extra workers only compete with each other. torchrun
sets ``OMP_NUM_THREADS=1`` per rank for the same reason. ``pin_memory`` only
helps copies to a GPU: on a CPU-only run PyTorch warns and ignores it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import warnings

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.distributed import process_group
from ddp_tutorial.lessons.perf import clock
from ddp_tutorial.models import SmallCNN
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="settings to time")
    parser.add_argument("--num-samples", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-compute", action="store_true", help="time loading alone")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def time_loader(args: argparse.Namespace, num_workers: int, device: torch.device) -> dict:
    dataset = SyntheticImages(args.num_samples, image_size=args.image_size)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",  # only a GPU copy benefits
            persistent_workers=num_workers > 0,  # keep workers alive across epochs
        )
    torch.manual_seed(0)
    model = SmallCNN(3, dataset.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    labels_seen: list[int] = []
    epoch_seconds, first_batch_s, workers_at_first_batch = [], None, None
    children_before = len(multiprocessing.active_children())  # none of this loader's yet
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = clock(device)
        for x, y in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - start
                # worker processes of this rank alive when the first batch arrived
                workers_at_first_batch = len(multiprocessing.active_children()) - children_before
            labels_seen += y.tolist()
            if not args.no_compute:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        epoch_seconds.append(clock(device) - start)  # on a GPU: after its queued work
    n = len(sampler)
    return {
        "num_workers": num_workers,
        "epoch_seconds": epoch_seconds,
        "samples_per_sec": [n / s for s in epoch_seconds],
        "first_batch_s": first_batch_s,
        "workers_at_first_batch": workers_at_first_batch,
        "samples": len(labels_seen),
        "labels_checksum": sum(i * y for i, y in enumerate(labels_seen)),
        "warnings": [str(w.message) for w in caught],
    }


@record
def main() -> None:
    args = parse_args()
    with process_group() as info:
        results = []
        for w in args.workers:
            res = time_loader(args, w, info.device)
            results.append(res)
            print(
                f"rank {info.rank}: num_workers={w}: "
                f"{', '.join(f'{s:.0f}' for s in res['samples_per_sec'])} samples/s per epoch, "
                f"first batch after {res['first_batch_s']:.2f} s",
                flush=True,
            )
        write_rank_record(
            args.out,
            {
                "results": results,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "torch_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "device": str(info.device),
            },
        )


if __name__ == "__main__":
    main()
