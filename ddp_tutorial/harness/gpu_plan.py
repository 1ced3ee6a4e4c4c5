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


def launch_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs the lessons' launches compute on: what a lesson's GPU branch asks for.

    The visible count, but 0 on a MIG machine, whose launches run on the CPU
    (:func:`mig_fallback`), where :func:`~ddp_tutorial.devices.visible_gpu_count` raises.
    """
    merged = {**os.environ, **(env or {})}
    return 0 if mig_fallback(merged)[0] else visible_gpu_count(merged)
