"""The speed tools of lesson 11, made observable: bytes on the wire, compile splits, overlap.

Shared by ``scripts/demos/speed_tools.py`` (the ranks), the notebook and the tests.
Most of it is pure functions over what a run recorded (a log, a list of
profiler events, layer shapes), so the claims of the lesson are computed the
same way everywhere and tested on fixed inputs; :func:`wire_log` is the one
piece that touches ``torch.distributed`` at run time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
COMM_EVENTS = ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_reduce")


@dataclass
class WireLog:
    """Every ``dist.all_reduce`` made while :func:`wire_log` was active: what went on the wire."""

    calls: list[tuple[int, str]] = field(default_factory=list)  # (bytes, dtype) per call

    @property
    def bytes(self) -> int:
        return sum(b for b, _ in self.calls)

    def reset(self) -> None:
        self.calls.clear()


@contextmanager
def wire_log() -> Iterator[WireLog]:
    """Count the payload of every ``torch.distributed.all_reduce`` inside the block.

    DDP's default reduction and torch's comm hooks (fp16/bf16 compression,
    PowerSGD) all call ``dist.all_reduce`` through the module attribute, so
    wrapping that attribute sees exactly the tensors each hook hands to the
    backend — their dtype and size — without changing what is sent. A ring
    all_reduce then moves 2(N-1)/N times this payload per rank (lesson 07).
    """
    log, original = WireLog(), dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        log.calls.append((tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield log
    finally:
        dist.all_reduce = original


def powersgd_elements(
    shapes: Sequence[Sequence[int]], rank: int = 1, min_compression_rate: float = 2.0
) -> dict[str, int]:
    """Elements PowerSGD all_reduces per step for gradients of these shapes, once it has started.

    Mirrors ``powerSGD_hook``: a gradient with more than one dimension is
    viewed as an ``n x m`` matrix (``m`` = the product of the other dims) and
    replaced by the factors ``P`` (n x rank) and ``Q`` (m x rank) when
    ``n*m > min_compression_rate * (n+m)*rank``; 1-D gradients (biases) and
    matrices below the rate travel uncompressed. ``ratio`` = plain / sent.
    """
    plain = sent = compressed = 0
    for shape in shapes:
        numel = math.prod(shape)
        plain += numel
        if len(shape) > 1:
            n, m = shape[0], numel // shape[0]
            if n * m > min_compression_rate * (n + m) * rank:
                sent += (n + m) * rank
                compressed += 1
                continue
        sent += numel
    return {"plain": plain, "sent": sent, "compressed_tensors": compressed,
            "ratio": plain / sent if sent else math.nan}  # fmt: skip


_SUBMOD = re.compile(r"---(submod_\d+) graph---")


def ddp_graph_splits(log_text: str) -> list[str]:
    """The subgraphs DDPOptimizer split a compiled model into, from ``TORCH_LOGS=ddp_graphs``.

    With that setting every rank logs the original graph, the split graph and
    each ``submod_K`` graph it compiles (several times: before and after
    compiling). The distinct ``submod_K`` names, in order, are the pieces: one
    per DDP bucket, so an all_reduce can start between them. An empty list: no
    split (one bucket, or no compile).
    """
    return list(dict.fromkeys(_SUBMOD.findall(log_text)))


def profile_rows(events: Any, step_start_us: float | None = None) -> list[dict[str, Any]]:
    """Backward ops and collectives of a ``torch.profiler`` run, as plain rows (µs from start).

    ``events`` is ``prof.events()``. Kept: each autograd node backward ran
    (``kind="backward"``; ``"accumulate"`` for ``AccumulateGrad``, where DDP's
    hooks run — at the end of a step they wait for the last all_reduce, so
    they are not compute), each collective DDP launched from backward
    (``c10d::allreduce_``: the launch, on the backward thread) and its work as
    the backend ran it (``gloo:all_reduce`` / ``nccl:all_reduce``: the comm
    thread or stream). Everything else (the ops inside them) is dropped.
    """
    rows = []
    for e in events:
        if e.name.startswith(BACKWARD_PREFIX):
            name = e.name[len(BACKWARD_PREFIX) :]
            kind = "accumulate" if "AccumulateGrad" in name else "backward"
        elif e.name in COMM_EVENTS:
            kind, name = ("launch" if e.name.startswith("c10d") else "comm"), e.name
        else:
            continue
        rows.append({"kind": kind, "name": name, "start": e.time_range.start,
                     "end": e.time_range.end})  # fmt: skip
    t0 = step_start_us if step_start_us is not None else min((r["start"] for r in rows), default=0)
    for r in rows:
        r["start"], r["end"] = r["start"] - t0, r["end"] - t0
    return sorted(rows, key=lambda r: r["start"])


def overlap_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """When communication started relative to backward's compute, from :func:`profile_rows`.

    ``backward_end``: the end of the last gradient computation (the last
    ``AddmmBackward0``-like node; not ``AccumulateGrad``, nor the cheap
    ``TBackward0`` views); ``first_launch`` / ``first_comm``: the start of
    the first collective launch and of the backend's first all_reduce;
    ``overlapped_us``: compute still ahead of backward when the first one began.
    """
    compute = [r for r in rows if r["kind"] == "backward" and r["name"] != "TBackward0"]
    launches = [r for r in rows if r["kind"] == "launch"]
    comms = [r for r in rows if r["kind"] == "comm"]
    if not compute or not launches:
        raise ValueError("need backward compute events and at least one collective launch")
    end = max(r["end"] for r in compute)
    first_launch = min(r["start"] for r in launches)
    first_comm = min((r["start"] for r in comms), default=math.nan)
    return {
        "backward_end": end,
        "first_launch": first_launch,
        "first_comm": first_comm,
        "launches": len(launches),
        "overlapped_us": max(0.0, end - first_launch),
    }


def loss_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest absolute difference of two loss curves, step by step (same length)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"two curves of the same, non-zero length: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def blow_up(losses: Sequence[float], window: int) -> float:
    """Worst loss in the first ``window`` steps over the first loss (inf/nan count as inf).

    1.0 means the loss never rose above where it started; 10 means it went
    ten times higher: the optimizer overshot.
    """
    if not losses or window < 1:
        raise ValueError("need at least one loss and a window of at least one step")
    head = [x if math.isfinite(x) else math.inf for x in losses[:window]]
    return max(head) / losses[0]
