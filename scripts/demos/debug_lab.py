"""The debugging lab: each ``--case`` reproduces one classic DDP failure; ``--fix`` repairs it.

    torchrun --standalone --nproc-per-node 2 scripts/demos/debug_lab.py --case unused
    TORCH_DISTRIBUTED_DEBUG=INFO torchrun ... debug_lab.py --case unused        # names them
    torchrun ... debug_lab.py --case skip --timeout 3                           # hangs 3 s
    torchrun ... debug_lab.py --case skip --monitored --timeout 3               # names rank 1
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... debug_lab.py --case shape
    torchrun ... debug_lab.py --case rank0-eval --timeout 3
    torchrun ... debug_lab.py --case rank0-eval --timeout 3 --flight-recorder --out runs/fr
    python -m torch.distributed.flight_recorder.fr_trace runs/fr/flight_recorder  # who differs
    torchrun ... debug_lab.py --case uneven --timeout 3
    torchrun ... debug_lab.py --case slow --timeout 3 --backend nccl            # NCCL's watchdog
    torchrun ... debug_lab.py --case all --fix            # every repaired case, one launch
    torchrun ... debug_lab.py --case breakpoint           # rank 0 stops in pdb
    python -m pdb scripts/demos/debug_lab.py --case keys  # a world of one: plain pdb

Every case is a few lines in a function below, the bug and its fix side by
side (``if fix:``). The process group gets a short timeout (``--timeout``,
default ``$DDP_TUTORIAL_TIMEOUT`` or 60 s): a rank stuck in a collective fails
in seconds with gloo's ``Timed out waiting …`` instead of hanging for the
default 30 minutes (gloo's; nccl's is 10: ``torch.distributed.constants``,
torch 2.14). gloo is the default backend because the lesson reads
gloo's messages; ``--backend nccl`` runs the same cases on GPUs (every tensor
and model on ``cuda:LOCAL_RANK``; the monitored barrier on a gloo side group).
``--case breakpoint`` stops rank 0 in pdb with ``torch.distributed.breakpoint()``
(the others wait at a barrier); it reads pdb commands from the terminal that
started torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial import settings
from ddp_tutorial.checkpoint import strip_prefixes
from ddp_tutorial.distributed import DistInfo, process_group, wrap
from ddp_tutorial.records import write_rank_record

FEATURES, CLASSES = 8, 3


def batches(rank: int, count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` small deterministic batches for this rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(size, FEATURES, generator=g), torch.randint(0, CLASSES, (size,), generator=g))
        for _ in range(count)
    ]


def train_steps(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Plain SGD steps; DDP all_reduces the gradients inside ``backward``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = next(model.parameters()).device
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class WithAux(nn.Module):
    """A model with an auxiliary head that ``forward`` never uses (a common accident)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, CLASSES)
        self.aux = nn.Linear(FEATURES, CLASSES)  # built, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def case_unused(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Unused parameters: the second iteration fails ("Expected to have finished reduction")."""
    torch.manual_seed(0)
    # The fix: tell DDP to look for unused parameters (or delete/freeze the dead head).
    model = wrap(WithAux(), info.device, find_unused_parameters=fix)
    losses = train_steps(model, batches(info.rank, 3))
    return {"losses": losses}


def case_skip(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """A collective inside a rank-dependent branch: rank 1 skips it, rank 0 waits for it."""
    correct = torch.tensor([float(info.rank != 1), 1.0], device=info.device)  # rank 1: none
    # The bug: "nothing to add, skip the all_reduce" — but a collective needs every rank.
    if fix or correct[0] > 0:
        if args.monitored:  # debugging aid: rank 0 names every rank that never gets here
            # (a shorter timeout than the hang's, so that rank 0 reports first)
            # monitored_barrier needs a CPU backend: gloo itself, or a gloo side group
            # next to nccl (args.cpu_group, made in main()).
            wait = timedelta(seconds=args.timeout / 2)
            dist.monitored_barrier(group=args.cpu_group, timeout=wait, wait_all_ranks=True)
        dist.all_reduce(correct)
    dist.barrier()  # e.g. before saving a checkpoint
    return {"correct": correct.tolist()}


def case_shape(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Ranks all_reduce tensors of different shapes (per-rank counts of the classes they saw)."""
    labels = torch.tensor([0, 1] if info.rank == 0 else [0, 1, 2])
    # The bug: bincount's length depends on this rank's data. The fix: a fixed length.
    counts = torch.bincount(labels, minlength=CLASSES if fix else 0).float().to(info.device)
    dist.all_reduce(counts)
    return {"counts": counts.tolist()}


class WithBatchNorm(nn.Sequential):
    """Linear + BatchNorm: the BatchNorm buffers are what DDP broadcasts before a forward."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def case_rank0_eval(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0 alone evaluates the DDP model: its forward broadcasts buffers — a collective."""
    torch.manual_seed(0)
    model = wrap(WithBatchNorm(), info.device)
    train_steps(model, batches(info.rank, 2))
    accuracy = None
    if info.rank == 0:
        x, y = batches(99, 1, size=32)[0]
        # The bug: model(x) on one rank. The fix: the plain module, no DDP, no collective.
        net = model.module if fix else model
        net.eval()
        with torch.no_grad():
            accuracy = (net(x.to(info.device)).argmax(1).cpu() == y).float().mean().item()
        net.train()
    dist.barrier()  # the others wait here, e.g. before the next epoch
    return {"accuracy": accuracy}


def case_uneven(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 1 has one batch more than rank 0: its last backward waits for a partner."""
    torch.manual_seed(0)
    model = wrap(nn.Linear(FEATURES, CLASSES), info.device)
    data = batches(info.rank, 2 + info.rank)
    if fix:
        # Join: a rank that runs out of data shadows the others' all_reduces (with zeros)
        # until every rank is done, so nobody waits for a batch that never comes.
        with Join([model]):
            losses = train_steps(model, data)
    else:
        losses = train_steps(model, data)
    dist.barrier()
    return {"batches": len(data), "losses": losses}


def case_slow(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0 works alone (tokenising, saving) for longer than the timeout; the others wait.

    Not a desync: every rank calls the same collectives. The others just wait
    longer than the timeout allows; the fix is a timeout longer than the work
    (or doing the work on every rank, or before the group exists).
    """
    if info.rank == 0:
        time.sleep(0.1 if fix else 2 * args.timeout)
    total = torch.ones(1, device=info.device)
    dist.all_reduce(total)
    return {"total": total.item()}


def case_keys(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Weights saved from the DDP wrapper ("module.weight") loaded into the plain model."""
    torch.manual_seed(0)
    model = wrap(nn.Linear(FEATURES, CLASSES), info.device)
    saved = model.state_dict()  # the bug: the wrapper's keys, "module.weight", "module.bias"
    plain = nn.Linear(FEATURES, CLASSES).to(info.device)
    if fix:
        plain.load_state_dict(model.module.state_dict())  # save the module, not the wrapper
        plain.load_state_dict(strip_prefixes(saved))  # files already written: strip the prefix
    else:
        plain.load_state_dict(saved)
    return {"saved_keys": sorted(saved)}


def case_breakpoint(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Stop rank 0 in pdb; the other ranks wait at a barrier until it continues."""
    answer = 40 + info.rank
    dist.breakpoint(rank=0)  # pdb on rank 0, reading the launching terminal's stdin
    answer += 2  # the pdb session may have changed `answer` on rank 0
    return {"answer": answer}


def case_wrap(info: DistInfo, fix: bool, args: argparse.Namespace) -> dict[str, Any]:
    """DDP(...) and nothing else: under TORCH_DISTRIBUTED_DEBUG=DETAIL on a machine without a
    GPU, torch 2.14.1's CUDA build crashes in the constructor itself (lesson 09, section 5)."""
    wrap(WithBatchNorm(), info.device)
    return {"wrapped": True}


CASES = {
    "unused": case_unused,
    "wrap": case_wrap,
    "skip": case_skip,
    "shape": case_shape,
    "rank0-eval": case_rank0_eval,
    "uneven": case_uneven,
    "slow": case_slow,
    "keys": case_keys,
    "breakpoint": case_breakpoint,
}
FIXABLE = ["unused", "skip", "shape", "rank0-eval", "uneven", "keys"]
DDP_CASES = {"unused", "wrap", "rank0-eval", "uneven", "keys"}  # those that wrap a model in DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, choices=[*CASES, "all"])
    parser.add_argument("--fix", action="store_true", help="run the repaired code")
    parser.add_argument(
        "--breakpoint", action="store_true", help="then stop rank 0 in pdb (dist.breakpoint)"
    )
    parser.add_argument("--monitored", action="store_true", help="skip: add a monitored_barrier")
    parser.add_argument(
        "--timeout",
        type=float,
        default=settings.timeout_s(),
        help="seconds a collective may wait before the rank fails",
    )
    parser.add_argument(
        "--backend",
        default="gloo",
        help="gloo (default: the lesson reads gloo's messages) or nccl (lesson 09's GPU branch)",
    )
    parser.add_argument(
        "--flight-recorder",
        action="store_true",
        help="on a failure each rank dumps its Flight Recorder to OUT/flight_recorder/rank_R",
    )
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    args = parser.parse_args()
    if args.case == "all" and not args.fix:
        parser.error("--case all runs the fixed versions only: add --fix")
    return args


def flight_recorder_names_groups(info: DistInfo) -> None:
    """torch 2.14.1: a gloo group records its ranks in the Flight Recorder before it gets its
    name, and the analyser then cannot match the entries to a group (``KeyError: ('0', 0)``).
    Attaching the recorder's hook records them again, under the name; removed at once."""
    if info.backend == "gloo":
        from torch._C._distributed_c10d import FlightRecorderHook

        FlightRecorderHook.attach(dist.group.WORLD).remove()


def dump_flight_recorder(out: str | None, rank: int) -> Path:
    """This rank's Flight Recorder (its last collectives, each with its Python stack), where
    torch's analyser reads it: one file per rank, a prefix and the rank. nccl's watchdog
    writes the same file by itself on a timeout (TORCH_FR_DUMP_TEMP_FILE); gloo only when
    asked, as here after the collective failed."""
    from torch._C._distributed_c10d import _dump_fr_trace

    folder = Path(out or ".") / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    dump = _dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    partial = folder / f".rank_{rank}.tmp"  # whole or absent: torchrun may stop this rank
    partial.write_bytes(dump)
    partial.replace(folder / f"rank_{rank}")
    return folder


@record
def main() -> None:
    args = parse_args()
    names = FIXABLE if args.case == "all" else [args.case]
    if DDP_CASES.intersection(names):
        # DDP's constructor imports torch._dynamo: seconds on a busy machine, and not the
        # same seconds on every rank. Imported now, before the short timeout applies, a
        # slow import cannot pass for a hang (habit 1: shorten the timeout once the slow,
        # uneven start-up is over).
        importlib.import_module("torch._dynamo")
    # setup() joins with a generous timeout (a slow start-up is not a hang), then sets
    # --timeout: from there on a collective that waits longer fails instead of hanging.
    with process_group(backend=args.backend, timeout_s=args.timeout) as info:
        # monitored_barrier runs on a CPU backend only: beside nccl, a gloo side group
        # (made by every rank, in the same order, like any group).
        args.cpu_group = dist.new_group(backend="gloo") if info.backend == "nccl" else None
        if args.flight_recorder:
            flight_recorder_names_groups(info)
        results = {}
        for name in names:
            try:
                results[name] = CASES[name](info, args.fix, args)
            except Exception:
                if args.flight_recorder:
                    folder = dump_flight_recorder(args.out, info.rank)
                    print(f"rank {info.rank}: Flight Recorder dumped to {folder}")
                raise
            print(f"rank {info.rank}: case {name} (fix={args.fix}) finished: {results[name]}")
        if args.breakpoint and args.case != "breakpoint":
            results["breakpoint"] = case_breakpoint(info, args.fix, args)
        write_rank_record(args.out, {"world_size": info.world_size, "cases": results})


if __name__ == "__main__":
    main()
