"""Where a launch's ranks will compute when the machine's GPUs cannot take them as they are.

Host side, no CUDA: NVML's inventory and the environment decide. The launcher
(:mod:`ddp_tutorial.harness.launch`), the multi-node helper and the benchmark
ask here, so that a MIG machine behaves the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddp_tutorial import settings
from ddp_tutorial.devices import MigError, visible_gpu_count


def mig_fallback(env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """``(variables, why)`` that put a launch on the CPU where MIG is on, else ``({}, "")``.

    The course refuses MIG for ranks (:class:`~ddp_tutorial.devices.MigError`); such a
    machine still runs every lesson as the refusal advises: GPUs hidden, gloo on the CPU.
    """
    merged = {**os.environ, **(env or {})}
    try:
        if settings.backend(merged) != "gloo":
            visible_gpu_count(merged)
    except MigError as exc:
        hide = {settings.VISIBLE_DEVICES_ENV: "", settings.BACKEND_ENV: "gloo"}
        return hide, f"{exc} This launch runs on the CPU with gloo."
    return {}, ""


def torch_sees_no_gpu() -> str:
    """Why this torch will see none of the GPUs NVML lists ("" when it can see them): a
    CPU-only build, or one built for a newer CUDA than the driver's (the 2.14 wheels for
    CUDA 13 need driver R580). Its ranks then pick gloo on the CPU, while NVML still counts
    the cards. No CUDA call: safe in the notebook kernel."""
    import torch

    from ddp_tutorial.devices import driver_cuda_version
    from ddp_tutorial.harness.advice import release

    driver = driver_cuda_version()
    if driver is None:
        return ""  # no driver: NVML counts no GPU either
    if torch.version.cuda is None:
        return "this torch is a CPU-only build"
    if release(torch.version.cuda)[0] > driver[0]:
        return (f"this torch is built for CUDA {torch.version.cuda}, the driver supports "
                f"{driver[0]}.{driver[1]} (ddp-tutorial doctor says what to install)")  # fmt: skip
    return ""


def torch_has_no_gpu() -> bool:
    """Whether this torch can use no GPU at all: no NVIDIA driver, or GPUs it cannot open
    (:func:`torch_sees_no_gpu`). The guard of the lessons' in-kernel CUDA demos: on a MIG
    slice it is False (the kernel's torch sees the slice) while :func:`launch_gpu_count` is 0.
    No CUDA call: safe in the notebook kernel."""
    from ddp_tutorial.devices import driver_cuda_version

    return driver_cuda_version() is None or bool(torch_sees_no_gpu())


def launch_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs the lessons' launches compute on: what a lesson's GPU branch asks for.

    The visible count, but 0 on a MIG machine, whose launches run on the CPU
    (:func:`mig_fallback`), where :func:`~ddp_tutorial.devices.visible_gpu_count` raises,
    and 0 where this torch cannot use the GPUs NVML lists (:func:`torch_sees_no_gpu`).
    """
    gpus = nvml_gpu_count(env)
    return 0 if gpus and torch_sees_no_gpu() else gpus


def nvml_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """The GPUs NVML makes visible to the launches: 0 on a MIG machine (the CPU plan), also
    where gloo is asked for (mig_fallback then has nothing to hide, and the count refuses MIG)."""
    merged = {**os.environ, **(env or {})}
    try:
        return 0 if mig_fallback(merged)[0] else visible_gpu_count(merged)
    except MigError:
        return 0


def gpu_branch_note(nproc: int, env: Mapping[str, str] | None = None) -> str:
    """What a lesson of ``nproc`` ranks prints on a machine with fewer GPUs ("" otherwise).

    Its launches then run on the CPU with gloo (the backend is nccl only with one GPU per
    rank): a GPU machine that silently ran the CPU branch would teach the CPU's numbers as
    the GPU's. gpu-check's table says the same for the lesson (``gpu_check.LESSON_RANKS``).
    """
    if nvml_gpu_count(env) and (why := torch_sees_no_gpu()):
        return f"GPU branch not run: {why}; this lesson's launches run on the CPU with gloo"
    gpus = launch_gpu_count(env)
    if 0 < gpus < nproc:
        return (
            f"GPU branch not run: needs {nproc} GPUs, {gpus} visible; this lesson's launches "
            f"run on the CPU with gloo"
        )
    return ""


def torch_blind(gpus: int) -> str:
    """Why torch cannot compute on the ``gpus`` GPUs NVML lists ("" when it sees them all).

    NVML answers without CUDA: a CPU-only torch, a wheel for a newer CUDA than the driver, a
    stopped fabric manager (CUDA error 802 on an HGX board) leave the count right and every
    launch on the CPU. gpu-check and gpu-smoke ask torch itself, in a process of its own.
    """
    import subprocess

    from ddp_tutorial.harness.checks import torch_gpu_count

    if why := torch_sees_no_gpu():
        return why
    try:
        seen = torch_gpu_count(os.environ)
    except subprocess.TimeoutExpired:
        return "torch.cuda.device_count() gave no answer within 180 s"
    if seen < gpus:
        return (f"torch sees {seen} of the {gpus} GPU(s) NVML lists (the driver, its fabric "
                "manager or the container: `ddp-tutorial doctor` says more)")  # fmt: skip
    return ""
