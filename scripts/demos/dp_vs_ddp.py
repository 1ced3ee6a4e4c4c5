"""DataParallel (seed 002) against DistributedDataParallel, measured. GPU only.

    python scripts/demos/dp_vs_ddp.py --mode dp --out runs/dp                 # 1 process, N threads
    torchrun --standalone --nproc-per-node N scripts/demos/dp_vs_ddp.py --mode ddp --out runs/ddp

Same model (resnet18), same synthetic images, same GLOBAL batch. DataParallel
is one process: each step it scatters the batch, *replicates the model* to
every GPU, runs one Python thread per GPU (all fighting over one GIL) and
gathers the outputs on GPU 0, where the loss and the optimizer run. DDP is
one process per GPU: the model is copied once, each process runs its own
shard and only gradients travel (all_reduce, overlapped with backward). Note
the batch size: DataParallel's ``batch_size`` is global (seed 002's
``batch_size * len(device_ids)``); in DDP it is per process.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.distributed import process_group
from ddp_tutorial.models import resnet18
from ddp_tutorial.records import write_rank_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("dp", "ddp"), required=True)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def run_steps(
    model: nn.Module, batch: int, device: torch.device, args: argparse.Namespace
) -> float:
    """Seconds per step, after warm-up, on synthetic 32x32 images."""
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / args.steps


def one_dp_step(model: nn.DataParallel, rows_per_gpu: int = 2) -> dict[str, object]:
    """What one DataParallel forward does, seen from inside: scatter, replicate, gather.

    A forward hook on the wrapped module runs in every replica: it records the
    device each one ran on, the rows of the batch it got, and whether its
    weight is the original module's tensor (on cuda:0) or a fresh copy. The
    probe batch has ``rows_per_gpu`` rows per GPU: a fixed batch smaller than
    the GPU count would leave GPUs without a replica (scatter makes at most
    one chunk per row), and two rows keep BatchNorm trainable on every GPU.
    """
    batch = rows_per_gpu * len(model.device_ids)
    seen: list[dict[str, object]] = []
    original = model.module.fc.weight

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        seen.append({"device": str(inputs[0].device), "rows": inputs[0].shape[0],
                     "copy": module.fc.weight.data_ptr() != original.data_ptr()})  # fmt: skip

    handle = model.module.register_forward_hook(hook)
    try:
        out = model(torch.randn(batch, 3, 32, 32, device="cuda:0"))
    finally:
        handle.remove()
    replicas = sorted(seen, key=lambda r: int(str(r["device"]).split(":")[1]))  # cuda:2 < cuda:10
    return {"replicas": replicas, "probe_rows": batch, "output_device": str(out.device)}


@record
def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dp_vs_ddp.py needs CUDA GPUs (DataParallel on a CPU is a pass-through)")
    if args.mode == "dp":
        n = torch.cuda.device_count()
        model = nn.DataParallel(resnet18(10).cuda(0), device_ids=list(range(n)))
        step_s = run_steps(model, args.global_batch, torch.device("cuda", 0), args)
        # Each GPU's peak of allocated memory over the steps: GPU 0 also holds the whole
        # batch, the gathered outputs, the .grad of the original parameters and the
        # gradients every replica sends back to it.
        peaks = [torch.cuda.max_memory_allocated(i) / 2**20 for i in range(n)]
        record_ = {"mode": "dp", "gpus": n, "processes": 1, "step_s": step_s,
                   "peak_mib": peaks, **one_dp_step(model)}  # fmt: skip
        write_rank_record(args.out, {**record_, "samples_per_s": args.global_batch / step_s}, 0)
        return
    with process_group(backend="nccl") as info:
        model = resnet18(10).to(info.device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[info.device.index])
        per_rank = args.global_batch // info.world_size  # DDP: batch size is PER PROCESS
        step_s = run_steps(ddp, per_rank, info.device, args)
        write_rank_record(
            args.out,
            {
                "mode": "ddp",
                "gpus": info.world_size,
                "processes": info.world_size,
                "pid": os.getpid(),
                "step_s": step_s,
                "samples_per_s": args.global_batch / step_s,
            },
        )


if __name__ == "__main__":
    main()
