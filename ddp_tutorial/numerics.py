"""The settings that decide which numbers a run produces: determinism and mixed precision.

Two runs of the same flags give bitwise-equal weights on a CPU. On a GPU they
do not by default: cuDNN picks convolution algorithms by timing them
(``benchmark``) and several of its backward kernels, like cuBLAS with split
workspaces, add in a different order each run. :func:`make_deterministic`
turns all of that off, for runs whose results must be compared bit for bit
(a resume test, lesson 08); it costs speed on GPUs, so the template makes it a
flag. :func:`amp_dtype` picks the autocast dtype and refuses bfloat16 where
the GPU only emulates it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ddp_tutorial.settings import CUBLAS_WORKSPACE_ENV

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA >= 10.2)


def make_deterministic() -> dict[str, object]:
    """Deterministic kernels from here on; returns what was set.

    Call it before the first CUDA operation of the process: cuBLAS reads
    ``CUBLAS_WORKSPACE_CONFIG`` when it creates its handle. An operation that
    has no deterministic implementation then raises instead of silently
    varying (``torch.use_deterministic_algorithms``).
    """
    os.environ.setdefault(CUBLAS_WORKSPACE_ENV, CUBLAS_WORKSPACE)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    return {
        CUBLAS_WORKSPACE_ENV: os.environ[CUBLAS_WORKSPACE_ENV],
        "cudnn.deterministic": True,
        "cudnn.benchmark": False,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _native_bf16() -> bool:
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3 has no including_emulation: compute capability 8+
        return torch.cuda.get_device_capability()[0] >= 8


def amp_dtype(
    device: torch.device, amp: str | bool | None, native_bf16: Callable[[], bool] = _native_bf16
) -> torch.dtype | None:
    """The autocast dtype for ``--amp`` (``None`` without it); bfloat16 refused where emulated.

    ``amp``: ``"bf16"`` (or ``True``: a bare ``--amp``) or ``"fp16"``.
    bfloat16 needs no loss scaling (it has float32's range), which is why it is
    the default. But a V100 or a T4 has no bfloat16 arithmetic: autocast
    "works" there through emulation, slower than float32 — use ``fp16``
    there, with a ``GradScaler`` (the template makes one for ``--amp fp16``).
    ``native_bf16`` answers for this process's GPU (a fake in tests).
    """
    if not amp:
        return None
    if amp == "fp16":
        return torch.float16
    if amp not in (True, "bf16"):
        raise ValueError(f"--amp must be bf16 or fp16, got {amp!r}")
    if device.type == "cuda" and not native_bf16():
        raise ValueError(
            "--amp trains in bfloat16, which this GPU does not support natively (compute "
            "capability below 8.0, e.g. V100 or T4): it would be emulated, slower than "
            "float32. Use --amp fp16 (float16 with a GradScaler), or no --amp."
        )
    return torch.bfloat16


def amp_for_capability(capability: tuple[int, int] | None) -> str:
    """The ``--amp`` choice for a device: "bf16" where it is native, else "fp16".

    ``capability`` is the GPU's CUDA compute capability (NVML or
    ``torch.cuda.get_device_capability``), ``None`` for the CPU. bfloat16
    arithmetic exists from 8.0 (A100, H100, RTX 30xx and later); a V100 (7.0)
    or a T4 (7.5) only emulates it, slower than float32, so those get float16
    and a GradScaler. CPU autocast computes in bfloat16. One function, so the
    doctor's advice, the GPU tests and the lessons pick the same dtype.
    """
    if capability is None:
        return "bf16"
    return "bf16" if tuple(capability) >= (8, 0) else "fp16"
