"""The four collectives of lesson 01, each run once with a before/after record.

Every rank starts from a value it can predict from its rank alone
(:func:`rank_value`), runs a collective, and records what its tensor held
before and after. Because the inputs are known, the expected outputs are
known too (:func:`expected`), so the notebook can *assert* what each
collective did on every rank instead of trusting a printout.

Run inside an initialised process group (``scripts/demos/collectives.py``); the
table helpers work on the records afterwards, in the notebook.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce_sum", "all_reduce_avg", "broadcast", "all_gather", "reduce", "reduce_loss")
"""The collectives demonstrated, in the order the lesson shows them."""

SRC = 0
"""Source rank of broadcast and destination of reduce (as in seed 001's ``reduce_loss``)."""


def rank_value(rank: int) -> list[float]:
    """What rank ``rank`` contributes: two numbers that differ on every rank."""
    return [float(rank + 1), float(10 * (rank + 1))]


def rank_loss(rank: int) -> float:
    """A per-rank "loss" for the ``reduce_loss`` demo: 1.0, 3.0, 5.0, ..."""
    return float(2 * rank + 1)


def _values(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.detach().cpu().flatten().tolist()]


def reduce_loss_seed001(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """Seed 001's ``reduce_loss``, verbatim: only ``dst=0`` is promised the result."""
    with torch.no_grad():
        dist.reduce(tensor, dst=0)
        if rank == 0:
            tensor /= world_size


def average_all_ranks(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """The portable average: ``all_reduce(SUM)`` then divide — every rank gets it.

    ``ReduceOp.AVG`` is not available on every backend and PyTorch version
    (and never for integer tensors); SUM is, everywhere.
    """
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= world_size
    return tensor


def run_collectives(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """Run each collective of :data:`OPS` once; return ``{op: {"before", "after", ...}}``.

    Must be called on every rank of the default process group (collectives
    are rendezvous: a rank that skips one leaves the others waiting).
    """
    out: dict[str, Any] = {}

    t = torch.tensor(rank_value(rank), device=device)
    before = _values(t)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out["all_reduce_sum"] = {"before": before, "after": _values(t)}

    t = torch.tensor(rank_value(rank), device=device)
    before = _values(t)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["all_reduce_avg"] = {"before": before, "after": _values(t), "error": None}
    except (RuntimeError, ValueError) as exc:  # backends without AVG say so here
        out["all_reduce_avg"] = {"before": before, "after": None, "error": str(exc)[:300]}
    dist.barrier()  # keep the ranks in step even if one raised

    t = torch.tensor(rank_value(rank), device=device)
    before = _values(t)
    dist.broadcast(t, src=SRC)
    out["broadcast"] = {"before": before, "after": _values(t)}

    t = torch.tensor(rank_value(rank), device=device)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    out["all_gather"] = {"before": _values(t), "after": [_values(g) for g in gathered]}

    t = torch.tensor(rank_value(rank), device=device)
    before = _values(t)
    dist.reduce(t, dst=SRC, op=dist.ReduceOp.SUM)
    out["reduce"] = {"before": before, "after": _values(t)}

    loss = torch.tensor([rank_loss(rank)], device=device)
    before = _values(loss)
    reduce_loss_seed001(loss, rank, world_size)
    fixed = torch.tensor([rank_loss(rank)], device=device)
    average_all_ranks(fixed, world_size)
    out["reduce_loss"] = {"before": before, "after": _values(loss), "fixed": _values(fixed)}
    return out


def expected(op: str, rank: int, world_size: int) -> Any:
    """What ``op`` must leave on ``rank`` (``None``: not specified by PyTorch).

    ``reduce`` only promises the result on the destination rank; what the
    other ranks hold afterwards is unspecified (gloo leaves their input,
    nccl may leave a partial sum), so code must never read it.
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
