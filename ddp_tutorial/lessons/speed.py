"""Lesson 11's analysis: bytes predicted, compile splits, overlap, errors, read from the records.

Pure functions over what a run of ``scripts/demos/speed_tools.py`` recorded (a log, a list
of profiler events, layer shapes, gradients), so the claims of the lesson are computed the
same way in the notebook, in the script and in the tests, and are tested on fixed inputs.
What the ranks run and the lesson teaches (the mixed-precision step, the choice of 16-bit
type, the counter of bytes on the wire) lives in the script itself, where the lesson shows it.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.autograd import DeviceType

BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
COMM_EVENTS = ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_reduce")
SIGNIFICANT_BITS = {"fp32": 24, "bf16": 8, "fp16": 11}  # stored mantissa bits + the implicit 1
FP16_SMALLEST_NORMAL = 2.0**-14  # below it fp16 has fewer significant bits (subnormals)


def mean_relative_error(
    approx: Sequence[float] | torch.Tensor,
    exact: Sequence[float] | torch.Tensor,
    floor: float = 4 * FP16_SMALLEST_NORMAL,
) -> float:
    """Mean of ``|approx - exact| / |exact|`` over the elements with ``|exact| > floor``.

    Rounding to p significant bits moves a number by at most half a unit in
    its last place, ``2**-p`` of its size, wherever its exponent is: a
    relative error, so its mean over thousands of elements measures p, and
    two formats' means differ by 2 to the difference in bits. The floor keeps
    out the tiny elements that fp16 stores as subnormals (fewer bits) and
    the zeros (no relative error at all). The default, 4x fp16's smallest
    normal number, leaves room for the division by the world size that the
    compression hooks do before they round.
    """
    a, e = torch.as_tensor(approx, dtype=torch.float64), torch.as_tensor(exact, dtype=torch.float64)
    keep = e.abs() > floor
    if not bool(keep.any()):
        raise ValueError(f"no element above the floor {floor:g}")
    return ((a - e).abs()[keep] / e.abs()[keep]).mean().item()


def source_of(path: str | Path, name: str) -> str:
    """The source text of the top-level function ``name`` in the file ``path``.

    A notebook shows the lines a rank ran straight from the launched file,
    so the text it shows cannot drift from the code that ran. Parsed, not
    imported: nothing of the script executes in the kernel.
    """
    text = Path(path).read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(lines[first - 1 : node.end_lineno])  # whole lines: comments too
    raise LookupError(f"no top-level function {name!r} in {path}")


def script_module(path: str | Path, name: str | None = None) -> ModuleType:
    """A launched script imported as a module: its functions, its ``main()`` not run.

    Lesson 07 times a step in its own kernel with the benchmark's ``step_times``: the
    function that ran on the ranks, not a copy. Only scripts whose ``main()`` is behind
    ``if __name__ == "__main__"`` (every script here) can be imported this way.
    """
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue  # with CUDA profiling a record_function also has a GPU twin: not CPU time
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


def _backward_node(op: Any) -> str | None:
    """The autograd node an op ran inside (walking up its CPU parents), or None."""
    while op is not None:
        if op.name.startswith(BACKWARD_PREFIX):
            return op.name[len(BACKWARD_PREFIX) :]
        op = getattr(op, "cpu_parent", None)
    return None


def _is_gpu_kernel(e: Any) -> bool:
    """A CUDA kernel's execution (not a memcpy/memset, nor a GPU twin of a record_function)."""
    if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CUDA:
        return False
    return getattr(e, "activity_type", None) in (None, "kernel")


def kernel_rows(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The GPU kernels of a CUDA ``torch.profiler`` run, as rows on the GPU's own clock.

    With ``ProfilerActivity.CUDA`` the profiler records every kernel as it ran
    on the GPU (``device_type == DeviceType.CUDA``, its stream in
    ``device_resource_id``) and links it to the CPU op that launched it
    (``linked_correlation_id`` = that op's ``id``). Kept: NCCL's kernels
    (``kind="comm"``, named ``nccl…``) and every kernel launched from inside
    an autograd node, classified as :func:`profile_rows` does (``backward``,
    or ``accumulate`` for ``AccumulateGrad``, where DDP copies gradients into
    its buckets). Forward and optimizer kernels are dropped. Times are µs
    from the first backward kernel's start.
    """
    events = list(events)
    ops = {e.id: e for e in events
           if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU
           and getattr(e, "linked_correlation_id", 0) == 0}  # fmt: skip
    rows = []
    for e in events:
        if not _is_gpu_kernel(e):
            continue
        if "nccl" in e.name.lower():
            kind, node = "comm", None
        else:
            node = _backward_node(ops.get(getattr(e, "linked_correlation_id", 0)))
            if node is None:
                continue
            kind = "accumulate" if "AccumulateGrad" in node else "backward"
        rows.append({"kind": kind, "name": e.name, "node": node,
                     "stream": getattr(e, "device_resource_id", None),
                     "start": e.time_range.start, "end": e.time_range.end})  # fmt: skip
    t0 = min((r["start"] for r in rows if r["kind"] == "backward"), default=0)
    for r in rows:
        r["start"], r["end"] = r["start"] - t0, r["end"] - t0
    return sorted(rows, key=lambda r: r["start"])


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_us(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """How long something of ``a`` and something of ``b`` ran at the same time (µs)."""
    ua, ub = _union(a), _union(b)
    total, j = 0.0, 0
    for start, end in ua:
        while j < len(ub) and ub[j][1] <= start:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < end:
            total += min(end, ub[k][1]) - max(start, ub[k][0])
            k += 1
    return total


def gpu_overlap_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Did NCCL run on the GPU while backward's kernels ran? From :func:`kernel_rows`.

    ``backward_end``: the end of the last backward kernel; ``first_comm``:
    the start of the first NCCL kernel; ``overlapped_us``: the time during
    which an NCCL kernel and a backward kernel were both running (on
    different streams, or it could not be); ``shared_streams``: streams that
    ran both kinds (none expected: NCCL has streams of its own).
    """
    compute = [r for r in rows if r["kind"] == "backward" and r.get("node") != "TBackward0"]
    comms = [r for r in rows if r["kind"] == "comm"]
    if not compute or not comms:
        raise ValueError(
            f"need backward and NCCL kernels, got {len(compute)} and {len(comms)}: was the "
            "step profiled with ProfilerActivity.CUDA, and may this process use CUPTI?"
        )
    return {
        "backward_end": max(r["end"] for r in compute),
        "first_comm": min(r["start"] for r in comms),
        "comm_kernels": len(comms),
        "overlapped_us": overlap_us(
            [(r["start"], r["end"]) for r in comms], [(r["start"], r["end"]) for r in compute]
        ),  # fmt: skip
        "shared_streams": sorted({r["stream"] for r in comms} & {r["stream"] for r in compute}),
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
