"""What ``make gpu-smoke`` measures in its own processes: one probe per step, one JSON each.

Each probe runs as ``python -m ddp_tutorial.harness.gpu_probes NAME OUT`` (a fresh process:
the smoke itself never initialises CUDA, so a probe that crashes the driver loses only its
row) and writes ``OUT/NAME.json``. Probes that train launch the course's real scripts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def _nvml_facts() -> dict[str, Any]:
    """Driver, GPUs, MIG mode and compute mode, from NVML (no CUDA context)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no bindings or no driver: the inventory says so
        return {"driver": None, "gpus": [], "nvml_error": f"{type(exc).__name__}: {exc}"}
    facts: dict[str, Any] = {"driver": None, "gpus": []}
    try:
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            facts["gpus"].append(_nvml_gpu(pynvml, i))
    except pynvml.NVMLError as exc:  # what was read so far stays
        facts["nvml_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return facts


def _nvml_gpu(pynvml: Any, i: int) -> dict[str, Any]:
    """One GPU's row; each fact NVML refuses (a GPU outside this container's cgroup:
    "Insufficient Permissions"; a MIG parent's memory without privilege) says why, in
    place, and the other facts and GPUs are still read."""
    gpu: dict[str, Any] = {"index": i}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
    except pynvml.NVMLError as exc:
        return {**gpu, "error": f"n/a ({exc})"}
    for key, call in (("name", pynvml.nvmlDeviceGetName), ("mig", pynvml.nvmlDeviceGetMigMode),
                      ("compute_mode", pynvml.nvmlDeviceGetComputeMode),
                      ("memory_mib", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20)
                      ):  # fmt: skip
        try:
            gpu[key] = call(h)
        except pynvml.NVMLError as exc:  # not supported, or not allowed: say so
            gpu[key] = f"n/a ({exc})"
    return gpu


def inventory(out: Path) -> dict[str, Any]:
    """Versions, and what the GPUs are: the first row of any GPU report. NVML's facts are
    written first: a CUDA call that fails or hangs (the step's limit) keeps them."""
    facts: dict[str, Any] = {"python": sys.version.split()[0], **_nvml_facts()}
    _write(out, "inventory", {"ok": False, "partial": "NVML only", **facts})
    import torch

    facts.update(torch=torch.__version__, cuda_build=torch.version.cuda, nccl=None)
    try:
        if torch.cuda.is_available():
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            facts["capability"] = torch.cuda.get_device_capability(0)
    except Exception as exc:  # CUDA refuses (error 802, a driver too old): say so, keep the rest
        facts["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def memory(out: Path) -> dict[str, Any]:
    """Lesson 12's question on a GPU: the allocator's peak against what the driver sees.

    One DDP step of a 64 M-parameter MLP on one GPU (nccl, a world of one).
    ``max_memory_allocated`` counts tensors only; the process's memory in NVML adds the
    CUDA context, the caching allocator's slack and NCCL's buffers.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_tutorial.lessons.sharding import cuda_uuid, process_gpu_bytes

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)  # fmt: skip
    try:
        model = DDP(nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).to(device))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(64, 4096, device=device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        seen = process_gpu_bytes(cuda_uuid(device), os.getpid())  # None: NVML hides it
        allocated = torch.cuda.max_memory_allocated()
        return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "max_allocated_mib": allocated / 2**20,
                "reserved_mib": torch.cuda.memory_reserved() / 2**20,
                "nvml_process_mib": seen / 2**20 if seen else None,
                "nvml_over_allocator": seen / allocated if seen else None}  # fmt: skip
    finally:
        dist.destroy_process_group()


def utilization(out: Path) -> dict[str, Any]:
    """Lesson 06's picture on one GPU: the template trains while NVML is sampled."""
    from ddp_tutorial.harness.gpu_plan import launch_gpu_count
    from ddp_tutorial.harness.launch import torchrun
    from ddp_tutorial.harness.monitor import summarize

    # resnet18 keeps a GPU busy (torchvision's: a torch-only box runs the CNN); on a CPU
    # (gpu-smoke --cpu) the small CNN fits the limit
    vision = importlib.util.find_spec("torchvision") is not None
    model = "resnet18" if launch_gpu_count() and vision else "cnn"
    args = ["--model", model, "--batch-size", "64", "--max-steps", "400", "--no-progress"]
    # echoed (the bitwise runs too): a step cut off by its limit still leaves its log
    run = torchrun(REPO / "scripts/train.py", *args, nproc=1, monitor=True, timeout=45,
                   run_dir=out / "utilization-run")  # fmt: skip
    rows = run.utilization or []
    # the training's own span (the ranks' train_start/end, as lesson 06 reads it): start-up and
    # shutdown are most of a launch this short, and nobody computes in them
    timed = [r for r in run.records if r.get("train_start") and r.get("train_end")]
    span = (
        (min(r["train_start"] for r in timed), max(r["train_end"] for r in timed))
        if timed
        else None
    )
    per_gpu = summarize([{**r, "t": r.get("wall", r["t"])} for r in rows], window=span)
    return {"model": model, "seconds": run.seconds, "per_gpu": per_gpu, "samples": len(rows),
            "window_s": span[1] - span[0] if span else None}  # fmt: skip


def bitwise(out: Path) -> dict[str, Any]:
    """Two ``--deterministic`` template runs from the same seed: the same final.pt, bit for bit."""
    from ddp_tutorial.harness.launch import torchrun  # raises, naming the rank, if a run fails

    digests = []
    for name in ("a", "b"):
        ckpt = out / f"bitwise-{name}"
        shutil.rmtree(ckpt, ignore_errors=True)  # a rerun's old final.pt would be resumed
        # out_flag=None: no --out, so the template runs the path a copy of it runs
        torchrun(REPO / "scripts/train.py", "--deterministic", "--max-steps", "20",
                 "--no-progress", "--checkpoint-dir", ckpt, nproc=1, timeout=27,
                 out_flag=None, run_dir=out / f"bitwise-{name}-run")  # fmt: skip
        digests.append(hashlib.sha256((ckpt / "final.pt").read_bytes()).hexdigest())
    if digests[0] != digests[1]:
        raise RuntimeError(f"two deterministic runs differ: {digests}")
    return {"sha256": digests[0]}


PROBES = {"inventory": inventory, "memory": memory, "utilization": utilization,
          "bitwise": bitwise}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    name, out = (argv or sys.argv[1:])[:2]
    began = time.monotonic()
    try:
        data = {"ok": True, **PROBES[name](Path(out))}
    except Exception as exc:  # the row says what failed; the smoke goes on to the next step
        data = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    data["seconds"] = round(time.monotonic() - began, 1)
    _write(Path(out), name, data)
    print(json.dumps(data, indent=1, default=str))
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
