"""Measuring DDP honestly: timed loops, percentiles, derived figures, the ring model.

Pure functions (tested on fixed inputs) plus the timed training loop that
``scripts/benchmark.py`` runs in every configuration, so plain and DDP runs
execute literally the same code and differ only in the wrapper.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) with linear interpolation, like numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_steps(step_times: Sequence[float], samples_per_step: int) -> dict[str, float]:
    """Throughput (samples/s) and step-time p50/p90 (ms) of timed steps."""
    total = sum(step_times)
    return {
        "steps": len(step_times),
        "samples_per_sec": samples_per_step * len(step_times) / total if total else math.nan,
        "step_ms_p50": 1000 * percentile(step_times, 50),
        "step_ms_p90": 1000 * percentile(step_times, 90),
    }


def derive(
    plain_1: float, plain_all: float, ddp_world1: float, ddp_world_n: float, n: int
) -> dict[str, float]:
    """The benchmark's derived figures from four throughputs (samples/s).

    * ``ddp_overhead`` = plain(1 thread) / ddp_world1 − 1: what the wrapper
      itself costs (its hooks, bucket copies, a world-of-one all_reduce);
    * ``scaling_efficiency`` = throughput_N / (N × ddp_world1): 1.0 is
      perfectly linear at the same threads per rank;
    * ``speedup_vs_all_cores`` = ddp_worldN / plain(all cores): what DDP buys
      over simply letting one process use every core.
    """
    if min(plain_1, plain_all, ddp_world1, ddp_world_n) <= 0 or n < 1:
        raise ValueError("throughputs must be positive and n >= 1")
    return {
        "ddp_overhead": plain_1 / ddp_world1 - 1,
        "scaling_efficiency": ddp_world_n / (n * ddp_world1),
        "speedup_vs_all_cores": ddp_world_n / plain_all,
    }


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte reduced in a ring all_reduce: 2(N−1)/N."""
    return 2 * (world_size - 1) / world_size


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> float:
    """NCCL-tests' "bus bandwidth" (bytes/s): algbw x 2(N-1)/N, comparable across world sizes."""
    return ring_factor(world_size) * size_bytes / seconds


def alg_bandwidth(size_bytes: float, seconds: float) -> float:
    """NCCL-tests' "algorithm bandwidth" (bytes/s): the message size over the time."""
    return size_bytes / seconds


def sweep_sizes(quick: bool, device_type: str) -> list[int]:
    """All_reduce message sizes, x4 apart: 1 KiB up to 64 MiB on a CPU, 1 GiB on GPUs.

    GPU links reach their bandwidth only with large messages (NVLink needs
    hundreds of MiB), as nccl-tests shows; a CPU over loopback TCP is
    bandwidth-bound long before. Quick mode stops at 4 MiB (CPU) / 64 MiB (GPU).
    """
    if device_type == "cuda":
        top = 64 * 2**20 if quick else 2**30
    else:
        top = 4 * 2**20 if quick else 64 * 2**20
    sizes, size = [], 1024
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def fit_ring_model(
    sizes: Sequence[float], seconds: Sequence[float], world_size: int
) -> dict[str, float]:
    """Fit t ≈ α + 2(N−1)/N · S / B; returns α (s), B (bytes/s) and the worst relative error.

    The fit minimises *relative* error (weighted least squares, weights 1/t²):
    the sizes span five orders of magnitude, and a plain fit would let the
    64 MB points decide everything and ignore the latency-bound small ones.
    ``max_rel_error`` is the largest |model − measured| / measured: how well
    two numbers, a fixed latency and a bandwidth, explain the whole curve.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points")
    if min(seconds) <= 0:
        raise ValueError("times must be positive")
    k = ring_factor(world_size)
    # Each point: alpha / t + beta * (k S / t) ≈ 1, with beta = 1 / B.
    a = [1 / t for t in seconds]
    b = [k * s / t for s, t in zip(sizes, seconds, strict=True)]
    saa, sbb = sum(x * x for x in a), sum(y * y for y in b)
    sab = sum(x * y for x, y in zip(a, b, strict=True))
    sa, sb = sum(a), sum(b)
    det = saa * sbb - sab * sab
    if det <= 0:
        raise ValueError("degenerate sizes: cannot separate latency from bandwidth")
    alpha = (sa * sbb - sb * sab) / det
    beta = (saa * sb - sab * sa) / det
    if beta <= 0:
        raise ValueError("time does not grow with size: cannot fit a bandwidth")
    if alpha < 0:  # a negative latency is unphysical: fit the bandwidth alone
        alpha, beta = 0.0, sb / sbb
    predicted = [alpha + beta * k * s for s in sizes]
    errors = [abs(p - t) / t for p, t in zip(predicted, seconds, strict=True)]
    return {
        "alpha_s": alpha,
        "bandwidth_Bps": 1 / beta,
        "max_rel_error": max(errors),
        "predicted_s": predicted,
    }


def clock(device: torch.device | None = None) -> float:
    """``time.perf_counter()`` once the device has finished its queued work.

    On a GPU an operation returns as soon as it is queued: reading the clock
    right after it times the queueing, not the work. Synchronising first makes
    the reading mean what it says (at the cost of a pipeline stall, which is
    why the template does not time every step this way).
    """
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: nn.Module,
    device: torch.device | None,
) -> None:
    """One optimizer step over the micro-batches; with DDP all but the last under no_sync()."""
    for micro, (x, y) in enumerate(micro_batches):
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == len(micro_batches) - 1
        ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) / len(micro_batches)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | Callable[[], Any],
    steps: int,
    warmup: int,
    accumulate: int = 1,
    device: torch.device | None = None,
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
    sync = device is not None and device.type == "cuda"
    times = []

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

    # On a GPU a step returns once its work is queued: CUDA events, recorded in the
    # stream around each step and read once at the end, time the work itself without
    # stalling the pipeline every step.
    events = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        if sync and i >= warmup:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        _step(model, optimizer, [next_batch() for _ in range(accumulate)], loss_fn, device)
        if i < warmup:
            continue
        if sync:
            end.record()
            events.append((begin, end))
        else:
            times.append(time.perf_counter() - start)
    if sync:
        torch.cuda.synchronize(device)
        times = [begin.elapsed_time(end) / 1000 for begin, end in events]  # ms -> s
    return times
