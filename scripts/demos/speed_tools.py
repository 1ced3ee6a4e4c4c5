"""The speed tools under DDP, each case checked on every rank and recorded (lesson 11).

    torchrun --standalone --nproc-per-node 2 scripts/demos/speed_tools.py --out runs/speed

One launch runs every case (each launch costs seconds of start-up): ``amp``
(bf16 autocast, fp16 + GradScaler with ``no_sync`` accumulation, an inf
gradient injected on one rank), ``compile`` (``torch.compile`` of the DDP
model against eager, its state_dict keys, a saved copy), ``hooks`` (fp16/bf16
compression and PowerSGD, bytes counted on the wire) and ``overlap`` (a
profiler trace of one step, bucket sizes, ``gradient_as_bucket_view``,
``static_graph``). ``--only NAME ...`` runs a subset. Run with
``TORCH_LOGS=ddp_graphs`` to see how compile splits the graph at DDP's buckets.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run
# time (``bucket: dist.GradBucket`` must be the class, not a string).
import argparse
import copy
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

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
from ddp_tutorial.lessons.speed import profile_rows, wire_log
from ddp_tutorial.models import MLP

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
    add("--only", nargs="*", choices=CASES, default=list(CASES))
    add("--backend", default=None, help="auto (default), gloo or nccl")
    add("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def batch(step: int, size: int, args: argparse.Namespace, info: DistInfo) -> list[torch.Tensor]:
    """This rank's shard of the step's global batch of ``size``, on this rank's device."""
    x, y = global_batch(step, size, args.seed)
    return [shard(t, info.rank, info.world_size).to(info.device) for t in (x, y)]


# -- 1. mixed precision ------------------------------------------------------------
def inf_gradient(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook's replacement gradient: the same, with one element set to +inf."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def amp_step(
    ddp: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: str,
    accum: int,
    inject: bool,
) -> dict:
    """One optimizer step of ``accum`` micro-batches: autocast forward, ``no_sync`` on all
    but the last (one all_reduce per step), the scaler deciding whether to step."""
    opt.zero_grad(set_to_none=True)
    dtype, total = DTYPES[precision], 0.0
    micro = list(zip(x.chunk(accum), y.chunk(accum), strict=True))
    for i, (mx, my) in enumerate(micro):
        hook = ddp.module.net[1].weight.register_hook(inf_gradient) if inject and i == 0 else None
        sync = nullcontext() if i == accum - 1 else ddp.no_sync()  # local until the last
        with sync:
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(ddp(mx), my) / accum  # autocast: forward only
            scaler.scale(loss).backward()  # the last micro-batch all_reduces the sum
        total += loss.item()
        if hook is not None:
            hook.remove()
    before, scale = flat_params(ddp), scaler.get_scale()
    finite = bool(torch.isfinite(flat_grads(ddp)).all())
    scaler.step(opt)  # unscales; skips opt.step() if any gradient is inf/nan
    scaler.update()  # a skip halves the scale
    return {
        "loss": total,
        "grads_finite": finite,
        "scale_before": scale,
        "scale_after": scaler.get_scale(),
        "stepped": not torch.equal(before, flat_params(ddp)),
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
        rows.append(amp_step(ddp, x, y, opt, scaler, precision, args.grad_accum, inject))
    return rows


def case_amp(args: argparse.Namespace, info: DistInfo) -> dict:
    """Loss curves in fp32, bf16 and fp16; then an inf gradient on one rank in fp16."""
    curves = {p: [r["loss"] for r in train_amp(args, info, p, args.steps)] for p in DTYPES}
    injected = train_amp(args, info, "fp16", 3, inject_step=1)
    return {"curves": curves, "inject_step": 1, "injected": injected,
            "grad_accum": args.grad_accum}  # fmt: skip


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
    out["params"] = flat_params(ddp)
    if info.is_main and args.out:  # what a naive save of the compiled model writes
        atomic_save(model.state_dict(), Path(args.out) / "compiled_state.pt")
    return out


def _sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


# -- 3. communication hooks --------------------------------------------------------
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
def overlap_model(seed: int) -> nn.Module:
    """Six 256x256 layers (257 KB each): several buckets at ``bucket_cap_mb=0.3``."""
    return deep_mlp(seed, width=256, depth=6)


def profiled_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, opt) -> list[dict]:
    """One training step under ``torch.profiler``: backward ops and collectives, in µs."""
    activities = [ProfilerActivity.CPU]
    if x.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _sgd(ddp, x, y, opt)
    return profile_rows(prof.events())


def bucket_storages(state: set[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all_reduce, noting the storage of each bucket it is handed."""
    state.add(bucket.buffer().untyped_storage().data_ptr())
    return default_hooks.allreduce_hook(None, bucket)


def case_overlap(args: argparse.Namespace, info: DistInfo) -> dict:
    """A profiled step with small and with one big bucket; bucket views; static graph."""
    x, y = batch(0, 8 * args.batch_size, args, info)  # a heavier step: backward worth seeing
    knobs = {
        "small buckets (0.3 MB)": {"bucket_cap_mb": 0.3},
        "one bucket (25 MB)": {"bucket_cap_mb": 25},
        "gradient_as_bucket_view": {"bucket_cap_mb": 0.3, "gradient_as_bucket_view": True},
        "static_graph": {"bucket_cap_mb": 0.3, "static_graph": True},
    }
    out: dict = {"knobs": {}}
    for name, options in knobs.items():
        ddp = wrap(overlap_model(args.seed), info.device, **options)
        storages: set[int] = set()
        ddp.register_comm_hook(storages, bucket_storages)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        for _ in range(2):  # the first step builds the real buckets
            _sgd(ddp, x, y, opt)
        rows = profiled_step(ddp, x, y, opt)
        times = time_steps(lambda d=ddp, o=opt: _sgd(d, x, y, o), args.timing_steps)
        storages.clear()  # only the buckets of the step whose .grad we look at
        _sgd(ddp, x, y, opt)
        views = [p.grad.untyped_storage().data_ptr() in storages for p in ddp.parameters()]
        out["knobs"][name] = {"events": rows, "step_ms": 1e3 * statistics.median(times),
                              "grads_in_buckets": sum(views), "params": len(views),
                              "weights": flat_params(ddp)}  # fmt: skip
    return out


@record
def main() -> None:
    args = parse_args()
    cases = {"amp": case_amp, "compile": case_compile, "hooks": case_hooks,
             "overlap": case_overlap}  # fmt: skip
    run_sections(cases, args, args.out)


if __name__ == "__main__":
    main()
