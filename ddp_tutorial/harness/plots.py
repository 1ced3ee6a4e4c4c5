"""Matplotlib figures the notebooks show.

Every function builds a figure directly (no ``pyplot`` state, no GUI
backend needed) and returns it: a notebook displays it by leaving it as the
cell's last value, a script saves it with ``fig.savefig(path)``. Figures made
without pyplot have no display hook in Jupyter, so they are created as
:class:`NotebookFigure`, a ``Figure`` that renders itself as PNG; new plots in
this module (and notebook cells that lay out several plots) start with
:func:`new_figure`. Nothing here reads files or launches anything: the callers
pass the numbers in.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure


class NotebookFigure(Figure):
    """A ``Figure`` that Jupyter shows as an image (``_repr_png_``), pyplot or not."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=self.dpi, bbox_inches="tight")
        return buffer.getvalue()


def new_figure(**kwargs: Any) -> NotebookFigure:
    """``NotebookFigure(**kwargs)``: the starting point of every plot here."""
    return NotebookFigure(**kwargs)


Shards = Sequence[Sequence[Sequence[int]]]  # shards[epoch][rank] -> indices in the order seen


def _order_grid(epoch_shards: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """``grid[rank, index]`` = position at which the rank saw ``index`` (NaN: not seen)."""
    grid = np.full((len(epoch_shards), length), np.nan)
    for rank, shard in enumerate(epoch_shards):
        for pos, index in enumerate(shard):
            if np.isnan(grid[rank, index]):
                grid[rank, index] = pos
    return grid


def sampler_index_map(
    shards: Shards | Mapping[str, Shards],
    length: int,
    title: str | None = None,
) -> Figure:
    """Which rank gets which dataset index, epoch by epoch (rows) — one column per case.

    Each panel is a ``ranks x indices`` grid: a cell is coloured when that
    rank receives that index, darker = later in the rank's order; an empty
    column is an index nobody gets (``drop_last``), and a red ``x`` marks an
    index handed out more than once in that epoch (padding). Pass a dict
    ``{"with set_epoch": shards, "without": shards}`` to compare cases.
    """
    cases = dict(shards) if isinstance(shards, Mapping) else {"": shards}
    if not cases or any(len(s) == 0 for s in cases.values()):
        raise ValueError("sampler_index_map needs at least one epoch of shards per case")
    n_epochs = max(len(s) for s in cases.values())
    world = max(len(s[0]) for s in cases.values())
    fig = new_figure(figsize=(min(4.5 * len(cases), 14), 0.5 + (0.35 * world + 0.45) * n_epochs))
    axes = fig.subplots(n_epochs, len(cases), squeeze=False, sharex=True)
    cmap = "viridis_r"
    vmax = max(1, max(len(shard) for case in cases.values() for ep in case for shard in ep) - 1)
    image = None
    for col, (label, case) in enumerate(cases.items()):
        for row in range(n_epochs):
            ax = axes[row][col]
            if row >= len(case):
                ax.set_axis_off()
                continue
            grid = _order_grid(case[row], length)
            image = ax.imshow(
                grid, aspect="auto", cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest"
            )
            counts = Counter(i for shard in case[row] for i in shard)
            for rank, shard in enumerate(case[row]):
                for index in set(shard):
                    if counts[index] > 1:
                        ax.plot(index, rank, marker="x", color="red", markersize=7, mew=2)
            ax.set_yticks(range(len(case[row])))
            ax.set_yticklabels([f"rank {r}" for r in range(len(case[row]))], fontsize=8)
            if col == 0:
                ax.set_ylabel(f"epoch {row}", fontsize=9)
            if row == 0 and label:
                ax.set_title(label, fontsize=10)
            ax.set_xticks(range(0, length, max(1, length // 10)))
        axes[-1][col].set_xlabel("dataset index")
    if image is not None:
        bar = fig.colorbar(image, ax=axes, fraction=0.03, pad=0.02)
        bar.set_label("position in the rank's order")
    if title:
        fig.suptitle(title)
    return fig


def grouped_bars(
    rows: Sequence[Mapping[str, Any]],
    group: str,
    series: str,
    value: str,
    ylabel: str | None = None,
    title: str | None = None,
) -> Figure:
    """Bars of ``value`` per ``group`` (x axis), one colour per ``series``.

    A general "compare settings per rank" chart, e.g. samples/s (value) per
    ``num_workers`` setting (group) for each rank (series).
    """
    if not rows:
        raise ValueError("grouped_bars needs at least one row")
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    width = 0.8 / len(names)
    fig = new_figure(figsize=(1.2 + 1.3 * len(groups) * max(1, len(names) / 2), 3))
    ax = fig.subplots()
    x = np.arange(len(groups))
    for k, name in enumerate(names):
        heights = [
            next((float(r[value]) for r in rows if r[group] == g and r[series] == name), np.nan)
            for g in groups
        ]
        ax.bar(x + (k - (len(names) - 1) / 2) * width, heights, width, label=f"{series} {name}")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{group}={g}" for g in groups])
    ax.set_ylabel(ylabel or value)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# -- utilization and training (lesson 06) ------------------------------------
def _axes(ax: Any | None, figsize: tuple[float, float] = (7, 3)) -> tuple[Figure, Any]:
    if ax is not None:
        return ax.figure, ax
    fig = new_figure(figsize=figsize)
    return fig, fig.add_subplot()


def utilization_timeline(
    rows: list[dict[str, Any]],
    window: tuple[float, float] | None = None,
    column: str = "util",
    ax: Any | None = None,
) -> Figure:
    """A line per GPU (or per rank on CPU) over time; the training window shaded.

    ``rows`` are :mod:`ddp_tutorial.harness.monitor` samples; ``window`` is in wall
    time (epoch seconds, as the ranks report it) and is drawn relative to the
    first sample. ``column``: ``"util"`` (%) or ``"mem_mib"``.
    """
    fig, ax = _axes(ax)
    if not rows:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return fig
    t0 = min(r["wall"] for r in rows)
    kind = rows[0]["kind"]
    for ident in sorted({r["id"] for r in rows}):
        mine = [r for r in rows if r["id"] == ident]
        label = f"cuda:{ident}" if kind == "gpu" else f"rank {ident}"
        ax.plot([r["wall"] - t0 for r in mine], [r[column] for r in mine], label=label)
    if window is not None:
        ax.axvspan(window[0] - t0, window[1] - t0, color="tab:green", alpha=0.12, label="training")
    ax.set_xlabel("seconds since launch")
    if column == "util":
        ax.set_ylabel("GPU utilization %" if kind == "gpu" else "CPU % (100 = one core)")
    else:
        ax.set_ylabel("memory used (MiB)" if kind == "gpu" else "resident memory (MiB)")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def step_time_plot(step_times: dict[str, list[float]], ax: Any | None = None) -> Figure:
    """Per-rank step time (ms) against step number."""
    fig, ax = _axes(ax)
    for rank, times in sorted(step_times.items(), key=lambda kv: int(kv[0])):
        ax.plot(range(1, len(times) + 1), [1000 * t for t in times], label=f"rank {rank}", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def training_curves(history: list[dict[str, float]], ax: Any | None = None) -> Figure:
    """Train loss (left axis) and validation accuracy (right axis) per epoch."""
    fig, ax = _axes(ax)
    epochs = [h["epoch"] + 1 for h in history]
    ax.plot(epochs, [h["train_loss"] for h in history], "o-", color="tab:blue", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("train loss", color="tab:blue")
    right = ax.twinx()
    right.plot(
        epochs,
        [100 * h["val_accuracy"] for h in history],
        "s-",
        color="tab:orange",
        label="val accuracy",
    )
    right.set_ylabel("val accuracy %", color="tab:orange")
    right.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    return fig


# -- scaling and performance (lesson 07) -------------------------------------
def throughput_bars(result: Mapping[str, Any], ax: Any | None = None) -> Figure:
    """Samples/s of each configuration of ``scripts/benchmark.py``, with its p50 step time."""
    fig, ax = _axes(ax, figsize=(7, 3))
    n = result["world_size"]
    keys = ["plain_1thread", "plain_all_cores", "ddp_world1", f"ddp_world{n}"]
    values = [result[k]["samples_per_sec"] for k in keys]
    bars = ax.bar(keys, values, color=["0.6", "0.4", "tab:blue", "tab:orange"])
    for bar, key in zip(bars, keys, strict=True):
        ax.annotate(
            f"{result[key]['step_ms_p50']:.0f} ms/step",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center", va="bottom", fontsize="small",
        )  # fmt: skip
    ideal = n * result["ddp_world1"]["samples_per_sec"]
    ax.axhline(ideal, ls="--", color="tab:orange", lw=1, label=f"ideal {n} x ddp_world1")
    if "plain_concurrent" in result:  # what n processes that never communicate reach
        ceiling = result["plain_concurrent"]["samples_per_sec"]
        ax.axhline(ceiling, ls=":", color="k", lw=1, label=f"ceiling: {n} plain processes")
    ax.set_ylabel("samples / s")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    return fig


def allreduce_curve(
    sweep: Sequence[Mapping[str, float]], fit: Mapping[str, Any] | None, ax: Any | None = None
) -> Figure:
    """Measured all_reduce time per message size (log-log) and the fitted ring model."""
    fig, ax = _axes(ax, figsize=(6, 3.5))
    sizes = [r["bytes"] for r in sweep]
    ax.loglog(sizes, [1e3 * r["seconds"] for r in sweep], "o", mfc="none", label="median")
    if all("best_seconds" in r for r in sweep):
        ax.loglog(sizes, [1e3 * r["best_seconds"] for r in sweep], "o", label="best (fitted)")
    if fit is not None:
        label = (
            f"2(N−1)α + 2(N−1)/N·S/B: α = {1e6 * fit['alpha_s']:.0f} µs, "
            f"B = {fit['bandwidth_Bps'] / 1e9:.2f} GB/s"
        )
        ax.loglog(sizes, [1e3 * t for t in fit["predicted_s"]], "-", label=label)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all_reduce time (ms)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def knob_bars(knobs: Sequence[Mapping[str, Any]], ax: Any | None = None) -> Figure:
    """Horizontal bars: samples/s for each DDP knob setting, the baseline marked."""
    fig, ax = _axes(ax, figsize=(7, 0.35 * len(knobs) + 1))
    names = [k["knob"] for k in knobs][::-1]
    values = [k["samples_per_sec"] for k in knobs][::-1]
    ax.barh(names, values, color="tab:blue")
    if knobs:
        ax.axvline(knobs[0]["samples_per_sec"], color="k", lw=1, ls="--", label=knobs[0]["knob"])
        ax.legend(fontsize="small", loc="lower right")
    ax.set_xlabel("samples / s")
    ax.grid(alpha=0.3, axis="x")
    return fig


# -- fault tolerance (lesson 08) ---------------------------------------------
def loss_across_restarts(
    log: Sequence[Mapping[str, Any]],
    crash_step: int | None = None,
    resume_step: int | None = None,
    reference: Sequence[Mapping[str, Any]] | None = None,
    ax: Any | None = None,
) -> Figure:
    """Rank 0's loss per step, one line per attempt; the crash and the resume point marked.

    ``log`` holds ``{"attempt", "step", "loss"}`` rows (``steps.jsonl`` of a
    run of the template); ``reference`` is an uninterrupted run's log, drawn
    underneath: an exact resume lies right on top of it.
    """
    fig, ax = _axes(ax, figsize=(8, 3.2))
    if reference:
        ax.plot([r["step"] for r in reference], [r["loss"] for r in reference], color="0.75",
                lw=5, label="uninterrupted run")  # fmt: skip
    for attempt in sorted({r["attempt"] for r in log}):
        rows = [r for r in log if r["attempt"] == attempt]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], ".-", lw=1,
                label=f"attempt {attempt}")  # fmt: skip
    if crash_step is not None:
        ax.axvline(
            crash_step, color="tab:red", ls="--", lw=1, label=f"crash after step {crash_step}"
        )
    if resume_step is not None:
        ax.axvline(resume_step, color="tab:green", ls=":", lw=1.5,
                   label=f"resumed from snapshot at step {resume_step}")  # fmt: skip
    ax.set_xlabel("global step")
    ax.set_ylabel("rank 0 batch loss")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


# -- speed tools (lesson 11) ---------------------------------------------------
def overlap_timeline(cases: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure:
    """One DDP step's backward and its all_reduces on a time line, one panel per case.

    ``cases`` maps a label to ``ddp_tutorial.lessons.speed.profile_rows``
    output: ``{"kind": "backward" | "launch" | "comm", "name", "start", "end"}``
    in µs. Backward's compute nodes are the upper lane (``AccumulateGrad``,
    where DDP's hooks run and finally wait, is left out), the backend's
    all_reduces the lower one; a dotted line marks each launch from backward.
    Communication drawn under backward compute is overlap. ``kernel_rows``
    output (a GPU's kernels, no launches) draws the same way.
    """
    if not cases:
        raise ValueError("overlap_timeline needs at least one case")
    fig = new_figure(figsize=(9, 1.1 + 1.3 * len(cases)))
    axes = fig.subplots(len(cases), 1, squeeze=False, sharex=True)[:, 0]
    lanes = {"backward": (1, "tab:blue"), "comm": (0, "tab:orange")}
    for ax, (label, rows) in zip(axes, cases.items(), strict=True):
        for kind, (y, colour) in lanes.items():
            spans = [(r["start"] / 1e3, (r["end"] - r["start"]) / 1e3) for r in rows
                     if r["kind"] == kind]  # fmt: skip
            ax.broken_barh(spans, (y - 0.35, 0.7), color=colour, alpha=0.8)
        for r in rows:
            if r["kind"] == "launch":
                ax.axvline(r["start"] / 1e3, color="tab:red", ls=":", lw=1)
        ax.set_yticks([1, 0])
        ax.set_yticklabels(["backward", "all_reduce"], fontsize=8)
        ax.set_ylim(-0.6, 1.6)
        launched = any(r["kind"] == "launch" for r in rows)  # GPU kernel rows have none
        ax.set_title(f"{label} (dotted: all_reduce launched)" if launched else label, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("ms since backward began (one rank, one step)")
    fig.tight_layout()
    return fig


def loss_curves(
    curves: Mapping[str, Sequence[float]], log: bool = False, ax: Any | None = None
) -> Figure:
    """One line per run: loss against optimizer step (from 1); ``log`` for a blow-up."""
    fig, ax = _axes(ax)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, ".-", lw=1, label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig
