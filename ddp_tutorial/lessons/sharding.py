"""Lesson 12: what sharding saves in memory and what it costs in communication, counted.

Shared by ``scripts/demos/sharding.py`` (the ranks), the notebook and the tests.
Most of it is pure arithmetic over shapes and sizes — the memory formula of the
ZeRO paper, how ``fully_shard`` and ``ZeroRedundancyOptimizer`` split tensors,
the ring model's bytes per collective — so that the lesson's claims are
computed in one place and tested on fixed inputs. Two pieces touch a real run:
:func:`state_bytes` measures what a rank holds, and :func:`comm_log` notes the
collectives of a step. The two pictures are drawn here too (matplotlib is
imported inside them: ranks import this module).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

# Bytes per parameter of each kind of state, with Adam. "mixed": bf16/fp16 weights and
# gradients for compute, and an fp32 master copy + exp_avg + exp_avg_sq in the optimizer
# (the ZeRO paper's 2 + 2 + 12 = 16 bytes). "fp32": everything in fp32, as in this lesson.
BYTES_PER_PARAM = {
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8},
    "mixed": {"weights": 2, "gradients": 2, "optimizer": 12},
}
KINDS = ("weights", "gradients", "optimizer")
STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP (ZeRO-3)")
STEP_BYTES = 4  # Adam's ``step`` counter: one fp32 scalar per parameter tensor


def adam_bytes(numels: Sequence[int]) -> dict[str, int]:
    """Exact bytes of an fp32 model trained with Adam, from its tensors' element counts.

    Weights 4 B and gradients 4 B per parameter; Adam keeps ``exp_avg`` and
    ``exp_avg_sq`` (4 B each) and a ``step`` scalar per tensor. This is what
    one DDP rank holds (every rank holds all of it), and, applied to the
    tensors a rank owns, what one ZeRO-1 rank's optimizer holds.
    """
    psi = sum(numels)
    return {"weights": 4 * psi, "gradients": 4 * psi,
            "optimizer": 8 * psi + STEP_BYTES * len(numels)}  # fmt: skip


def per_rank_bytes(strategy: str, psi: float, world_size: int, precision: str = "mixed") -> float:
    """Bytes of model state per rank (activations excluded), the ZeRO paper's formulas.

    DDP keeps everything; ZeRO-1 shards the optimizer state, ZeRO-2 the
    gradients too, full sharding (ZeRO-3, FSDP) the weights too: each
    sharded kind costs 1/N of its full size per rank.
    """
    b = BYTES_PER_PARAM[precision]
    sharded = {"DDP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("optimizer", "gradients"),
               "FSDP (ZeRO-3)": KINDS}[strategy]  # fmt: skip
    return psi * sum(b[k] / (world_size if k in sharded else 1) for k in KINDS)


def largest_model(gpu_bytes: float, world_size: int, precision: str = "mixed") -> dict[str, float]:
    """Parameters whose model state just fits in ``gpu_bytes`` per rank, per strategy.

    An upper bound: activations, temporary buffers (a gathered layer, a
    bucket), the CUDA context and fragmentation all come on top.
    """
    return {s: gpu_bytes / per_rank_bytes(s, 1, world_size, precision) for s in STRATEGIES}


def largest_model_table(
    gpus_gb: Iterable[float] = (24, 40, 80), world_size: int = 8, precision: str = "mixed"
) -> list[dict[str, Any]]:
    """One row per GPU size: the largest model (billions of parameters) per strategy."""
    rows = []
    for gb in gpus_gb:
        fits = largest_model(gb * 1e9, world_size, precision)
        rows.append({"GPU": f"{gb:g} GB", **{s: round(p / 1e9, 2) for s, p in fits.items()}})
    return rows


# -- how the tensors are split ---------------------------------------------------------


def shard_rows(rows: int, rank: int, world_size: int) -> int:
    """Rows of a dim-0 ``Shard(0)`` that ``rank`` holds (``torch.chunk``'s split).

    Every rank but the last ones gets ``ceil(rows / N)``; the remainder goes
    to the next, and ranks past the end get none.
    """
    size = math.ceil(rows / world_size)
    return max(0, min(size, rows - rank * size))


def fsdp_local_numel(shapes: Sequence[Sequence[int]], rank: int, world_size: int) -> int:
    """Elements of the given parameters that ``fully_shard`` leaves on ``rank``."""
    return sum(
        shard_rows(s[0], rank, world_size) * math.prod(s[1:]) if s else int(rank == 0)
        for s in shapes
    )


def padded_numel(shape: Sequence[int], world_size: int) -> int:
    """A parameter's size in FSDP's all-gather: dim 0 padded to a multiple of N."""
    if not shape:
        return world_size
    return math.ceil(shape[0] / world_size) * world_size * math.prod(shape[1:])


def zero_partition(numels: Sequence[int], world_size: int) -> list[list[int]]:
    """Which parameter tensors (by index) each rank's ``ZeroRedundancyOptimizer`` owns.

    Its sorted-greedy rule: largest tensor first, each to the rank that owns
    the fewest elements so far (the lowest rank on a tie). Whole tensors only:
    a model with one huge tensor cannot be split evenly.
    """
    owned: list[list[int]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append(i)
        sizes[rank] += numels[i]
    return [sorted(o) for o in owned]


# -- measured on a rank ------------------------------------------------------------------


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of ``tensor``: a DTensor's local shard, else all of it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state this rank holds, from the tensors.

    ``optimizer.state`` holds only what this rank's optimizer created: all of
    it under DDP, its own tensors under ZeRO-1 (pass the local optimizer,
    ``zero.optim``), local shards under FSDP.
    """
    params = list(model.parameters())
    return {
        "weights": sum(local_nbytes(p) for p in params),
        "gradients": sum(local_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_nbytes(t)
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ),  # fmt: skip
    }


COLLECTIVE_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
}  # fmt: skip


def process_gpu_bytes(uuid: str, pid: int) -> int | None:
    """What NVML says process ``pid`` holds on the GPU ``uuid`` ("GPU-..."), or None.

    The allocator's counters (``max_memory_allocated``, ``memory_reserved``) see only
    what torch's caching allocator handed out; the process also holds its CUDA context
    (hundreds of MB), cuBLAS's workspaces and NCCL's buffers. NVML, like ``nvidia-smi``,
    sees all of it: what must fit. None where NVML cannot tell (no driver, or a container
    whose process ids NVML does not share: it lists the host's).
    """
    from ddp_tutorial.devices import _nvml  # the package's one NVML session (None: no driver)

    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            used = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    if p.pid == pid]  # fmt: skip
        except nvml.NVMLError:
            return None
    return int(used[0]) if used and used[0] else None


def cuda_uuid(device: torch.device) -> str:
    """NVML's name of a CUDA device ("GPU-<uuid>"): the same GPU whatever CUDA_VISIBLE_DEVICES."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def comm_log() -> Any:
    """A fresh :class:`CommLog` context: ``with comm_log() as log:`` ... ``log.calls``."""
    return _comm_log_class()()


@functools.cache
def _comm_log_class() -> type:
    """``CommLog``, defined on first use.

    Importing ``CommDebugMode`` pulls in ``torch._dynamo`` and ``torch._inductor``
    (seconds of CPU per process): the ranks that only load a checkpoint, and
    the notebook kernel, never pay for it.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    class CommLog(CommDebugMode):
        """``CommDebugMode`` that also notes each collective's kind and payload.

        ``CommDebugMode`` (``torch.distributed.tensor.debug``) sees every c10d
        collective of the block — DDP's all_reduce from C++ included — and
        counts them (``get_comm_counts()``). This subclass also keeps, per
        call, the kind and the bytes of its largest tensor: the full-size
        buffer (the all_reduce'd gradients, the gathered output, the
        reduce-scatter's input).
        """

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []
            self._quiet = warnings.catch_warnings()

        def __enter__(self) -> Any:
            # The mode's module tracker hands FSDP2 a view of each output, and FSDP2 warns
            # about views (in-place ops on them would skip a hook): noise here, not a bug.
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            return super().__enter__()

        def __exit__(self, *exc: Any) -> None:
            super().__exit__(*exc)
            self._quiet.__exit__(*exc)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            namespace, _, name = str(func._overloadpacket).rpartition(".")
            if namespace.endswith("c10d") and name in COLLECTIVE_KINDS:
                tensors = _tensors(list(args) + list((kwargs or {}).values()))
                size = max((t.numel() * t.element_size() for t in tensors), default=0)
                self.calls.append((COLLECTIVE_KINDS[name], size))
            return super().__torch_dispatch__(func, types, args, kwargs or {})

    return CommLog


def count_calls(calls: Iterable[Sequence[Any]]) -> dict[str, int]:
    """``{kind: number of calls}`` from ``(kind, bytes)`` pairs."""
    return dict(Counter(kind for kind, *_ in calls))


def ring_bytes(kind: str, payload: float, world_size: int, root: bool = False) -> float:
    """Bytes that reach one rank for one collective of ``payload`` bytes, ring algorithms.

    all_reduce 2(N−1)/N (lesson 07) = reduce-scatter (N−1)/N + all-gather
    (N−1)/N of the full buffer; a broadcast brings the whole buffer to each
    rank but its root.
    """
    share = (world_size - 1) / world_size
    if kind == "all_reduce":
        return 2 * share * payload
    if kind in ("all_gather", "reduce_scatter"):
        return share * payload
    if kind == "broadcast":
        return 0.0 if root else float(payload)
    raise ValueError(f"unknown collective kind {kind!r}")


def fsdp_units(model: nn.Module) -> list[list[list[int]]]:
    """Parameter shapes of each ``fully_shard`` unit when every Linear is a unit of its own.

    That is how ``scripts/demos/sharding.py`` shards the lesson's MLP; the
    root unit is left with no parameters of its own.
    """
    return [[list(p.shape) for p in layer.parameters()]
            for layer in model.modules() if isinstance(layer, nn.Linear)]  # fmt: skip


def fsdp_calls(
    units: Sequence[Sequence[Sequence[int]]], reshard_after_forward: bool
) -> dict[str, int]:
    """FSDP2's collectives in one training step, one unit per entry of ``units``.

    Each unit is all-gathered before its forward, again before its backward
    if it was resharded after forward, and its gradients are reduce-scattered
    after its backward. A unit without parameters sends nothing.
    """
    n = sum(1 for unit in units if unit)
    return {"all_gather": n * (2 if reshard_after_forward else 1), "reduce_scatter": n}


def step_traffic(calls: Iterable[Sequence[Any]], world_size: int, owned: int = 0) -> float:
    """Ring-model bytes that reach this rank in one step, from ``(kind, bytes)`` calls.

    ``owned``: the bytes of the broadcasts this rank is the root of (its
    ZeRO-1 partition): it sends those and receives the rest.
    """
    calls = list(calls)
    total = sum(ring_bytes(kind, size, world_size) for kind, size in calls if kind != "broadcast")
    return total + sum(size for kind, size in calls if kind == "broadcast") - owned


METHODS = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp2": "FSDP2",
           "fsdp2_no_reshard": "FSDP2, no reshard"}  # fmt: skip


def predicted_payload(
    method: str, units: Sequence[Sequence[Sequence[int]]], world_size: int, itemsize: int = 4
) -> dict[str, int]:
    """Bytes handed to each kind of collective in one step, from the parameter shapes.

    ``units``: the parameter shapes of each ``fully_shard`` unit (for DDP and
    ZeRO-1 only the shapes count). DDP all_reduces every gradient once;
    ZeRO-1 adds one broadcast per parameter tensor (from its owner); FSDP2
    gathers each unit's padded parameters once or twice and reduce-scatters
    its padded gradients once.
    """
    shapes = [s for unit in units for s in unit]
    full = itemsize * sum(math.prod(s) for s in shapes)
    if method in ("ddp", "zero1"):
        return {"all_reduce": full, **({"broadcast": full} if method == "zero1" else {})}
    padded = itemsize * sum(padded_numel(s, world_size) for s in shapes)
    gathers = 2 if method == "fsdp2" else 1
    return {"all_gather": gathers * padded, "reduce_scatter": padded}


def payload_by_kind(calls: Iterable[Sequence[Any]]) -> dict[str, int]:
    """``{kind: total bytes}`` from ``(kind, bytes)`` pairs."""
    totals: Counter[str] = Counter()
    for kind, size in calls:
        totals[kind] += size
    return dict(totals)


# -- pictures ------------------------------------------------------------------------------


def memory_bars(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Stacked bars, one per (method, rank): weights, gradients, optimizer state, in KB."""
    from ddp_tutorial.harness.plots import new_figure

    fig = new_figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    labels = [f"{r['method'].replace(', ', chr(10))}\nrank {r['rank']}" for r in rows]
    bottom = [0.0] * len(rows)
    for kind, color in zip(KINDS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        heights = [r[kind] / 1e3 for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=kind, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("KB held by the rank")
    ax.set_title("Model state per rank after training (measured from the tensors)")
    ax.legend(loc="upper right")
    ax.tick_params(axis="x", labelsize=8)
    return fig


def traffic_bars(traffic: Mapping[str, Mapping[str, float]], counts: Mapping[str, Any]) -> Any:
    """Stacked bars per method: ring-model bytes per step reaching one rank, by collective.

    ``traffic[method][kind]``: bytes; ``counts[method][kind]``: calls, written on top.
    """
    from ddp_tutorial.harness.plots import new_figure

    kinds = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
    fig = new_figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    labels = list(traffic)
    bottom = [0.0] * len(labels)
    for kind in kinds:
        heights = [traffic[m].get(kind, 0.0) / 1e3 for m in labels]
        if any(heights):
            ax.bar(labels, heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, method in enumerate(labels):
        calls = ", ".join(f"{n} {k}" for k, n in counts[method].items())
        ax.annotate(calls, (x, bottom[x]), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("KB per step reaching rank 0")
    ax.set_title("Communication per training step (ring model, payloads measured)")
    ax.set_ylim(0, 1.25 * max(bottom))
    ax.legend(loc="upper left", fontsize=8)
    return fig
