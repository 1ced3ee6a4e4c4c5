"""How fast is DDP here? One command, every configuration, the same model and data.

    python scripts/benchmark.py --out runs/bench.json           # the full run
    python scripts/benchmark.py --quick --out runs/quick.json   # small enough for tests

Every throughput comes from ``step_times`` (warm-up steps not timed; on
GPUs synchronised before the clock is read) and, under DDP, from the slowest
rank's time (``slowest_rank``). It measures:

* ``plain_1thread`` / ``plain_all_cores``: a plain single-process loop (on
  GPUs: one process on ``cuda:0``, for both);
* ``ddp_world1``: the same loop under DDP with one rank — the wrapper's cost;
* ``ddp_worldN``: N ranks (CPU: 2 × 1 thread; GPUs: one per GPU);
* ``plain_concurrent``: N plain processes that never communicate (on GPUs one
  GPU each); ``hardware_ceiling`` = their throughput / (N × plain_1thread):
  on a quiet machine, about the most any N-rank job can reach here, DDP or not;
* an all_reduce sweep (1 KiB → 64 MiB on a CPU, → 1 GiB on GPUs) with the
  algorithm and bus bandwidth nccl-tests reports (busbw = algbw · 2(N−1)/N),
  fitted with the ring model t ≈ 2(N−1)·α + 2(N−1)/N · S/B;
* knobs on a larger model: ``bucket_cap_mb``, ``gradient_as_bucket_view``,
  ``static_graph``, ``find_unused_parameters``, ``no_sync`` accumulation,
  DataLoader ``num_workers`` per rank, threads per rank;
* the template (``scripts/train.py``, with its monitor, progress bar and
  metrics) against the bare DDP loop fed by a DataLoader, on the same model,
  optimizer (SGD, no clipping) and DDP settings (buffers not broadcast).

The script runs itself in worker roles (``--role plain`` in a subprocess,
``--role ddp`` under torchrun) so that every configuration gets a fresh
process with its own thread settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from ddp_tutorial import settings
from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.distributed import process_group, wrap
from ddp_tutorial.lessons import perf
from ddp_tutorial.lessons.anatomy import CommCounter, counting_allreduce_hook
from ddp_tutorial.models import MLP, build_model
from ddp_tutorial.recorder import WARMUP_STEPS
from ddp_tutorial.records import format_table, write_json
from ddp_tutorial.settings import usable_cores

HERE = Path(__file__).resolve()
KNOB_GROUPS = ("buckets", "bucket_view", "static_graph", "find_unused", "no_sync", "workers",
               "threads")  # fmt: skip
"""The knobs measured on the larger model, in groups (``--knobs``); the baseline always runs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests (~1 min on CPU)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--model", default="cnn", help="throughput model (the template's default)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    p.add_argument("--nproc", type=int, default=None, help="ranks for ddp_worldN")
    p.add_argument("--knob-hidden", type=int, default=None, help="width of the knobs' MLP")
    p.add_argument("--no-knobs", action="store_true")
    p.add_argument(
        "--knobs",
        default=",".join(KNOB_GROUPS),
        help=f"which knob groups to measure, comma-separated (default: all of {KNOB_GROUPS})",
    )
    p.add_argument("--no-template", action="store_true")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration (best kept)")
    # worker roles (internal)
    p.add_argument("--role", choices=["orchestrate", "plain", "ddp"], default="orchestrate")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--extras", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gate", default=None, help=argparse.SUPPRESS)  # the concurrent processes'
    p.add_argument("--gate-count", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.knobs = [k for k in args.knobs.split(",") if k]
    if unknown := set(args.knobs) - set(KNOB_GROUPS):
        p.error(f"unknown knob groups {sorted(unknown)}; choose from {KNOB_GROUPS}")
    defaults = {"steps": (8, 40), "warmup": (2, 5), "knob_hidden": (256, 1024), "repeats": (1, 3)}
    for name, (quick, full) in defaults.items():  # `is None`: --warmup 0 is a choice
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("steps", "repeats", "knob_hidden", "batch_size", "image_size", "nproc"):
        if (value := getattr(args, name)) is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, not {args.warmup}")
    if (
        args.role == "orchestrate"
        and not args.no_template
        and args.steps + args.warmup <= WARMUP_STEPS
    ):
        p.error(f"the template times its steps after its own {WARMUP_STEPS} warm-up steps: give "
                f"--steps and --warmup over {WARMUP_STEPS} in all, or --no-template")  # fmt: skip
    return args


def make_batches(args: argparse.Namespace, count: int, rank: int = 0) -> list[Any]:
    """Pre-generated batches: loading stays out of the timed loop (but for num_workers)."""
    data = SyntheticImages(count * args.batch_size * (rank + 1), args.image_size, 10)
    out = []
    for b in range(count):
        idx = range((rank * count + b) * args.batch_size, (rank * count + b + 1) * args.batch_size)
        idx = [i % len(data) for i in idx]
        out.append(
            (torch.stack([data[i][0] for i in idx]), torch.tensor([data[i][1] for i in idx]))
        )
    return out


DEPTH = 8  # hidden layers of the bucket rows' MLP: at width 1024, 8 buckets, 2 and 1 (measured)


def new_model(args: argparse.Namespace, name: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "knob":
        return MLP(3 * args.image_size**2, 10, hidden=args.knob_hidden)
    if name == "deep":  # the bucket rows': gradients that fill several buckets (at 256 wide,
        hidden = max(args.knob_hidden, 1024)  # --quick's, 25 and 100 MB made one bucket each)
        layers = [nn.ReLU() if i % 2 else nn.Linear(hidden, hidden) for i in range(2 * DEPTH - 2)]
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * args.image_size**2, hidden), nn.ReLU(),
                             *layers, nn.Linear(hidden, 10))  # fmt: skip
    return build_model(args.model, 10, args.image_size)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# --------------------------------------------------------------------------- timing
# Lesson 07's three habits, the loop to copy: warm-up untimed, synchronise on a GPU, the
# slowest rank's time. Plain and DDP runs go through the same timed_loop: they execute
# the same code and differ only in the wrapper.


def step_times(
    step: Callable[[], object], steps: int, warmup: int, device: torch.device | None = None
) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()``, after ``warmup`` calls not timed.

    The timing loop to copy into your own script. The first steps allocate
    memory, choose kernels, build DDP's buckets (and compile, with
    ``torch.compile``): they are not the speed you keep, so they run untimed.
    On a GPU a call returns once its kernels are *queued*: synchronise before
    reading the clock, or it measures the queueing, not the work.
    """
    cuda = device is not None and device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)  # start with nothing queued
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)  # the step's kernels have run, not only been queued
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def slowest_rank(seconds: float, device: torch.device) -> float:
    """The largest ``seconds`` over every rank (a collective: every rank calls it).

    Every DDP step ends in an all_reduce that waits for the last rank to
    arrive, so a job runs at its slowest rank's pace: its throughput is
    computed from that rank's time, never from rank 0's alone.
    """
    total = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total.item()


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: nn.Module,
    device: torch.device | None,
    set_to_none: bool = True,
) -> None:
    """One optimizer step over the micro-batches; with DDP all but the last under no_sync().
    ``set_to_none=False`` zeroes the gradients in place: with ``gradient_as_bucket_view`` they
    stay views into DDP's buckets (None, they are new tensors each step, copied again)."""
    for micro, (x, y) in enumerate(micro_batches):
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == len(micro_batches) - 1
        ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) / len(micro_batches)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def timed_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | Callable[[], Any],
    steps: int,
    warmup: int,
    accumulate: int = 1,
    device: torch.device | None = None,
    set_to_none: bool = True,
) -> list[float]:
    """Train ``warmup + steps`` optimizer steps; return the durations of the last ``steps``.

    ``batches``: a list cycled through (data loading excluded) or a callable
    returning an iterator (a DataLoader: loading included). ``accumulate``
    micro-batches per optimizer step; with a DDP model all but the last run
    under ``no_sync()`` (no all_reduce), the gradient-accumulation recipe.
    """
    loss_fn = nn.CrossEntropyLoss()
    source = iter(batches()) if callable(batches) else None
    cursor = 0

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal source, cursor
        if source is not None:
            try:
                return next(source)
            except StopIteration:
                source = iter(batches())  # type: ignore[operator]
                return next(source)
        batch = batches[cursor % len(batches)]  # type: ignore[index]
        cursor += 1
        return batch

    def one_step() -> None:
        micro_batches = [next_batch() for _ in range(accumulate)]
        accumulation_step(model, optimizer, micro_batches, loss_fn, device, set_to_none)

    return step_times(one_step, steps, warmup, device)


# --------------------------------------------------------------------------- roles


def bench_device(gpus: int) -> str:
    """Where the plain baselines run: the first GPU when there is one, like a rank's."""
    return "cuda:0" if gpus > 0 else "cpu"


def role_plain(args: argparse.Namespace) -> None:
    """One process, no process group: the baseline (on ``--device``)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = new_model(args).to(device)
    batches = make_batches(args, 8)
    optimizer, warmup = sgd(model), args.warmup
    if args.gate:  # one of the concurrent processes: warm up (one-off costs differ between
        timed_loop(model, optimizer, batches, 0, warmup, device=device)  # processes), then
        wait_at_gate(Path(args.gate), args.gate_count)  # time the steps with the others
        warmup = 0
    times = timed_loop(model, optimizer, batches, args.steps, warmup, device=device)
    ended = time.time()
    result = perf.summarize_steps(times, args.batch_size)
    window = [ended - sum(times), ended]  # wall clock of the timed steps: overlap is checked
    write_json(args.result, {**result, "threads": torch.get_num_threads(), "window": window})


def wait_at_gate(gate: Path, count: int, timeout_s: float = 600.0) -> None:
    """A barrier of files: each concurrent process says it is ready, and all start once every
    one is. Without it, quick mode's processes (a fraction of a second of timed steps each)
    were started 0.1-0.4 s apart and never ran at the same time (measured: no overlap, 3 of 3;
    with the gate before the warm-up, 0 %, 98 % and 78 %)."""
    gate.mkdir(parents=True, exist_ok=True)
    (gate / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(gate.iterdir())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other concurrent processes never reached {gate}")
        time.sleep(0.001)


def ddp_throughput(
    args: argparse.Namespace,
    device: torch.device,
    model_name: str | None = None,
    accumulate: int = 1,
    batches: Any = None,
    count: bool = False,
    **ddp_kwargs: Any,
) -> dict[str, Any]:
    """Time one DDP configuration; every rank gets the slowest rank's figures.

    ``count``: count all_reduces with a Python communication hook. Only for
    the knobs: a Python hook replaces DDP's C++ all_reduce path and costs
    time itself, so the headline throughputs run without it.
    """
    forward_sync = ddp_kwargs.pop("broadcast_buffers", True)
    # gradients set to None after each step, unless they are the buckets' views: those last
    # only while the gradients are zeroed in place (torch's docs)
    none = not ddp_kwargs.get("gradient_as_bucket_view", False)
    ddp = wrap(new_model(args, model_name), device, **ddp_kwargs)
    ddp.broadcast_buffers = forward_sync  # set after wrapping: buffers still synced once at init
    counter = CommCounter()
    if count:
        ddp.register_comm_hook(counter, counting_allreduce_hook)  # counts bucket all_reduces
    batches = batches if batches is not None else make_batches(args, 8, dist.get_rank())
    times = timed_loop(ddp, sgd(ddp), batches, args.steps, args.warmup, accumulate, device, none)
    slowest = slowest_rank(sum(times), device)  # the job moves at the slowest rank's pace
    world = dist.get_world_size()
    samples = args.batch_size * accumulate * world * len(times)
    summary = perf.summarize_steps(times, args.batch_size * accumulate * world)
    summary["samples_per_sec"] = samples / slowest
    summary["seconds"] = slowest  # the clock the throughput divides by: the slowest rank's
    own = torch.tensor([sum(times)], dtype=torch.float64, device=device)
    every = [torch.empty_like(own) for _ in range(world)]
    dist.all_gather(every, own)  # each rank's own total (a collective: every rank calls it)
    summary["rank_seconds"] = [t.item() for t in every]
    if count:
        summary["allreduces_per_step"] = counter.calls / (args.steps + args.warmup)
    return summary


def allreduce_sweep(args: argparse.Namespace, device: torch.device) -> list[dict[str, float]]:
    """All_reduce time (median and best) per message size, as nccl-tests sweeps it."""
    sizes = perf.sweep_sizes(args.quick, device.type)
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        # many for small messages, which are noisy; 10 at least: the best of 5 calls of the
        # largest was disturbed in all 5 beside a busy job once (8.4 ms for 4 MiB, 5.0 quiet)
        iters = max(10, min(30, 2**24 // size))
        times = []
        for i in range(iters + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
        # median: the typical call; best: the call undisturbed by anything else on the
        # machine, what a latency + bandwidth model describes (the fit uses it).
        t = torch.tensor(
            [perf.percentile(times, 50), min(times)], dtype=torch.float64, device=device
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds, best = t.tolist()
        rows.append(
            {
                "bytes": size,
                "seconds": seconds,
                "best_seconds": best,
                "algbw_GBps": perf.alg_bandwidth(size, seconds) / 1e9,
                "busbw_GBps": perf.bus_bandwidth(size, seconds, world) / 1e9,
            }
        )
        del x  # a 1 GiB buffer per size adds up
    return rows


def knobs(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Each DDP knob on the same (larger) model, one configuration at a time."""
    rank = dist.get_rank()
    batches = make_batches(args, 8, rank)
    rows = []

    def run(name: str, model: str = "knob", **kw: Any) -> None:
        r = ddp_throughput(args, device, model, batches=batches, count=True, **kw)
        rows.append({"knob": name, **r})

    groups = set(args.knobs)
    run("baseline (bucket_cap_mb=25)")
    if "buckets" in groups:  # the knob MLP's few tensors made the same buckets at 1 and 25
        for cap in (1, 25, 100):
            run(f"bucket_cap_mb={cap}, {DEPTH}-layer MLP", "deep", bucket_cap_mb=cap)
    if "bucket_view" in groups:
        run("gradient_as_bucket_view", gradient_as_bucket_view=True)
    if "static_graph" in groups:
        run("static_graph", static_graph=True)
    if "find_unused" in groups:
        run("find_unused_parameters (not needed)", find_unused_parameters=True)
    if "no_sync" in groups:
        run("no_sync: 4 micro-batches per step", accumulate=4)
    if "workers" in groups:  # DataLoader workers per rank: generation is inside the timed loop
        world = dist.get_world_size()
        need = (args.steps + args.warmup + 2) * args.batch_size * world
        data = SyntheticImages(need, args.image_size, 10)
        sampler = DistributedSampler(data, shuffle=False)
        for workers in (0, 1, 2):

            def loader(w: int = workers) -> DataLoader:
                return DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=w)

            r = ddp_throughput(args, device, "knob", batches=loader, count=True)
            rows.append({"knob": f"num_workers={workers} per rank", **r})
    if "threads" in groups and device.type == "cpu":
        before, rounds = torch.get_num_threads(), {1: [], 2: []}
        # Interleaved, the median of 5 rounds: a job beside this one (a busy CI host) slows
        # whichever rounds it overlaps, and oversubscribed threads sometimes happen to take
        # turns well (a best round of 2 threads once read 1.1x slower, its median 2-4x).
        for _ in range(5):
            for threads, results in rounds.items():
                torch.set_num_threads(threads)
                results.append(ddp_throughput(args, device, "knob", batches=batches, count=True))
        torch.set_num_threads(before)
        for threads, results in rounds.items():
            middle = sorted(results, key=lambda r: r["samples_per_sec"])[len(results) // 2]
            rows.append({"knob": f"{threads} thread(s) per rank", **middle})
    return rows


FIXED_COSTS = {
    "DDP defaults": {},
    "broadcast_buffers=False": {"broadcast_buffers": False},
    "+ gradient_as_bucket_view": {"broadcast_buffers": False, "gradient_as_bucket_view": True},
    "+ one bucket (bucket_cap_mb=100)": {"broadcast_buffers": False, "bucket_cap_mb": 100},
    "+ static_graph": {"broadcast_buffers": False, "static_graph": True},
}
"""Each DDP setting that can remove part of a small model's fixed per-step cost."""


def fixed_costs(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The throughput model under each :data:`FIXED_COSTS` setting, interleaved, best of 2.

    A small model's DDP step has a fixed cost beside its compute: the buffer
    broadcast at every forward (``broadcast_buffers=True``, the default: the
    template turns it off and averages buffers before evaluating and saving),
    one all_reduce per bucket, DDP's autograd hooks. Each row removes one part.
    """
    batches = make_batches(args, 8, dist.get_rank())
    best: dict[str, dict[str, Any]] = {}
    for _ in range(1 if args.quick else 2):
        for name, kwargs in FIXED_COSTS.items():
            r = ddp_throughput(args, device, batches=batches, **dict(kwargs))
            if name not in best or r["samples_per_sec"] > best[name]["samples_per_sec"]:
                best[name] = r
    return [{"setting": name, **r} for name, r in best.items()]


def fixed_cost_pairs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """DDP's own cost per step, measured as the difference of back-to-back step pairs.

    The same model twice on every rank, one plain and one under DDP, stepped
    alternately (plain, DDP, plain, DDP, …) on the same batches: a slow patch
    of the machine hits both halves of a pair alike, so the per-pair
    difference — the collectives (buffer broadcast, gradient all_reduce) and
    DDP's hooks — survives the noise better than two separate runs do. Rank
    0's median and quartiles of the differences, in ms.
    """
    batches = make_batches(args, 8, dist.get_rank())
    plain, ddp = new_model(args).to(device), wrap(new_model(args), device)
    loops = [(plain, sgd(plain)), (ddp, sgd(ddp))]
    pairs = 20 if args.quick else 60
    times: list[list[float]] = [[], []]
    for i in range(args.warmup + pairs):
        for k, (model, optimizer) in enumerate(loops):
            dist.barrier()  # both ranks start each half together: no wait carried over
            t = timed_loop(model, optimizer, [batches[i % len(batches)]], 1, 0, device=device)
            if i >= args.warmup:
                times[k] += t
    diffs = [1000 * (d - p) for p, d in zip(*times, strict=True)]
    return {
        "pairs": pairs,
        "plain_ms_p50": 1000 * perf.percentile(times[0], 50),
        "ddp_ms_p50": 1000 * perf.percentile(times[1], 50),
        "diff_ms_p25": perf.percentile(diffs, 25),
        "diff_ms_p50": perf.percentile(diffs, 50),
        "diff_ms_p75": perf.percentile(diffs, 75),
    }


def template_loader(args: argparse.Namespace) -> Any:
    """The template's input pipeline (SyntheticImages, DistributedSampler, no workers)."""
    need = (args.steps + args.warmup + 2) * args.batch_size * dist.get_world_size()
    data = SyntheticImages(need, args.image_size, 10)
    # one epoch timed: no set_epoch needed (ddp-tutorial lint would ask for it)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # ddp-lint: ignore[DDP103]
    return lambda: DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def role_ddp(args: argparse.Namespace) -> None:
    """Under torchrun: the bare DDP loop, then (with --extras) the sweep and the knobs."""
    with process_group() as info:
        torch.set_num_threads(args.threads)
        result: dict[str, Any] = {
            **ddp_throughput(args, info.device),
            "backend": info.backend,
            "device": str(info.device),
            "world_size": info.world_size,
            "threads_per_rank": torch.get_num_threads(),
        }
        if args.extras:
            if not args.no_template:  # the same loop fed by a DataLoader: the template's baseline
                loader = template_loader(args)
                # with the template's DDP setting (train.py syncs buffers before evaluating)
                result["with_loader"] = ddp_throughput(
                    args, info.device, batches=loader, broadcast_buffers=False
                )
            result["allreduce"] = allreduce_sweep(args, info.device)
            result["fixed_costs"] = fixed_costs(args, info.device)
            result["fixed_cost_pairs"] = fixed_cost_pairs(args, info.device)
            if not args.no_knobs:
                result["knobs"] = knobs(args, info.device)
        if info.is_main:
            write_json(args.result, result)


# --------------------------------------------------------------------------- orchestration


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model, "--image-size", str(args.image_size),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--knob-hidden", str(args.knob_hidden),
        "--knobs", ",".join(args.knobs),
    ] + (["--quick"] if args.quick else []) + (["--no-knobs"] if args.no_knobs else []) + (
        ["--no-template"] if args.no_template else [])  # fmt: skip


def run_plain(args: argparse.Namespace, threads: int, tmp: Path, gpus: int) -> dict[str, Any]:
    out = tmp / f"plain{threads}.json"
    cmd = [sys.executable, str(HERE), "--role", "plain", "--threads", str(threads),
           "--device", bench_device(gpus)]  # fmt: skip
    subprocess.run(cmd + _common(args) + ["--result", str(out)], check=True, timeout=1800)
    return json.loads(out.read_text())


def run_plain_concurrent(
    args: argparse.Namespace, n: int, tmp: Path, gpus: int = 0
) -> dict[str, Any]:
    """N independent 1-thread plain processes at once: the machine's own scaling ceiling.

    No communication at all, so whatever they lose against N times one
    process alone is the hardware's (shared caches, memory bandwidth, SMT,
    neighbours on a VM), not DDP's.
    """
    from ddp_tutorial.harness.multinode import node_gpus_here

    outs = [tmp / f"concurrent{i}.json" for i in range(n)]
    gate = tmp / f"gate-{time.monotonic_ns()}"  # a fresh one for every run
    cmd = [sys.executable, str(HERE), "--role", "plain", "--threads", "1", *_common(args),
           "--device", bench_device(gpus), "--gate", str(gate), "--gate-count", str(n)]  # fmt: skip
    # On GPUs each process sees one GPU of its own, as a rank would: n "nodes" of one.
    envs = node_gpus_here(n, 1)[0] if gpus else [{} for _ in outs]
    procs = [
        subprocess.Popen([*cmd, "--result", str(o)], env={**os.environ, **e})
        for o, e in zip(outs, envs, strict=True)
    ]
    deadline = time.monotonic() + 1800
    while any(p.poll() is None for p in procs):  # all of them: one that failed leaves the
        if any(p.poll() for p in procs) or time.monotonic() > deadline:  # others at the gate
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    if any(p.wait() for p in procs):
        raise RuntimeError("a concurrent plain process failed")
    each = [json.loads(o.read_text()) for o in outs]  # kept: the ceiling can be recomputed
    total = sum(r["samples_per_sec"] for r in each)
    starts, ends = [r["window"][0] for r in each], [r["window"][1] for r in each]
    together = max(0.0, min(ends) - max(starts))  # all N timed at once, of the longest window
    overlap = together / max(e - s for s, e in zip(starts, ends, strict=True))
    return {"processes": n, "samples_per_sec": total, "per_process": each, "overlap": overlap}


def run_ddp(args: argparse.Namespace, nproc: int, tmp: Path, extras: bool) -> dict[str, Any]:
    from ddp_tutorial.harness.launch import torchrun

    out = tmp / f"ddp{nproc}.json"
    extra = ["--extras"] if extras else []
    run_dir = tmp / f"ddp{nproc}"
    torchrun(HERE, "--role", "ddp", "--threads", "1", *_common(args), *extra, "--result", out,
             nproc=nproc, run_dir=run_dir, out_flag=None, echo=False, timeout=1800)  # fmt: skip
    return json.loads(out.read_text())


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the highest throughput, with every run's throughput attached."""
    best = max(runs, key=lambda r: r["samples_per_sec"])
    return {**best, "repeats": [r["samples_per_sec"] for r in runs]}


def run_template(args: argparse.Namespace, nproc: int, tmp: Path) -> dict[str, Any]:
    """scripts/train.py with its monitor, bar and metrics, on the same model and batch, with
    the bare loop's optimizer (SGD, no clipping): what differs is the template's own work."""
    from ddp_tutorial.harness.launch import torchrun

    steps = args.steps + args.warmup
    samples = steps * args.batch_size * nproc
    rates = []
    for attempt in range(2):  # best of two launches: one launch's noise is several percent here
        run_dir = tmp / f"template{attempt}"
        torchrun(HERE.parent / "train.py", "--model", args.model, "--image-size", args.image_size,
                 "--batch-size", args.batch_size, "--num-samples", samples, "--num-val", 64,
                 "--optimizer", "sgd", "--clip-grad", 0, "--weight-decay", 0,
                 "--epochs", 1, nproc=nproc, run_dir=run_dir, monitor=True, echo=False,
                 timeout=1800)  # fmt: skip
        rates.append(json.loads((run_dir / "metrics.json").read_text())["samples_per_sec"])
    return {"samples_per_sec": max(rates), "launches": rates}


def device_plan(n: int) -> int:
    """The GPUs the comparison runs on: ``n`` (nccl, one per rank), or 0 and then every run
    on the CPU, like for like, with the GPUs hidden from each launch (MIG, fewer GPUs than
    ranks, a torch that cannot use them, gloo asked for): else a one-rank launch, which
    chooses its backend for itself, would put ``ddp_world1`` alone on a GPU."""
    from ddp_tutorial.distributed import choose_backend
    from ddp_tutorial.harness.gpu_plan import launch_gpu_count, mig_fallback

    # the plain runs' cuda:0 the ranks' cuda:0, NVML's order (the launches set it likewise)
    os.environ.setdefault(settings.DEVICE_ORDER_ENV, "PCI_BUS_ID")
    hide, why = mig_fallback()
    if not hide:
        backend, why = choose_backend(settings.backend(), n, gpus=launch_gpu_count())
        if backend == "nccl":
            return n
        if launch_gpu_count():
            hide = {settings.VISIBLE_DEVICES_ENV: "", settings.BACKEND_ENV: "gloo"}
            why += ": every run on the CPU, like for like"
    if hide:
        print(f"benchmark: {why}", flush=True)
        os.environ.update(hide)  # this process and every launch it starts
    return 0


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    from ddp_tutorial.harness.launch import default_nproc

    n = args.nproc or default_nproc()
    gpus = device_plan(n)
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmpdir:
        tmp = Path(tmpdir)
        print(f"benchmark: model {args.model}, batch {args.batch_size}/rank, "
              f"{args.steps} timed steps after {args.warmup} warm-up", flush=True)  # fmt: skip
        # Each configuration `repeats` times, interleaved so that a slow patch of the
        # machine hits all of them alike; the best run of each is reported (one run's
        # noise on a small shared VM is tens of percent).
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("p1", "pall", "w1", "wn", "c")}
        for repeat in range(args.repeats):
            runs["p1"].append(run_plain(args, 1, tmp, gpus))
            # one GPU is "all cores" of a GPU process: the same run, not measured twice
            all_cores = runs["p1"][-1] if gpus else run_plain(args, usable_cores(), tmp, gpus)
            runs["pall"].append(all_cores)
            world1 = None if n == 1 else run_ddp(args, 1, tmp, extras=False)
            runs["wn"].append(run_ddp(args, n, tmp, extras=repeat == 0))
            # one rank (one GPU): ddp_world1 is that run, under the same key of the result
            runs["w1"].append(world1 or runs["wn"][-1])
            runs["c"].append(run_plain_concurrent(args, n, tmp, gpus))
        plain_1, plain_all, world1, ceiling = (best_run(runs[k]) for k in ("p1", "pall", "w1", "c"))
        # The best run's timings over the first run, which alone measured the extras
        # (sweep, knobs, loader): later runs' results have no such keys.
        world_n = {**runs["wn"][0], **best_run(runs["wn"])}
        template = None if args.no_template else run_template(args, n, tmp)
    result: dict[str, Any] = {
        "plain_1thread": plain_1,
        "plain_all_cores": plain_all,
        "ddp_world1": {k: v for k, v in world1.items() if k not in {"allreduce", "knobs"}},
        f"ddp_world{n}": {
            k: v
            for k, v in world_n.items()
            if k not in {"allreduce", "knobs", "with_loader", "fixed_costs", "fixed_cost_pairs"}
        },
        "world_size": n,
        "model_params": sum(p.numel() for p in new_model(args).parameters()),
        "plain_concurrent": ceiling,
        # What N communication-free processes achieve: about the most an N-rank job reaches (quiet).
        "hardware_ceiling": ceiling["samples_per_sec"] / (n * plain_1["samples_per_sec"]),
        **perf.derive(
            plain_1["samples_per_sec"],
            plain_all["samples_per_sec"],
            world1["samples_per_sec"],
            world_n["samples_per_sec"],
            n,
        ),
        "allreduce": world_n["allreduce"],
        "knobs": world_n.get("knobs", []),
        "fixed_cost_pairs": world_n.get("fixed_cost_pairs"),
        "fixed_costs": [
            {
                **r,
                # the definitions of the headline figures: N ranks / (N x ddp_world1), the ceiling
                "scaling_efficiency": r["samples_per_sec"] / (n * world1["samples_per_sec"]),
                "of_ceiling": r["samples_per_sec"] / ceiling["samples_per_sec"],
            }
            for r in world_n.get("fixed_costs", [])
        ],  # fmt: skip
        "machine": {
            "cores": usable_cores(),
            "threads_per_rank": world_n["threads_per_rank"],
            "torch": torch.__version__,
            "backend": world_n["backend"],
            "device": world_n["device"],
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "config": {
            k: getattr(args, k)
            for k in (
                "model",
                "image_size",
                "batch_size",
                "steps",
                "warmup",
                "knob_hidden",
                "quick",
            )
        },  # fmt: skip
    }
    result.update(perf.fit_ring_sweep(result["allreduce"], n))  # None, and why, on one process
    if template is not None:
        bare = world_n["with_loader"]["samples_per_sec"]
        result["template"] = {
            **template,
            "bare_loop_samples_per_sec": bare,
            "overhead": bare / template["samples_per_sec"] - 1,
        }
    return result


def report(result: dict[str, Any]) -> str:
    n = result["world_size"]
    rows = []
    for key in ("plain_1thread", "plain_all_cores", "ddp_world1", f"ddp_world{n}"):
        r = result[key]
        rows.append({"config": key, "samples/s": r["samples_per_sec"], "p50 ms": r["step_ms_p50"],
                     "p90 ms": r["step_ms_p90"]})  # fmt: skip
    lines = [format_table(rows), ""]
    lines.append(f"ddp_overhead         {result['ddp_overhead']:+.1%}")
    lines.append(f"scaling_efficiency   {result['scaling_efficiency']:.2f}")
    lines.append(f"speedup_vs_all_cores {result['speedup_vs_all_cores']:.2f}")
    lines.append(
        f"hardware_ceiling     {result['hardware_ceiling']:.2f}  "
        f"({result['world_size']} independent plain processes vs {result['world_size']} x one, "
        f"timed together {result['plain_concurrent']['overlap']:.0%} of the time)"
    )
    if "template" in result:
        lines.append(f"template overhead    {result['template']['overhead']:+.1%}")
    if result.get("fixed_costs"):
        lines += ["", format_table([
            {"setting": r["setting"], "samples/s": r["samples_per_sec"],
             "scaling_efficiency": r["scaling_efficiency"], "of ceiling": r["of_ceiling"]}
            for r in result["fixed_costs"]])]  # fmt: skip
    if result.get("fixed_cost_pairs"):
        f = result["fixed_cost_pairs"]
        lines.append(
            f"DDP's cost per step  {f['diff_ms_p50']:.2f} ms (quartiles {f['diff_ms_p25']:.2f} to "
            f"{f['diff_ms_p75']:.2f}; {f['pairs']} interleaved plain/DDP step pairs)"
        )
    if result.get("ring_fit_skipped"):
        lines.append(f"ring model fit       skipped: {result['ring_fit_skipped']}")
    if result.get("ring_fit"):
        fit = result["ring_fit"]
        lines.append(
            f"ring model fit       2(N-1)alpha = {fit['latency_s'] * 1e6:.0f} us at N = "
            f"{fit['world_size']} (alpha {fit['alpha_s'] * 1e6:.0f} us per step), "
            f"B {fit['bandwidth_Bps'] / 1e9:.2f} GB/s, worst error {fit['max_rel_error']:.0%}"
        )
    if result["knobs"]:
        lines += ["", format_table([
            {"knob": k["knob"], "samples/s": k["samples_per_sec"], "p50 ms": k["step_ms_p50"],
             "all_reduces/step": k["allreduces_per_step"]} for k in result["knobs"]])]  # fmt: skip
    m = result["machine"]
    lines += ["", f"machine: {m['cores']} cores, {m['threads_per_rank']} thread(s)/rank, "
              f"torch {m['torch']}, {m['backend']} on {m['device']}"]  # fmt: skip
    return "\n".join(lines)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "plain":
        return role_plain(args)
    if args.role == "ddp":
        return role_ddp(args)
    result = orchestrate(args)
    print(report(result))
    if args.out:
        write_json(args.out, result)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
