"""What this machine offers the course: the report of lesson 00 and ``ddp-tutorial env``.

It must not initialise CUDA (the notebook kernel calls it, and a CUDA context
in the kernel would sit on GPU 0 for the rest of the session), so GPUs come
from NVML and the backend plan is computed from that count.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import sys
import warnings
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ddp_tutorial import settings
from ddp_tutorial.devices import DeviceError, visible_gpus
from ddp_tutorial.distributed import choose_backend
from ddp_tutorial.harness.gpu_plan import torch_sees_no_gpu
from ddp_tutorial.harness.launch import default_nproc
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV


def kernel_started_cuda() -> bool:
    """Whether this process started CUDA: torch initialised it (``is_initialized()``), or only
    the driver was asked, which ``is_initialized()`` does not show - ``is_available()`` asks the
    CUDA runtime for the GPU count (lesson 01, lesson 03: ``CUDA_VISIBLE_DEVICES`` is read then).
    torch then marks every later fork as bad, so a forked child's ``_is_in_bad_fork()`` tells."""
    if torch.cuda.is_initialized():
        return True
    if not hasattr(os, "fork"):  # no fork (Windows): torch's own flag is all there is
        return False
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a threaded kernel
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: one question, then gone (no cleanup of the kernel's state)
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1


def environment_report() -> dict[str, Any]:
    """A dict of facts about this machine and the plan the course will follow here."""
    problems: list[str] = []
    try:
        gpus = visible_gpus(problems=problems)
        gpu_error = ""
        nproc = default_nproc()
    except DeviceError as exc:  # MIG: refused, with what to do; the CPU plan meanwhile
        gpus, gpu_error = [], str(exc)
        nproc = default_nproc({VISIBLE_DEVICES_ENV: ""})
    blind = torch_sees_no_gpu()  # GPUs NVML lists that this torch cannot open: the CPU plan
    backend, reason = choose_backend("auto", nproc, gpus=0 if blind else len(gpus))
    reason = f"{blind}: {reason}" if blind else reason
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cpu_cores": settings.usable_cores(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "dev_shm_gib": round(shm / 2**30, 2) if shm is not None else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "cuda_visible_devices": os.environ.get(VISIBLE_DEVICES_ENV),
        "gpu_error": gpu_error,
        "gpu_problems": problems,
        "gpus": [
            {
                "logical": i,
                "physical": g.index,
                "name": g.name,
                "memory_total_mib": _mib(g.memory_total_mib),
                "memory_used_mib": _mib(g.memory_used_mib),
            }
            for i, g in enumerate(gpus)
        ],
        "plan": {"nproc": nproc, "backend": backend, "reason": reason},
    }


def _mib(value: float) -> int | None:
    """Whole MiB; None where NVML gave no figure (a MIG parent without privileges: NaN)."""
    return None if math.isnan(value) else round(value)


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned ``key: value`` lines for a terminal."""
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["backends"].items())
    rows = [
        ("python", f"{report['python']} ({report['executable']})"),
        ("torch", f"{report['torch']} (CUDA build: {report['torch_cuda_build'] or 'none'})"),
        ("cpu cores", report["cpu_cores"]),
        ("memory", f"{report['memory_gib']} GiB"),
        ("/dev/shm", f"{report['dev_shm_gib']} GiB"),
        ("OMP_NUM_THREADS", report["omp_num_threads"] or "unset"),
        ("backends", backends),
        (VISIBLE_DEVICES_ENV, report["cuda_visible_devices"] or "unset"),
    ]
    if report["gpus"]:
        for g in report["gpus"]:
            rows.append(
                (
                    f"gpu cuda:{g['logical']}",
                    f"{g['name']} (physical {g['physical']}, "
                    f"{g['memory_used_mib'] if g['memory_used_mib'] is not None else '?'}/"
                    f"{g['memory_total_mib'] if g['memory_total_mib'] is not None else '?'} "
                    "MiB used)",
                )
            )
    else:
        rows.append(("gpus", report["gpu_error"] or "none visible (NVML found no GPU)"))
    rows += [("gpu problem", problem) for problem in report.get("gpu_problems", [])]
    plan = report["plan"]
    rows.append(("course plan", f"{plan['nproc']} ranks, {plan['backend']} ({plan['reason']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
