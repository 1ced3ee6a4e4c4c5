"""Beyond DDP: memory per rank, ZeRO-1 and FSDP2, sharded checkpoints (lesson 12).

    torchrun --standalone --nproc-per-node 2 scripts/demos/sharding.py --out runs/sharding
    torchrun --standalone --nproc-per-node 3 scripts/demos/sharding.py --only load \\
        --ckpt runs/sharding/dcp --out runs/sharding-load3

Sections (``--only`` picks some), each run on every rank and recorded per rank:
``train`` trains the same model on the same batches with DDP, DDP + ZeRO-1
(``ZeroRedundancyOptimizer``) and FSDP2 (``fully_shard``, with and without
resharding after forward) and records the bytes each rank holds, the step-0
gradient and the trained weights, one step's collectives and the step times;
``save`` writes a sharded checkpoint with DCP from every rank, rank 0's plain
``final.pt`` from a full state_dict, and the naive ``model.state_dict()`` save
that a DDP habit suggests; ``load`` loads the DCP checkpoint onto however many
ranks this launch has; ``gpu_memory`` measures resting, peak and forward memory
per rank for DDP, FSDP2 and FSDP2 with bf16 compute on a model big enough to see
it, and the dtypes each computes with (on a CPU: the dtypes only).
Big tensors go to ``OUT/<section>_rank<r>.pt``, the rest to ``rank<r>.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ddp_tutorial.checkpoint import atomic_save
from ddp_tutorial.distributed import DistInfo, wrap
from ddp_tutorial.lessons.anatomy import deep_mlp, global_batch, run_sections, shard
from ddp_tutorial.lessons.perf import clock
from ddp_tutorial.lessons.sharding import (
    METHODS,
    comm_log,
    cuda_uuid,
    process_gpu_bytes,
    state_bytes,
)

SECTIONS = ("train", "save", "load", "gpu_memory")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--width", type=int, default=256, help="hidden width of the lesson's MLP")
    add("--depth", type=int, default=2, help="hidden width x width layers")
    add("--steps", type=int, default=5, help="Adam steps compared with one process")
    add("--batch-size", type=int, default=64, help="GLOBAL batch (all ranks)")
    add("--lr", type=float, default=1e-3)
    add("--seed", type=int, default=0)
    add("--timing-steps", type=int, default=8, help="timed steps per method, after the others")
    add("--ckpt", default=None, help="DCP checkpoint folder (default: OUT/dcp)")
    add("--gpu-width", type=int, default=4096)
    add("--gpu-depth", type=int, default=8)
    add("--only", nargs="*", choices=SECTIONS, default=["train", "save"])
    add("--backend", default=None, help="auto (default), gloo or nccl")
    add("--out", default=None, help="run directory for per-rank records")
    return parser.parse_args()


def cpu_or_gpu_mesh(info: DistInfo) -> DeviceMesh:
    """A 1-D mesh of every rank, on the device this rank really computes on.

    Pinned, not left to ``fully_shard``'s default: the default mesh is built
    for the accelerator torch finds, so on a machine that has GPUs but runs
    a gloo job on the CPU it would be a CUDA mesh over a CPU process group
    (pytorch/pytorch#132471).
    """
    return init_device_mesh(info.device.type, (info.world_size,))


def shard_model(model: nn.Module, mesh: DeviceMesh, reshard: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:  # fmt: skip
    """FSDP2: each Linear a unit of its own (gathered, freed, reduced on its own), then the root."""
    options = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def build(method: str, args: argparse.Namespace, info: DistInfo, mesh: DeviceMesh):
    """The lesson's model and its Adam, wrapped the way ``method`` says."""
    model = deep_mlp(args.seed, width=args.width, depth=args.depth)
    if method in ("ddp", "zero1"):
        ddp = wrap(model, info.device, gradient_as_bucket_view=True)  # .grad lives in the buckets
        if method == "ddp":
            return ddp, torch.optim.Adam(ddp.parameters(), lr=args.lr)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=args.lr)  # fmt: skip
        return ddp, zero
    model = shard_model(model, mesh, reshard=method == "fsdp2")
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard


def batch(step: int, args: argparse.Namespace, info: DistInfo) -> list[torch.Tensor]:
    """This rank's shard of the step's global batch, on this rank's device."""
    x, y = global_batch(step, args.batch_size, args.seed)
    return [shard(t, info.rank, info.world_size).to(info.device) for t in (x, y)]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:  # fmt: skip
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def flat_full(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All tensors, whole (a DTensor is gathered: a collective), as one CPU vector."""
    full = [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in full])


def run_method(
    method: str, args: argparse.Namespace, info: DistInfo, mesh: DeviceMesh
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train ``--steps`` steps; measure bytes, gradients, weights, one step's collectives, speed."""
    model, opt = build(method, args, info, mesh)
    params = list(model.parameters())
    x, y = batch(0, args, info)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grad0 = flat_full([p.grad for p in params])  # step 0's averaged gradient, whole
    opt.step()
    for step in range(1, args.steps):
        train_step(model, opt, *batch(step, args, info))
    weights = flat_full(params)
    local_opt = opt.optim if method == "zero1" else opt  # ZeRO-1: this rank's own Adam
    out = {"bytes": state_bytes(model, local_opt)}
    with comm_log() as log:
        train_step(model, opt, *batch(args.steps, args, info))
    out["calls"] = log.calls
    out["comm_counts"] = {str(k): v for k, v in log.get_comm_counts().items()}
    times = []
    for step in range(args.timing_steps):
        t0 = clock(info.device)
        train_step(model, opt, *batch(args.steps + 1 + step, args, info))
        times.append(clock(info.device) - t0)
    out["step_ms"] = 1e3 * statistics.median(times)
    out["samples_per_s"] = args.batch_size / statistics.median(times)
    if method == "zero1":
        mine = {id(p) for p in opt.optim.param_groups[0]["params"]}
        out["owned"] = [i for i, p in enumerate(params) if id(p) in mine]
        out["save"] = zero_state_dict(opt, info)
    if method.startswith("fsdp2"):
        out.update(dtensor_facts(params, info))
    return out, {"grad0": grad0, "weights": weights}


def zero_state_dict(opt: ZeroRedundancyOptimizer, info: DistInfo) -> dict:
    """Saving ZeRO-1's optimizer: each rank holds a part, so state_dict() needs them gathered.

    ``consolidate_state_dict(to=0)`` is a collective (every rank, never under ``if rank ==
    0``); after it the saving rank's ``state_dict()`` holds every parameter's state.
    """
    try:
        opt.state_dict()
        refused = None
    except RuntimeError as exc:  # what lesson 05's rank-0 save meets with ZeRO-1
        refused = str(exc)[:200]
    opt.consolidate_state_dict(to=0)
    states = len(opt.state_dict()["state"]) if info.rank == 0 else None
    return {"refused": refused, "states": states}


def dtensor_facts(params: list[torch.Tensor], info: DistInfo) -> dict:
    """What ``fully_shard`` made of the parameters, and a check that no element is lost."""
    count = torch.tensor([sum(p.to_local().numel() for p in params)], device=info.device)
    local = count.item()
    dist.all_reduce(count)  # the shards of all ranks together
    return {
        "types": sorted({type(p).__name__ for p in params}),
        "placements": sorted({str(p.placements) for p in params}),
        "global_shapes": [list(p.shape) for p in params],
        "local_shapes": [list(p.to_local().shape) for p in params],
        "local_numel": local,
        "summed_numel": count.item(),
        "full_numel": sum(p.numel() for p in params),
    }


def section_train(args: argparse.Namespace, info: DistInfo) -> dict:
    """Every method on the same model and batches; big tensors to ``train_rank<r>.pt``."""
    mesh = cpu_or_gpu_mesh(info)
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # a default mesh's
    out = {"mesh_device": mesh.device_type,
           "default_mesh_device": accelerator.type if accelerator else "cpu"}  # fmt: skip
    tensors = {}
    for method in METHODS:
        out[method], tensors[method] = run_method(method, args, info, mesh)
    if args.out:
        atomic_save(tensors, Path(args.out) / f"train_rank{info.rank}.pt")
    return out


def optimizer_moments(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's ``exp_avg`` of every parameter, whole, as one vector (a collective)."""
    return flat_full([opt.state[p]["exp_avg"] for p in model.parameters()])


def section_save(args: argparse.Namespace, info: DistInfo) -> dict:
    """Train FSDP2 a few steps, then save it three ways (see the module docstring)."""
    out_dir = Path(args.out)
    ckpt = Path(args.ckpt) if args.ckpt else out_dir / "dcp"
    model = shard_model(deep_mlp(args.seed, width=args.width, depth=args.depth),
                        cpu_or_gpu_mesh(info))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        train_step(model, opt, *batch(step, args, info))
    model_sd, optim_sd = get_state_dict(model, opt)  # DTensors: this rank's shards
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)  # every rank writes
    if info.is_main:  # the DDP habit: rank 0 saves model.state_dict()
        torch.save(model.state_dict(), out_dir / "naive.pt")
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )  # a collective: every rank calls it; rank 0 receives the whole model on the CPU
    if info.is_main:
        atomic_save(full, out_dir / "final.pt")
    tensors = {"weights": flat_full(list(model.parameters())),
               "exp_avg": optimizer_moments(model, opt)}  # fmt: skip
    atomic_save(tensors, out_dir / f"save_rank{info.rank}.pt")
    return {"ckpt": str(ckpt), "full_state_dict_keys": len(full),
            "full_is_plain": all(type(v) is torch.Tensor for v in full.values())}  # fmt: skip


def section_load(args: argparse.Namespace, info: DistInfo) -> dict:
    """Load the DCP checkpoint onto this launch's ranks (any number): DCP reshards."""
    model = shard_model(
        deep_mlp(args.seed + 1, width=args.width, depth=args.depth), cpu_or_gpu_mesh(info)
    )  # another init: the load must replace it
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=args.ckpt)  # each rank reads the pieces of its own shards
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    tensors = {"weights": flat_full(list(model.parameters())),
               "exp_avg": optimizer_moments(model, opt)}  # fmt: skip
    atomic_save(tensors, Path(args.out) / f"load_rank{info.rank}.pt")
    first = next(iter(model.parameters()))
    return {"local_shapes": [list(p.to_local().shape) for p in model.parameters()],
            "adam_step": float(opt.state[first]["step"])}  # fmt: skip


def compute_dtypes(model: nn.Module) -> tuple[dict[str, set[str]], list]:
    """Forward hooks on every Linear: the dtype of the weight it computes with, and of its output.

    Registered after ``fully_shard``, whose pre-forward hook runs first (it is
    prepended): inside the forward ``module.weight`` is then the gathered,
    unsharded weight, in the mixed-precision policy's ``param_dtype``.
    """
    seen: dict[str, set[str]] = {"weight": set(), "output": set()}

    def before(module: nn.Module, args: tuple) -> None:
        seen["weight"].add(str(module.weight.dtype))

    def after(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["output"].add(str(output.dtype))

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    return seen, handles


def section_gpu_memory(args: argparse.Namespace, info: DistInfo) -> dict:
    """Resting, peak and forward CUDA memory per rank: DDP, FSDP2, FSDP2 with bf16 compute.

    Each method trains 3 steps on a fresh model; the third step's forward is
    measured on its own (what it adds above the state at rest: the gathered
    weights and the saved activations, the part bf16 halves). The dtypes each
    Linear computed with are recorded too. On a CPU the same code runs, at
    the sizes given, and records the dtypes; the bytes are None (a CPU has no
    allocator statistics): that keeps this GPU path exercised without a GPU.
    """
    cuda = info.device.type == "cuda"
    mesh = cpu_or_gpu_mesh(info)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = batch(0, args, info)
    psi = sum(p.numel() for p in deep_mlp(0, args.gpu_width, args.gpu_depth).parameters())
    out: dict = {"psi": psi, "unit_numel": args.gpu_width * (args.gpu_width + 1)}  # a hidden Linear
    # Saved for backward: each Linear's input and each ReLU's output, fp32, this rank's batch.
    out["activations_bytes"] = 2 * 4 * x.shape[0] * args.gpu_width * (args.gpu_depth + 1)
    if cuda:
        warm = nn.Linear(8, 8).to(info.device)  # cuBLAS's workspaces, allocated once, before
        warm(x.float()).sum().backward()  # any measurement starts: no method pays for them
    allocated = torch.cuda.memory_allocated if cuda else None
    peak_since_reset = torch.cuda.max_memory_allocated if cuda else None
    for method in ("ddp", "fsdp2", "fsdp2_bf16"):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            start = allocated(info.device)
        model = deep_mlp(args.seed, width=args.gpu_width, depth=args.gpu_depth)  # on the CPU
        if method == "ddp":
            model = wrap(model, info.device, gradient_as_bucket_view=True)
        else:  # fully_shard moves each rank's shards to the mesh's device
            model = shard_model(model, mesh, mp_policy=bf16 if method == "fsdp2_bf16" else None)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        seen, handles = compute_dtypes(model)
        if cuda:
            torch.cuda.reset_peak_memory_stats(info.device)  # the steps' peak, not the building's
        for _ in range(2):  # Adam's state appears at the first step
            train_step(model, opt, x, y)
        opt.zero_grad(set_to_none=True)  # the third step, its forward measured on its own
        if cuda:
            torch.cuda.synchronize(info.device)
            peak = peak_since_reset(info.device)
            reserved_peak = torch.cuda.max_memory_reserved(info.device)  # reset below too
            before_forward = allocated(info.device)
            torch.cuda.reset_peak_memory_stats(info.device)
        loss = F.cross_entropy(model(x), y)
        if cuda:
            torch.cuda.synchronize(info.device)
            forward_added = peak_since_reset(info.device) - before_forward
        loss.backward()
        opt.step()
        for handle in handles:
            handle.remove()
        row = {"weight_dtypes": sorted(seen["weight"]), "output_dtypes": sorted(seen["output"]),
               "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
               "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
               "rest_bytes": None, "peak_bytes": None, "forward_added_bytes": None}  # fmt: skip
        if cuda:
            torch.cuda.synchronize(info.device)
            row["rest_bytes"] = allocated(info.device) - start  # weights, grads, Adam
            row["peak_bytes"] = max(peak, peak_since_reset(info.device)) - start
            row["forward_added_bytes"] = forward_added  # gathered weights, activations
            # What the allocator counted against what the process holds (what must fit),
            # while this method's model, optimizer and cache are still there.
            row["process"] = {
                "max_allocated_bytes": max(peak, peak_since_reset(info.device)),
                "max_reserved_bytes": max(
                    reserved_peak, torch.cuda.max_memory_reserved(info.device)
                ),
                "nvml_bytes": process_gpu_bytes(cuda_uuid(info.device), os.getpid()),
            }
        out[method] = row
        del model, opt, loss
    return out


@record
def main() -> None:
    args = parse_args()
    sections = {"train": section_train, "save": section_save, "load": section_load,
                "gpu_memory": section_gpu_memory}  # fmt: skip
    run_sections(sections, args, args.out)


if __name__ == "__main__":
    main()
