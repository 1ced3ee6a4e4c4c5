"""Helpers of lesson 03 (device mapping): the physical → logical picture, setup()'s call order.

Nothing here initialises CUDA: the notebook kernel calls these functions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ddp_tutorial.devices import logical_to_physical
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV


def torch_reading(value: str) -> list[str]:
    """What torch reads from ``CUDA_VISIBLE_DEVICES=value``: the reference for the package.

    ``torch.cuda._parse_visible_devices`` is torch's own (private) copy of the
    driver's rule, which it uses to count GPUs without initialising CUDA; it
    reads the variable from the environment, so the variable is set for the
    call only and restored after it. Entries come back as strings, as
    :func:`ddp_tutorial.devices.cuda_reading` gives them.
    """
    with mock.patch.dict(os.environ, {VISIBLE_DEVICES_ENV: value}):
        return [str(entry) for entry in torch.cuda._parse_visible_devices()]


def visibility_map(values: Sequence[str | None], gpus: int) -> Any:
    """A row per ``CUDA_VISIBLE_DEVICES`` value: every card, named as a process sees it.

    Columns are the physical cards (nvidia-smi's numbers, ``0 … gpus-1``); a card
    the process can see is coloured and labelled with its logical id ``cuda:i``
    (from :func:`ddp_tutorial.devices.logical_to_physical`), a hidden one is grey.
    Returns a ``NotebookFigure``; its texts are the labels, for the notebook to check.
    """
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    from ddp_tutorial.harness.plots import new_figure

    fig = new_figure(figsize=(1.6 + 0.75 * gpus, 0.6 + 0.6 * len(values)))
    ax = fig.subplots()
    colors = colormaps["tab10"]
    for row, value in enumerate(values):
        logical = {phys: i for i, phys in enumerate(logical_to_physical(value, gpus))}
        y = len(values) - 1 - row
        for phys in range(gpus):
            seen = phys in logical
            face = colors(logical[phys] % 10) if seen else "0.9"
            ax.add_patch(Rectangle((phys + 0.05, y + 0.1), 0.9, 0.8, facecolor=face, alpha=0.8))
            label = f"cuda:{logical[phys]}" if seen else "hidden"
            ax.text(phys + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8,
                    color="black" if seen else "0.5")  # fmt: skip
    ax.set_xlim(0, gpus)
    ax.set_ylim(0, len(values))
    ax.set_xticks([p + 0.5 for p in range(gpus)])
    ax.set_xticklabels([f"GPU {p}" for p in range(gpus)], fontsize=8)
    ax.set_xlabel("physical card (nvidia-smi's number)")
    ax.set_yticks([len(values) - 0.5 - r for r in range(len(values))])
    ax.set_yticklabels(["unset" if v is None else repr(v) for v in values], fontsize=8)
    ax.set_ylabel(VISIBLE_DEVICES_ENV, fontsize=9)
    ax.set_title("what each process calls each card", fontsize=10)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    return fig


def setup_calls(local_rank: int = 1, local_world_size: int = 2) -> list[tuple[str, Any]]:
    """The calls :func:`ddp_tutorial.distributed.setup` makes on a GPU rank, in order.

    Runs the real ``setup()`` for local rank ``local_rank`` of a one-node nccl
    job, with the two torch functions that need a GPU replaced by recorders:
    ``torch.cuda.set_device`` and ``dist.init_process_group`` (plus the backend
    choice, which would ask CUDA, and the job's store, which needs a rendezvous).
    What it observes is the order and the arguments; what those calls do to a GPU
    only a GPU shows (lesson 03's GPU cell).
    """
    from ddp_tutorial import distributed

    calls: list[tuple[str, Any]] = []
    env = {
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(distributed, "job_store", return_value=("this attempt's store", 0)),
        mock.patch.object(distributed, "job_backend", return_value=("nccl", "stand-in")),
        mock.patch.object(distributed, "set_collective_timeout"),
        mock.patch.object(dist, "is_initialized", return_value=False),
        mock.patch.object(torch.cuda, "set_device", lambda d: calls.append(("set_device", d))),
        mock.patch.object(
            dist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw))
        ),
    ):
        distributed.setup()
    return calls
