"""The template's workload in the loops users would write instead: bare DDP, or Lightning Fabric.

The question: is the template (``scripts/train.py``) as fast as what a
practitioner would pick instead, on the same model, data, batch and optimizer.
This script is the other side of that comparison (``scripts/compare/speed.py``
interleaves the launches):

* ``--framework bare``: the shortest correct DDP loop — ``init_process_group``,
  ``DDP(model)``, a ``DistributedSampler``, forward/backward/step — with no
  checkpoints, evaluation, logging or recorder;
* ``--framework fabric``: the same loop through Lightning Fabric's DDP strategy
  (``fabric.setup``, ``setup_dataloaders``, ``fabric.backward``).

Lightning is *not* a dependency of this project and never becomes one: install
it into a scratch folder that reuses the venv's torch, and put that folder on
``PYTHONPATH`` for the fabric launches only::

    .venv/bin/pip install --no-deps --target /tmp/fabric-pkgs \\
        lightning lightning-utilities torchmetrics
    PYTHONPATH=/tmp/fabric-pkgs .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        scripts/compare/loops.py --framework fabric --model cnn --out runs/fabric-cnn

The workload matches the template's: ``build_model(model, 10, image_size)``
seeded with ``--seed``, ``SyntheticImages(num_samples, image_size, 10, seed=0)``,
a per-rank batch of ``--batch-size`` with ``drop_last=True`` and a shuffled
DistributedSampler, SGD with momentum 0.9, cross-entropy, one epoch or
``--max-steps``. Timing matches the template's recorder: the first
``--warmup`` optimizer steps are not counted; every rank measures wall time
from the end of that step to the end of its last step, and throughput =
counted steps x batch x world size / the slowest rank's seconds. No per-step
``.item()``; the loss is read once, at the end. Rank 0 writes
``--out``/metrics.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before init, or exit can SIGABRT (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.distributed import job_backend
from ddp_tutorial.models import MODEL_NAMES, build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODEL_NAMES, default="cnn")
    p.add_argument("--image-size", type=int, default=32, help="height = width, pixels")
    p.add_argument("--num-samples", type=int, default=8192, help="training samples")
    p.add_argument("--batch-size", type=int, default=32, help="PER RANK, not global")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the shuffle")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps not counted")
    p.add_argument("--framework", choices=["bare", "fabric"], default="bare")
    p.add_argument("--accelerator", default="auto", help="Fabric accelerator: auto, cpu, cuda")
    p.add_argument("--out", default=None, help="directory for metrics.json (rank 0 writes it)")
    args = p.parse_args(argv)
    for name in ("num_samples", "batch_size", "image_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_workers < 0:
        p.error("--num-workers must be >= 0")
    if args.warmup < 1:
        p.error("--warmup must be at least 1: the clock starts at the end of a step")
    return args


def make_fabric(accelerator: str) -> Any:
    """A DDP Fabric sized from torchrun's environment (one process when run without it)."""
    from lightning.fabric import Fabric

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(local_world)))
    return Fabric(
        accelerator=accelerator,
        strategy="ddp",
        devices=local_world,
        num_nodes=max(1, world // local_world),
    )


class Bare:
    """The few calls of a bare DDP loop, with the names Fabric gives them."""

    def __init__(self) -> None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # One backend for the whole job, chosen from the node (not per rank: one GPU and
        # --nproc 2 would give rank 0 nccl and rank 1 gloo, and init would hang).
        backend, _ = job_backend(None, rank, world, local_world)
        cuda = backend == "nccl"
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend, timeout=timedelta(seconds=120), device_id=self.device if cuda else None
        )
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def setup(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model.to(self.device), device_ids=ids), optimizer

    def setup_dataloaders(self, loader: DataLoader) -> Any:
        # one epoch timed: no set_epoch needed
        sampler = DistributedSampler(loader.dataset, shuffle=True)  # ddp-lint: ignore[DDP103]
        plain = DataLoader(loader.dataset, loader.batch_size, sampler=sampler, drop_last=True,
                           num_workers=loader.num_workers,
                           persistent_workers=loader.num_workers > 0,
                           pin_memory=self.device.type == "cuda")  # fmt: skip
        return ((x.to(self.device), y.to(self.device)) for x, y in plain), len(plain)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor / self.world_size if reduce_op == "mean" else tensor

    def barrier(self) -> None:
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.framework == "fabric":
        fabric = make_fabric(args.accelerator)
        fabric.launch()  # under torchrun: joins the process group, starts nothing
    else:
        fabric = Bare()

    torch.manual_seed(args.seed)  # the same initial weights on every rank, as the template
    model = build_model(args.model, 10, args.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(
        SyntheticImages(args.num_samples, args.image_size, 10, seed=0),
        batch_size=args.batch_size,
        shuffle=True,  # Fabric swaps in DistributedSampler(shuffle=True)
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
        drop_last=True,
    )
    if args.framework == "fabric":
        loader = fabric.setup_dataloaders(loader)
        batches = len(loader)
    else:
        loader, batches = fabric.setup_dataloaders(loader)
    loss_fn = nn.CrossEntropyLoss()

    steps = batches if args.max_steps is None else min(args.max_steps, batches)
    if steps <= args.warmup:
        raise SystemExit(
            f"{steps} steps leave none to time after {args.warmup} warm-up steps: "
            "raise --num-samples or --max-steps"
        )

    model.train()
    loss_sum = torch.zeros((), device=fabric.device)
    start = 0.0
    step = 0
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        loss_sum += loss.detach()  # no .item(): no host sync per step
        step += 1
        if step == args.warmup:
            if fabric.device.type == "cuda":
                torch.cuda.synchronize(fabric.device)  # once: the clock starts after the GPU
            start = time.perf_counter()
        if step == steps:
            break
    if fabric.device.type == "cuda":
        torch.cuda.synchronize(fabric.device)
    end = time.perf_counter()

    # Each rank's seconds in its own slot, summed: fabric.all_gather would do, but on
    # torch 2.14 it warns that torch.distributed.nn.functional.all_gather is deprecated.
    seconds = torch.zeros(fabric.world_size, dtype=torch.float64, device=fabric.device)
    seconds[fabric.global_rank] = end - start
    seconds = fabric.all_reduce(seconds, reduce_op="sum").tolist()
    mean_loss = fabric.all_reduce(loss_sum / step, reduce_op="mean").item()  # the one .item()
    counted = steps - args.warmup
    metrics = {
        "samples_per_sec": counted * args.batch_size * fabric.world_size / max(seconds),
        "steps": steps,
        "counted_steps": counted,
        "warmup_steps": args.warmup,
        "world_size": fabric.world_size,
        "batch_size": args.batch_size,
        "rank_seconds": seconds,
        "mean_loss": mean_loss,
        "model": args.model,
        "image_size": args.image_size,
        "num_samples": args.num_samples,
        "num_workers": args.num_workers,
        "torch_threads": torch.get_num_threads(),
        "device": str(fabric.device),
        "framework": args.framework,
        "lightning_version": version("lightning") if args.framework == "fabric" else None,
        "torch_version": torch.__version__,
    }
    if fabric.global_rank == 0:
        print(json.dumps(metrics, indent=2))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    fabric.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # join gloo's threads while Python is alive


if __name__ == "__main__":
    main()
