"""The speed tools under DDP, each case checked on every rank and recorded (lesson 11).

    torchrun --standalone --nproc-per-node 2 scripts/demos/speed_tools.py --out runs/speed

One launch runs every case (each launch costs seconds of start-up): ``amp``
(autocast in bf16 where the device computes in it, fp16 + GradScaler, with
``no_sync`` accumulation; an inf gradient injected on one rank), ``compile``
(``torch.compile`` of the DDP model against eager, its state_dict keys, a
saved copy, what a bare ``nn.Sequential`` and ``bucket_cap_mb < 1`` do),
``hooks`` (fp16/bf16 compression and PowerSGD, bytes counted on the wire) and
``overlap`` (a profiler trace of one step, bucket sizes,
``gradient_as_bucket_view``, ``static_graph``; on GPUs the trace adds each
kernel as it ran on its stream). ``--only NAME ...`` runs a subset. Run with
``TORCH_LOGS=ddp_graphs`` to see how compile splits the graph at DDP's buckets.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run
# time (``bucket: dist.GradBucket`` must be the class, not a string).
import argparse
import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.elastic.multiprocessing.errors import record
from torch.profiler import ProfilerActivity, profile

from ddp_tutorial.checkpoint import atomic_save
from ddp_tutorial.distributed import DistInfo, wrap
from ddp_tutorial.lessons.anatomy import (
    IN_FEATURES,
    NUM_CLASSES,
    deep_mlp,
    flat_grads,
    flat_params,
    global_batch,
    run_sections,
    shard,
    time_steps,
    tiny_model,
)
from ddp_tutorial.lessons.speed import kernel_rows, profile_rows
from ddp_tutorial.models import MLP
from ddp_tutorial.numerics import amp_for_capability
from ddp_tutorial.recorder import state_digest

CASES = ("amp", "compile", "hooks", "overlap")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=30, help="optimizer steps of the loss-curve comparisons")
    add("--batch-size", type=int, default=64, help="GLOBAL batch (all ranks)")
    add("--grad-accum", type=int, default=2, help="micro-batches per step in the amp case")
    add("--lr", type=float, default=0.5)
    add("--seed", type=int, default=0)
    add("--init-scale", type=float, default=1024.0, help="GradScaler's first loss scale")
    add("--inject-rank", type=int, default=1, help="the rank whose gradient becomes inf")
    add("--compile-backend", default=None, help="default: aot_eager on CPU, inductor on GPU")
    add("--compile-steps", type=int, default=6)
    add("--powersgd-steps", type=int, default=20)
    add("--timing-steps", type=int, default=10)
    add("--overlap-width", type=int, default=None, help="default: 256 on CPU, 2048 on GPU")
    add("--only", nargs="*", choices=CASES, default=list(CASES))
    add("--backend", default=None, help="auto (default), gloo or nccl")
    add("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def batch(step: int, size: int, args: argparse.Namespace, info: DistInfo) -> list[torch.Tensor]:
    """This rank's shard of the step's global batch of ``size``, on this rank's device."""
    x, y = global_batch(step, size, args.seed)
    return [shard(t, info.rank, info.world_size).to(info.device) for t in (x, y)]


# -- 1. mixed precision ------------------------------------------------------------
class AmpChoice(NamedTuple):
    """The 16-bit type a device should train in, and whether it needs a ``GradScaler``."""

    precision: str  # "bf16" or "fp16"
    dtype: torch.dtype
    scaler: bool


def amp_choice(device_type: str, capability: tuple[int, int] | None = None) -> AmpChoice:
    """bfloat16 where the hardware computes in it, else float16 with a ``GradScaler``.

    A pure function of what the rank saw (``torch.cuda.get_device_capability``
    on a GPU), so it is tested without one. From compute capability 8.0 (A100,
    H100, RTX 30xx and later) bf16 runs natively and, with float32's exponent
    range, needs no loss scaling. Below it (V100 = 7.0, T4 = 7.5) autocast
    still accepts bf16 but emulates it, slower than float32: fp16 and a
    scaler are the choice there. On a CPU autocast's own default is bf16
    (``torch.get_autocast_dtype("cpu")``); this course's CPU runs are about
    correctness, not speed.
    """
    if device_type == "cuda" and capability is None:
        raise ValueError("a CUDA device needs its compute capability, e.g. (8, 0)")
    name = amp_for_capability(tuple(capability) if device_type == "cuda" else None)
    if name == "fp16":  # the rule itself is numerics.amp_for_capability: one for the course
        return AmpChoice("fp16", torch.float16, True)
    return AmpChoice("bf16", torch.bfloat16, False)


def amp_step(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    dtype: torch.dtype | None,
) -> float:
    """One optimizer step over several micro-batches: the lines lesson 11 teaches.

    ``dtype``: torch.bfloat16, torch.float16 or None (float32). ``scaler`` is
    a ``torch.amp.GradScaler``, enabled for float16 only. Returns the loss.
    """
    accum, total = len(micro_batches), 0.0
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        last = i == accum - 1
        with nullcontext() if last else model.no_sync():  # all_reduce on the last one only
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y) / accum  # forward and loss only
            scaler.scale(loss).backward()  # fp16: loss x scale, so small gradients stay > 0
        total += loss.item()
    scaler.step(optimizer)  # unscales; skips optimizer.step() if a gradient is inf or nan
    scaler.update()  # after a skip: scale / 2
    return total


def inf_gradient(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook's replacement gradient: the same, with one element set to +inf."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def recorded_amp_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                      precision: str, accum: int, inject: bool) -> dict:  # fmt: skip
    """:func:`amp_step`, and what it did: was a gradient inf, did the weights move, the scale.

    ``inject``: the first micro-batch's gradient of one weight gets an inf on
    this rank (inside ``no_sync``: nothing is sent yet).
    """
    calls = []

    def first_call_inf(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return inf_gradient(grad) if len(calls) == 1 else grad

    hook = ddp.module.net[1].weight.register_hook(first_call_inf) if inject else None
    before, scale = flat_params(ddp), scaler.get_scale()
    micro = list(zip(x.chunk(accum), y.chunk(accum), strict=True))
    loss = amp_step(ddp, micro, opt, scaler, DTYPES[precision])
    if hook is not None:
        hook.remove()
    return {
        "loss": loss,
        "grads_finite": bool(torch.isfinite(flat_grads(ddp)).all()),  # after the all_reduce
        "scale_before": scale,
        "scale_after": scaler.get_scale(),
        "stepped": not torch.equal(before, flat_params(ddp)),
        "injected_here": bool(calls),  # this rank's hook put the inf in (before the all_reduce)
    }


def train_amp(args: argparse.Namespace, info: DistInfo, precision: str, steps: int,
              inject_step: int | None = None) -> list[dict]:  # fmt: skip
    """``steps`` steps of the same model on the same shards in one precision."""
    ddp = wrap(tiny_model(args.seed), info.device)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(info.device.type, init_scale=args.init_scale,
                                  enabled=precision == "fp16")  # fmt: skip
    rows = []
    for step in range(steps):
        inject = step == inject_step and info.rank == args.inject_rank
        x, y = batch(step, args.batch_size, args, info)
        rows.append(recorded_amp_step(ddp, x, y, opt, scaler, precision, args.grad_accum, inject))
    return rows


def case_amp(args: argparse.Namespace, info: DistInfo) -> dict:
    """Loss curves in fp32 and the 16-bit types this device should use; then an inf gradient
    on one rank in fp16 (every GPU runs fp16; bf16 only from compute capability 8.0)."""
    capability = (
        list(torch.cuda.get_device_capability(info.device)) if info.device.type == "cuda" else None
    )
    choice = amp_choice(info.device.type, tuple(capability) if capability else None)
    precisions = list(dict.fromkeys(["fp32", choice.precision, "fp16"]))
    curves = {p: [r["loss"] for r in train_amp(args, info, p, args.steps)] for p in precisions}
    injected = train_amp(args, info, "fp16", 3, inject_step=1)
    return {"capability": capability, "choice": choice.precision, "scaler": choice.scaler,
            "curves": curves, "inject_step": 1, "inject_rank": args.inject_rank,
            "injected": injected, "grad_accum": args.grad_accum}  # fmt: skip


HOOKS = {
    "allreduce": default_hooks.allreduce_hook,  # DDP's own reduction, through Python
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


# -- 2. torch.compile --------------------------------------------------------------
def compile_model(seed: int) -> nn.Module:
    """Our own module class (a bare ``nn.Sequential`` would not be compiled: see the lesson),
    with a 512x512 layer: over DDPOptimizer's 1 MiB first bucket, so there are two."""
    torch.manual_seed(seed)
    return MLP(IN_FEATURES, NUM_CLASSES, hidden=512)


def case_compile(args: argparse.Namespace, info: DistInfo) -> dict:
    """The same training eager and compiled; the compiled module's state_dict keys."""
    backend = args.compile_backend or ("inductor" if info.device.type == "cuda" else "aot_eager")
    base = compile_model(args.seed)
    out: dict = {"backend": backend}
    for name in ("eager", "compiled"):
        ddp = wrap(copy.deepcopy(base), info.device, bucket_cap_mb=1)  # >= 1 MiB: see lesson
        model = torch.compile(ddp, backend=backend) if name == "compiled" else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        if name == "eager":  # DDP's own all_reduce, through Python: its calls can be counted
            ddp.register_comm_hook(None, HOOKS["allreduce"])
        losses, times = [], []
        for step in range(args.compile_steps):
            x, y = batch(step, args.batch_size, args, info)
            with wire_log() as log:
                t0 = time.perf_counter()
                losses.append(_sgd(model, x, y, opt))
                times.append(time.perf_counter() - t0)
        out[name] = {
            "losses": losses,
            "first_step_s": times[0],  # the compiled one: tracing and compiling
            "step_ms": 1e3 * statistics.median(times[1:]),
            "allreduces_last_step": len(log.calls),
        }
    keys = list(model.state_dict())
    out["state_dict_keys"] = keys[:2]
    out["module_keys"] = list(model.module.state_dict())[:2]  # through the compiled wrapper
    out["module_is_the_model"] = model.module is ddp.module
    out["weights_digest"] = state_digest(ddp.module)  # its SHA-256, not 300 k numbers in JSON
    if info.is_main and args.out:  # what a naive save of the compiled model writes
        atomic_save(model.state_dict(), Path(args.out) / "compiled_state.pt")
    out["sequential_graphs"] = graphs_compiled(
        nn.Sequential(nn.Linear(IN_FEATURES, 512), nn.ReLU(), nn.Linear(512, NUM_CLASSES)),
        info,
        args,
    )
    out["small_bucket_error"] = small_bucket_error(backend, info, args)
    return out


def graphs_compiled(module: nn.Module, info: DistInfo, args: argparse.Namespace) -> list[int]:
    """Compile ``DDP(module)`` with a backend that only counts: ops in each graph handed to it.

    Dynamo is reset first, so nothing compiled before is reused: a fresh process's answer.
    """
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(sum(node.op == "call_function" for node in gm.graph.nodes))
        return gm.forward

    model = torch.compile(wrap(module, info.device, bucket_cap_mb=1), backend=counting_backend)
    x, y = batch(0, args.batch_size, args, info)
    F.cross_entropy(model(x), y).backward()
    return graphs


def small_bucket_error(backend: str, info: DistInfo, args: argparse.Namespace) -> str | None:
    """The first line of what a compiled DDP model with ``bucket_cap_mb < 1`` raises (or None).

    Dynamo is reset first: code compiled for the same class before would be reused
    (its guards pass) and DDPOptimizer, which refuses the buckets, would not run again.
    """
    torch._dynamo.reset()
    model = torch.compile(wrap(compile_model(args.seed), info.device, bucket_cap_mb=0.5),
                          backend=backend)  # fmt: skip
    x, y = batch(0, args.batch_size, args, info)
    try:
        F.cross_entropy(model(x), y).backward()
    except AssertionError as exc:  # DDPOptimizer's own check, at compile time
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        torch._dynamo.reset()  # forget the failed frame
    return None


def _sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


# -- 3. communication hooks --------------------------------------------------------
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


def case_hooks(args: argparse.Namespace, info: DistInfo) -> dict:
    """One step's gradients and bytes per hook; then PowerSGD against plain training."""
    base = tiny_model(args.seed, hidden=64)
    x, y = batch(0, args.batch_size, args, info)
    out: dict = {"shapes": [list(p.shape) for p in base.parameters()], "one_step": {}}
    for name, hook in HOOKS.items():
        ddp = wrap(copy.deepcopy(base), info.device)
        ddp.register_comm_hook(None, hook)
        with wire_log() as log:
            F.cross_entropy(ddp(x), y).backward()
        out["one_step"][name] = {"grad": flat_grads(ddp), "bytes": log.bytes,
                                 "dtypes": sorted({d for _, d in log.calls})}  # fmt: skip
    out["powersgd"] = {
        name: train_hooked(args, info, base, name) for name in ("allreduce", "powersgd")
    }
    return out


def train_hooked(args: argparse.Namespace, info: DistInfo, base: nn.Module, name: str) -> dict:
    """``--powersgd-steps`` steps with a hook, the bytes of every step counted."""
    ddp = wrap(copy.deepcopy(base), info.device)
    if name == "powersgd":  # rank-1 factors; compressed from the third step on
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=2)  # fmt: skip
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        ddp.register_comm_hook(None, HOOKS["allreduce"])
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    losses, step_bytes, calls = [], [], []
    with wire_log() as log:
        for step in range(args.powersgd_steps):
            log.reset()
            losses.append(_sgd(ddp, *batch(step, args.batch_size, args, info), opt))
            step_bytes.append(log.bytes)
            calls.append(len(log.calls))
    return {"losses": losses, "bytes": step_bytes, "calls": calls}


# -- 4. overlap and the bucket knobs -------------------------------------------------
def overlap_model(seed: int, width: int) -> nn.Module:
    """Six width x width layers: 256 on a CPU (257 KB each), 2048 on GPUs (16 MiB each), so
    that a GPU's backward kernels last long enough for an all_reduce to run beside them."""
    return deep_mlp(seed, width=width, depth=6)


def profiled_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, opt) -> dict:
    """One training step under ``torch.profiler``: backward ops and collectives, in µs.

    ``events``: CPU-side ranges (when backward's nodes ran on their thread,
    when each all_reduce was launched and when the backend ran it). On a GPU
    those are only the host's view — an op's CPU range ends when its kernel is
    *queued* — so ``kernels`` adds the GPU's own: each kernel as it ran on
    its stream (NCCL's all_reduce kernels and backward's compute kernels).
    """
    activities = [ProfilerActivity.CPU]
    if x.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _sgd(ddp, x, y, opt)
    events = prof.events()
    return {"events": profile_rows(events),
            "kernels": kernel_rows(events) if x.device.type == "cuda" else []}  # fmt: skip


def bucket_storages(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all_reduce, noting each bucket it is handed: its storage and its size."""
    state["storages"].add(bucket.buffer().untyped_storage().data_ptr())
    state["numels"].append(bucket.buffer().numel())
    return default_hooks.allreduce_hook(None, bucket)


def case_overlap(args: argparse.Namespace, info: DistInfo) -> dict:
    """A profiled step with small and with one big bucket; bucket views; static graph."""
    width = args.overlap_width or (2048 if info.device.type == "cuda" else 256)
    x, y = batch(0, 8 * args.batch_size, args, info)  # a heavier step: backward worth seeing
    layer_mb = width * (width + 1) * 4 / 2**20
    small = round(1.2 * layer_mb, 1)  # just over one layer: two of them per bucket here
    total_mb = sum(p.numel() * 4 for p in overlap_model(args.seed, width).parameters()) / 2**20
    one = max(25.0, 2 * total_mb)  # DDP's default 25 MB, or more if the model is bigger
    knobs = {
        "small buckets": {"bucket_cap_mb": small},
        "one bucket": {"bucket_cap_mb": one},
        "gradient_as_bucket_view": {"bucket_cap_mb": small, "gradient_as_bucket_view": True},
        "static_graph": {"bucket_cap_mb": small, "static_graph": True},
    }
    out: dict = {"width": width, "knobs": {}}
    reference = None  # the first knob's weights, kept here: on a GPU (2048 wide) a record of
    # every knob's weights would be ~100 M floats of JSON per rank; the lesson needs only these
    for name, options in knobs.items():
        ddp = wrap(overlap_model(args.seed, width), info.device, **options)
        seen: dict = {"storages": set(), "numels": []}
        ddp.register_comm_hook(seen, bucket_storages)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        buckets = []  # the elements of each bucket all-reduced, step by step
        for _ in range(2):  # DDP rebuilds its buckets after a first step (static_graph: two)
            seen["numels"] = []
            _sgd(ddp, x, y, opt)
            buckets.append(seen["numels"])
        seen["numels"] = []
        profiled = profiled_step(ddp, x, y, opt)
        buckets.append(seen["numels"])
        seen["numels"] = []  # the timed steps' buckets are not kept
        times = time_steps(lambda d=ddp, o=opt: _sgd(d, x, y, o), args.timing_steps)
        seen["storages"].clear()  # only the buckets of the step whose .grad we look at
        _sgd(ddp, x, y, opt)
        views = [p.grad.untyped_storage().data_ptr() in seen["storages"] for p in ddp.parameters()]
        weights = flat_params(ddp)
        reference = weights if reference is None else reference
        out["knobs"][name] = {**profiled, "bucket_cap_mb": options["bucket_cap_mb"],
                              "bucket_numels": buckets,
                              "step_ms": 1e3 * statistics.median(times),
                              "grads_in_buckets": sum(views), "params": len(views),
                              "same_weights_as_first": torch.equal(weights, reference),
                              "max_diff_from_first": (weights - reference).abs().max().item(),
                              "largest_weight": weights.abs().max().item()}  # fmt: skip
    return out


@record
def main() -> None:
    args = parse_args()
    cases = {"amp": case_amp, "compile": case_compile, "hooks": case_hooks,
             "overlap": case_overlap}  # fmt: skip
    run_sections(cases, args, args.out)


if __name__ == "__main__":
    main()
