"""The four collectives of lesson 01, each run once with a before/after record.

Every rank starts from a value it can predict from its rank alone
(:func:`rank_value`), runs a collective, and records what its tensor held
before and after. Because the inputs are known, the expected outputs are
known too (:func:`expected`), so the notebook can *assert* what each
collective did on every rank instead of trusting a printout.

The collectives themselves run in ``scripts/demos/collectives.py`` (the lines lesson 01
shows, one function per collective); this module holds what the notebook needs around them:
the inputs, the expected outputs, the table and the picture.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ddp_tutorial.harness.processes import PLAIN_OUTPUT

OPS = ("all_reduce_sum", "all_reduce_avg", "broadcast", "all_gather", "reduce", "reduce_loss")
"""The collectives demonstrated, in the order the lesson shows them."""

SRC = 0
"""Source rank of broadcast and destination of reduce (as in seed 001's ``reduce_loss``)."""


def rank_value(rank: int) -> list[float]:
    """What rank ``rank`` contributes: two numbers that differ on every rank."""
    return [float(rank + 1), float(10 * (rank + 1))]


def rank_loss(rank: int) -> float:
    """A per-rank "loss" for the ``reduce_loss`` demo: 1, 2, 4, 8, ...

    Powers of two, so that no rank's own loss is ever the mean of them all
    ((2**N - 1) / N is not a power of two for N > 1): with 1, 3, 5, ... the
    middle rank of an odd world would hold the mean by coincidence, and the
    lesson's "the other ranks do not get the mean" could not be checked there.
    """
    return float(2**rank)


def expected(op: str, rank: int, world_size: int) -> Any:
    """What ``op`` must leave on ``rank`` (``None``: not specified by PyTorch).

    ``reduce`` only promises the result on the destination rank; what the
    other ranks hold afterwards is unspecified (on gloo: their input with 2
    ranks; with 3, rank 1 held a partial sum), so code must never read it.
    """
    values = [rank_value(r) for r in range(world_size)]
    total = [sum(col) for col in zip(*values, strict=True)]
    if op == "all_reduce_sum":
        return total
    if op == "all_reduce_avg":
        return [v / world_size for v in total]
    if op == "broadcast":
        return values[SRC]
    if op == "all_gather":
        return values
    if op == "reduce":
        return total if rank == SRC else None
    if op == "reduce_loss":
        mean = sum(rank_loss(r) for r in range(world_size)) / world_size
        return [mean] if rank == SRC else None
    raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")


def before_after_rows(records: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    """Rows (one per rank) for :func:`ddp_tutorial.records.format_table`."""
    rows = []
    for rec in records:
        entry = rec["collectives"][op]
        row = {"rank": rec["rank"], "before": entry["before"], "after": entry["after"]}
        if "fixed" in entry:
            row["all_reduce/N (fix)"] = entry["fixed"]
        if entry.get("error"):
            row["error"] = entry["error"]
        rows.append(row)
    return rows


def check_records(records: list[dict[str, Any]]) -> list[str]:
    """Every op on every rank against :func:`expected`; returns the mismatches (empty: all good)."""
    world_size = len(records)
    problems = []
    for rec in records:
        rank = rec["rank"]
        for op in OPS:
            entry = rec["collectives"][op]
            want = expected(op, rank, world_size)
            if op == "all_reduce_avg" and entry.get("error"):
                continue  # this backend has no AVG; the notebook shows the error
            if want is not None and not close(entry["after"], want):
                problems.append(f"rank {rank} {op}: got {entry['after']}, expected {want}")
    return problems


def store_listener(port: int) -> dict[str, Any]:
    """Which process listens on ``port`` (the store at MASTER_PORT): this one, its parent, neither.

    Call it while the process group exists. Under torchrun the parent of a rank
    is the torchrun agent, which hosts the store; under ``mp.spawn`` rank 0's
    ``init_process_group`` creates it, in rank 0's own process. psutil is
    imported here, not at module level: only the lesson's scripts need it.
    """
    import os

    import psutil

    def listens(pid: int) -> bool:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.Error, OSError):
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)

    parent = os.getppid()
    return {
        "port": port,
        "self": listens(os.getpid()),
        "parent": listens(parent),
        "parent_pid": parent,
        "parent_cmd": " ".join(psutil.Process(parent).cmdline()[:4]),
    }


def close(got: Any, want: Any, rel: float = 1e-6) -> bool:
    """Equal up to float32 rounding, element by element (nested lists too).

    A sum or an average over 3, 5, 6 or 7 ranks is not exact in float32 (and
    nccl's ring sums in another order than Python): the last bit may differ.
    Anything beyond a rounding step is still a mismatch.
    """
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(close(g, w, rel) for g, w in zip(got, want, strict=True))
        )
    return math.isclose(got, want, rel_tol=rel, abs_tol=rel)


def progress_frames(output: str) -> list[str]:
    """The successive frames progress bars drew into ``output``, in the order they were written.

    tqdm redraws its line with ``\\r``; several processes that share one
    terminal (``mp.spawn`` children do) write their frames into one stream.
    Split at every ``\\r`` and newline, keep the frames that look like a bar.
    """
    frames = (f.strip() for f in output.replace("\r", "\n").splitlines())
    return [f for f in frames if "|" in f and "it" in f]


PICTURED = ("all_reduce_sum", "broadcast", "all_gather", "reduce")
"""The collectives :func:`collectives_figure` draws, top to bottom."""

_CAPTIONS = {
    "all_reduce_sum": "all_reduce(SUM): every rank gets the sum",
    "broadcast": f"broadcast(src={SRC}): every rank gets rank {SRC}'s tensor",
    "all_gather": "all_gather: every rank gets every rank's tensor",
    "reduce": f"reduce(dst={SRC}): only rank {SRC} is promised the sum (hatched: whatever is left)",
}


def collectives_figure(records: list[dict[str, Any]], ops: tuple[str, ...] = PICTURED) -> Any:
    """Each rank's tensor before (left) and after (right) each collective, from the records.

    One panel per collective, one row per rank, one box per number. A box's
    colour says whose value it is: the rank's own colour, grey for a sum of
    every rank's values, and a hatched pale box for what ``reduce`` leaves on
    the other ranks (not promised by PyTorch; drawn with the value recorded).
    matplotlib is imported here: ranks import this module and never draw.
    """
    from matplotlib import colormaps
    from matplotlib.patches import FancyArrow

    from ddp_tutorial.harness.plots import new_figure

    n = len(records)
    tab10 = colormaps["tab10"]
    palette = [tab10(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]  # no grey: grey means "a sum"

    def colours(rank: int) -> Any:
        return palette[rank % len(palette)]

    widest = max(len(_flat(rec["collectives"][op]["after"])) for rec in records for op in ops)
    width_units = 2 + 2 + 1.5 + widest  # label, before (2 numbers), arrow, after
    fig = new_figure(figsize=(max(7.0, 0.55 * width_units), (0.32 * n + 0.55) * len(ops)))
    axes = fig.subplots(len(ops), 1, squeeze=False)[:, 0]
    for ax, op in zip(axes, ops, strict=True):
        for rec in records:
            rank, entry = rec["rank"], rec["collectives"][op]
            y = n - 1 - rank
            ax.text(1.7, y + 0.45, f"rank {rank}", ha="right", va="center", fontsize=8)
            before = _flat(entry["before"])
            for k, v in enumerate(before):
                _box(ax, 2 + k, y, v, colours(rank))
            ax.add_patch(FancyArrow(2 + len(before) + 0.2, y + 0.45, 0.9, 0, width=0.04,
                                    head_width=0.25, head_length=0.25, color="0.4"))  # fmt: skip
            start = 2 + len(before) + 1.5
            after = entry["after"]
            if op == "all_gather":  # a list of every rank's tensor: colour by its owner
                for owner, part in enumerate(after):
                    for k, v in enumerate(part):
                        _box(ax, start + owner * len(part) + k, y, v,
                             colours(owner))  # fmt: skip
            elif op == "broadcast":
                for k, v in enumerate(after):
                    _box(ax, start + k, y, v, colours(SRC))
            elif op == "reduce" and rank != SRC:
                for k, v in enumerate(after):
                    _box(ax, start + k, y, v, "0.95", hatch="///")
            else:  # a sum of every rank's values
                for k, v in enumerate(after):
                    _box(ax, start + k, y, v, "0.75")
        ax.set_xlim(0, width_units + 0.2)
        ax.set_ylim(-0.2, n + 0.1)
        ax.set_title(_CAPTIONS.get(op, op), fontsize=9, loc="left")
        ax.axis("off")
    fig.suptitle("each rank's tensor: before → after", fontsize=10)
    fig.tight_layout()
    return fig


def _flat(values: Any) -> list[float]:
    if values and isinstance(values[0], list):
        return [v for part in values for v in part]
    return list(values)


def _box(ax: Any, x: float, y: float, value: float, colour: Any, hatch: str | None = None) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y + 0.05), 0.92, 0.8, facecolor=colour, edgecolor="0.3",
                           linewidth=0.6, alpha=0.85, hatch=hatch))  # fmt: skip
    ax.text(x + 0.46, y + 0.45, f"{value:g}", ha="center", va="center", fontsize=7)


class Background:
    """A plain command (not torchrun) running in a thread; :meth:`wait` returns its result."""

    def __init__(self, command: list[str], timeout: float, run_dir: Any = None) -> None:
        import subprocess
        from concurrent.futures import ThreadPoolExecutor

        self.command, self.run_dir = command, run_dir
        self._pool = ThreadPoolExecutor(max_workers=1)
        env = {**os.environ, **PLAIN_OUTPUT}  # as every process the harness starts
        self._future = self._pool.submit(
            subprocess.run, command, capture_output=True, text=True, timeout=timeout, env=env
        )

    def wait(self) -> Any:
        """The ``subprocess.CompletedProcess`` (raises ``TimeoutExpired`` past the timeout)."""
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=False)


def start_lesson_launches(nproc: int, timeout: float, demos: str = "../scripts/demos") -> dict:
    """Every launch of lesson 01, started at once: ``{name: handle}``, each with ``.wait()``.

    A launch costs seconds of interpreter and torch start-up; started together
    they cost little more than the slowest, and the notebook reads each in its
    own section. torchrun launches return a ``RunResult`` from ``wait()``; the
    plain commands (``mp.spawn``, the deprecated launcher) a ``CompletedProcess``.
    Host side only: imports the harness here, never at module level (ranks import
    this module).
    """
    import sys

    from ddp_tutorial.harness.launch import default_run_dir, start

    script = f"{demos}/collectives.py"
    legacy = [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nnodes=1",
              "--nproc_per_node=2", f"{demos}/legacy_local_rank.py"]  # fmt: skip
    spawn_dir = default_run_dir("spawn_template")
    spawn = [sys.executable, f"{demos}/spawn_template.py", "--nprocs", "2", "--bars"]
    quiet = {"timeout": timeout, "echo": False}
    return {
        "main": start(script, nproc=nproc, timeout=timeout),
        "one rank": start(script, nproc=1, **quiet),
        # gloo, and no torch at all: side by side on EXCLUSIVE_PROCESS GPUs too (gpus=False)
        "uneven": start(f"{demos}/uneven_gather.py", nproc=2, check=False, gpus=False, **quiet),
        "torchrun, seed": start(
            f"{demos}/legacy_local_rank.py", "--style", "seed", nproc=2, gpus=False, **quiet
        ),  # fmt: skip
        "spawn": Background([*spawn, "--out", str(spawn_dir)], timeout, run_dir=spawn_dir),
        "legacy, seed": Background([*legacy, "--style", "seed"], timeout),
        "legacy, fixed": Background([*legacy, "--style", "fixed"], timeout),
    }
