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

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
make_deterministic = kit.make_deterministic
amp_dtype = kit.amp_dtype

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA >= 10.2)


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
