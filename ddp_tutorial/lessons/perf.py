"""Measuring DDP honestly: timed loops, percentiles, derived figures, the ring model.

Host-side analysis: pure functions tested on fixed inputs (percentiles, derived
figures, the ring model and its picture), plus :func:`clock`, the synchronised
clock the lessons' demos read. The timed training loop that lesson 07 teaches
(``step_times``, ``slowest_rank``, the ``no_sync`` accumulation step) lives in
``scripts/benchmark.py``, the script that runs it, where a reader copies it from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) with linear interpolation, like numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_steps(step_times: Sequence[float], samples_per_step: int) -> dict[str, float]:
    """Throughput (samples/s) and step-time p50/p90 (ms) of timed steps.

    ``seconds``, the clock total the throughput divides by, is kept with it: a
    reader can recompute the throughput from the clock (lesson 07 does).
    """
    total = sum(step_times)
    return {
        "steps": len(step_times),
        "seconds": total,
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


def ring_time(size_bytes: float, world_size: int, alpha_s: float, bandwidth_Bps: float) -> float:
    """The ring model of one all_reduce: t ≈ 2(N−1)·α + 2(N−1)/N · S/B (seconds).

    A ring all_reduce is 2(N−1) steps *in sequence* (each forwards what the
    previous one delivered), every step one message of S/N bytes per rank:
    each pays the latency α, and together they move 2(N−1)/N · S bytes per
    rank at the bandwidth B. The bandwidth term stays below 2S/B whatever N;
    the latency term grows linearly with N.
    """
    steps = 2 * (world_size - 1)
    return steps * alpha_s + ring_factor(world_size) * size_bytes / bandwidth_Bps


def fit_ring_model(
    sizes: Sequence[float], seconds: Sequence[float], world_size: int
) -> dict[str, Any]:
    """Fit :func:`ring_time` to measured all_reduce times at one world size N.

    At one N the model is a line in S: a constant plus a slope. The fit finds
    the constant ``latency_s`` = 2(N−1)·α (the time of an all_reduce too
    small to notice its bytes: 2α at N = 2) and the bandwidth B; ``alpha_s``
    is that constant divided by the 2(N−1) steps, the latency of one step.
    A single N cannot show how the constant grows with N: that comes from the
    ring's 2(N−1) sequential steps.

    The fit minimises *relative* error (weighted least squares, weights 1/t²):
    the sizes span five orders of magnitude, and a plain fit would let the
    64 MB points decide everything and ignore the latency-bound small ones.
    ``max_rel_error`` is the largest |model − measured| / measured: how well
    two numbers, a fixed latency and a bandwidth, explain the whole curve.
    """
    if world_size < 2:
        raise ValueError("an all_reduce over one rank sends nothing: need world_size >= 2")
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points")
    if min(seconds) <= 0:
        raise ValueError("times must be positive")
    k = ring_factor(world_size)
    # Each point: latency / t + beta * (k S / t) ≈ 1, with beta = 1 / B.
    a = [1 / t for t in seconds]
    b = [k * s / t for s, t in zip(sizes, seconds, strict=True)]
    saa, sbb = sum(x * x for x in a), sum(y * y for y in b)
    sab = sum(x * y for x, y in zip(a, b, strict=True))
    sa, sb = sum(a), sum(b)
    det = saa * sbb - sab * sab
    if det <= 0:
        raise ValueError("degenerate sizes: cannot separate latency from bandwidth")
    latency = (sa * sbb - sb * sab) / det
    beta = (saa * sb - sab * sa) / det
    if beta <= 0:
        raise ValueError("time does not grow with size: cannot fit a bandwidth")
    if latency < 0:  # a negative latency is unphysical: fit the bandwidth alone
        latency, beta = 0.0, sb / sbb
    alpha = latency / (2 * (world_size - 1))
    predicted = [ring_time(s, world_size, alpha, 1 / beta) for s in sizes]
    errors = [abs(p - t) / t for p, t in zip(predicted, seconds, strict=True)]
    return {
        "world_size": world_size,
        "latency_s": latency,
        "alpha_s": alpha,
        "bandwidth_Bps": 1 / beta,
        "max_rel_error": max(errors),
        "predicted_s": predicted,
    }


def fit_ring_sweep(sweep: Sequence[dict[str, float]], world_size: int) -> dict[str, Any]:
    """The benchmark's ``ring_fit`` from its all_reduce sweep, or why there is none.

    ``{"ring_fit": fit, "ring_fit_skipped": ""}`` on 2+ ranks; on one process
    (one GPU) ``{"ring_fit": None, "ring_fit_skipped": why}``: an all_reduce over
    one rank sends nothing, so there is no ring, no latency and no bandwidth to fit.
    """
    if world_size == 1:
        why = "no ring with one process: an all_reduce over one rank sends nothing, so there "
        return {"ring_fit": None, "ring_fit_skipped": why + "is no latency or bandwidth to fit"}
    sizes, best = [r["bytes"] for r in sweep], [r["best_seconds"] for r in sweep]
    return {"ring_fit": fit_ring_model(sizes, best, world_size), "ring_fit_skipped": ""}


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


# -- the ring all-reduce, step by step (lesson 07) ----------------------------------------

RING_PHASES = ("reduce-scatter", "all-gather")


def ring_schedule(world_size: int) -> list[list[tuple[int, int, int, str]]]:
    """Who sends which chunk to whom at each step of a ring all_reduce over ``world_size`` ranks.

    The tensor is cut into N chunks and the ranks form a ring, r → r+1 (mod N).
    **Reduce-scatter**, N−1 steps: at step s rank r sends chunk (r − s) mod N
    to its right neighbour, which *adds* it to its own copy; afterwards rank r
    holds the complete sum of chunk (r + 1) mod N. **All-gather**, N−1 more
    steps: at step s rank r sends chunk (r + 1 − s) mod N, a complete sum, to
    its right neighbour, which *overwrites* its copy. 2(N−1) steps in all, each
    rank sending one chunk per step: 2(N−1)/N of the tensor, whatever N.
    Returns, per step, ``(sender, receiver, chunk, phase)`` for every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    steps = [
        [(r, (r + 1) % n, (r - s) % n, RING_PHASES[0]) for r in range(n)] for s in range(n - 1)
    ]
    steps += [[(r, (r + 1) % n, (r + 1 - s) % n, RING_PHASES[1]) for r in range(n)]
              for s in range(n - 1)]  # fmt: skip
    return steps


@dataclass
class RingRun:
    """What :func:`simulate_ring` did: each rank's result, whose inputs each copy sums, bytes."""

    results: list[torch.Tensor]
    contributions: list[list[list[int]]]  # per state (start, then after each step): [rank][chunk]
    bytes_sent: list[int]  # per rank


def simulate_ring(tensors: Sequence[torch.Tensor]) -> RingRun:
    """Run :func:`ring_schedule` on real tensors, one per rank, as the ranks would.

    Every step's messages are taken from the state *before* the step (the
    ranks send at the same time), then added (reduce-scatter) or copied
    (all-gather) at the receiver. ``contributions`` counts, for each rank's
    copy of each chunk, how many ranks' inputs it sums: 1 everywhere at the
    start, N everywhere at the end.
    """
    n = len(tensors)
    chunks = [list(t.detach().clone().tensor_split(n)) for t in tensors]
    holds = [[{r} for _ in range(n)] for r in range(n)]  # whose inputs each copy sums
    history = [[[len(h) for h in row] for row in holds]]
    sent = [0] * n
    for step in ring_schedule(n):
        messages = [(dst, c, phase, chunks[src][c].clone(), set(holds[src][c]), src)
                    for src, dst, c, phase in step]  # fmt: skip
        for dst, c, phase, data, who, src in messages:
            if phase == RING_PHASES[0]:
                chunks[dst][c] += data
                holds[dst][c] |= who
            else:
                chunks[dst][c], holds[dst][c] = data, who
            sent[src] += data.numel() * data.element_size()
        history.append([[len(h) for h in row] for row in holds])
    return RingRun([torch.cat(c) for c in chunks], history, sent)


def draw_ring(run: RingRun, ax: Any | None = None) -> Any:
    """The state after every step of a ring all_reduce: one N×N block (rank × chunk) per step.

    Each cell's colour and number say how many ranks' inputs that rank's copy
    of that chunk sums; the outlined cells are the ones that just received a
    chunk from their left neighbour.
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    if ax is None:
        from ddp_tutorial.harness.plots import new_figure

        ax = new_figure(figsize=(11, 3)).add_subplot()
    n = len(run.results)
    states = run.contributions
    grid = np.full((n, len(states) * (n + 1) - 1), np.nan)
    for k, state in enumerate(states):
        grid[:, k * (n + 1) : k * (n + 1) + n] = np.array(state)
    ax.imshow(grid, cmap="viridis", vmin=1, vmax=n, aspect="equal")
    schedule = [None, *ring_schedule(n)]
    for k, state in enumerate(states):
        x0 = k * (n + 1)
        for rank in range(n):
            for chunk in range(n):
                colour = "white" if state[rank][chunk] < n else "black"
                ax.text(x0 + chunk, rank, state[rank][chunk], ha="center", va="center",
                        fontsize="x-small", color=colour)  # fmt: skip
        if schedule[k] is None:
            title = "start"
        else:
            for _, dst, chunk, _ in schedule[k]:
                ax.add_patch(Rectangle((x0 + chunk - 0.5, dst - 0.5), 1, 1, fill=False, lw=2,
                                       edgecolor="tab:red"))  # fmt: skip
            phase = "RS" if k <= n - 1 else "AG"
            title = f"{phase} {k if k <= n - 1 else k - n + 1}"
        ax.text(x0 + (n - 1) / 2, -0.9, title, ha="center", fontsize="small")
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xticks([k * (n + 1) + c for k in range(len(states)) for c in range(n)],
                  [str(c) for _ in states for c in range(n)], fontsize="x-small")  # fmt: skip
    steps = 2 * (n - 1)
    sent = f"{steps}/{n} S = {ring_factor(n):g} S"
    ax.set_xlabel(f"chunk, in each block (RS: reduce-scatter, AG: all-gather). Each rank sends "
                  f"one chunk of S/{n} per step: {sent} in all")  # fmt: skip
    ax.set_title(f"ring all_reduce over {n} ranks: how many ranks' inputs each copy sums", pad=26)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    return ax.figure
