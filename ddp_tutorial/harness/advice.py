"""What to run on this machine: the doctor's command-line advice, from its GPUs and cores.

Pure functions of an inventory (``devices.GpuInfo``), a core count and the
environment, so that a 2 x T4 Kaggle notebook, a V100 box or an 8 x H100 node
can be tested here without one. The doctor (``ddp-tutorial doctor``) prints
the result as its "plan" line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_tutorial.numerics import amp_for_capability

HOSTED = {  # an environment variable each hosted notebook service sets in its kernels
    "KAGGLE_KERNEL_RUN_TYPE": "Kaggle",
    "COLAB_RELEASE_TAG": "Colab",
    "COLAB_GPU": "Colab",
}


def hosted_notebook(env: Mapping[str, str]) -> str | None:
    """ "Kaggle" or "Colab" when this runs inside one of their notebooks, else ``None``."""
    return next((name for var, name in HOSTED.items() if env.get(var)), None)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.14.1+cu130" -> (2, 14), "2" -> (2, 0)."""
    found = re.match(r"(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a version: {version!r}")
    return int(found.group(1)), int(found.group(2) or 0)


def course_torch_floor() -> tuple[int, int] | None:
    """pyproject.toml's lower bound of torch, read from the installed package (None: not
    installed, or no lower bound). "torch>=2.14", "torch<3,>=2.14; marker" alike."""
    import importlib.metadata

    try:
        needs = importlib.metadata.requires("ddp-tutorial") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = next((m for r in needs if (m := re.match(r"torch\b[^;]*?>=\s*([\d.]+)", r))), None)
    return release(found.group(1)) if found else None


def compiled_arch_list() -> list[str]:
    """The GPU architectures this torch was compiled for, without initialising CUDA here.

    ``torch.cuda.get_arch_list()`` asks ``is_available()`` first before torch 2.14, which
    initialises CUDA in this process: a kernel that does so cannot fork ranks afterwards."""
    import torch

    if not torch.backends.cuda.is_built():
        return []
    flags = torch._C._cuda_getArchFlags()  # what get_arch_list() reads, since torch 1.x
    return flags.split() if flags else []


def has_kernels_for(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``) runs here.

    ``sm_XY`` is machine code for capability X.Y, which also runs on X.Z for
    Z >= Y (same major); ``compute_XY`` is PTX, which the driver compiles for
    any capability >= X.Y. A wheel for sm_75 … sm_120 has nothing for a V100
    (7.0): every kernel then fails with "no kernel image is available".
    """
    major, minor = capability
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
        if not m:
            continue
        kind, a_major, a_minor = m.group(1), int(m.group(2)), int(m.group(3))
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def workers_per_rank(cores: int, ranks: int) -> int:
    """DataLoader workers per rank that leave each rank a core: (cores - ranks) // ranks."""
    return max(0, (cores - ranks) // max(ranks, 1))


def plan_lines(
    gpus: Sequence[Any], cores: int, p2p: bool | None, hosted: str | None
) -> tuple[str, list[str]]:
    """``(summary, command lines)`` that fit this machine's GPUs and cores.

    ``gpus``: the visible ``GpuInfo``s; ``p2p``: whether every pair of them
    can reach each other peer to peer (``None``: not known, or one GPU).
    """
    if not gpus:
        nproc, workers = 2, workers_per_rank(cores, 2)
        summary = f"no GPU: {nproc} processes on the CPU with gloo, {cores} core(s)"
        command = f"torchrun --standalone --nproc-per-node {nproc} scripts/train.py"
        return summary, [command + (f" --num-workers {workers}" if workers else "")]
    nproc = len(gpus)
    caps = [g.capability for g in gpus if g.capability]
    amp = amp_for_capability(min(caps)) if caps else "fp16"
    workers = workers_per_rank(cores, nproc)
    names = sorted({g.name for g in gpus})
    parts = [f"{nproc} x {' / '.join(names)}"]
    if caps:
        parts.append(f"compute capability {'.'.join(map(str, min(caps)))}: --amp {amp}")
    parts.append(f"{cores} CPU core(s), {cores / nproc:g} per GPU: --num-workers {workers}")
    if p2p is not None and nproc > 1:
        parts.append(
            "peer-to-peer between the GPUs"
            if p2p
            else "no peer-to-peer between the GPUs: NCCL copies through host memory"
        )
    if hosted:
        parts.insert(0, f"a {hosted} notebook")
    command = f"torchrun --standalone --nproc-per-node {nproc} scripts/train.py --amp {amp}"
    command += f" --num-workers {workers}" if workers else ""
    lines = [command]
    if hosted:
        lines.append(f"(from a notebook cell: !{command})")
    return "; ".join(parts), lines
