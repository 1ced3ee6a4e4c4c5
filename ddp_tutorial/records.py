"""What each rank tells the notebook: one JSON file per rank in the run directory.

Ranks are separate processes, so the notebook cannot look at their variables.
Each rank writes ``RUN_DIR/rank{r}.json`` at the end; the launcher reads them
back, and the notebook asserts its claims on them. Files are written through a
temporary name and renamed, so a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def _plain(value: Any) -> Any:
    """Turn tensors and paths into JSON-friendly values."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, torch.device | Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_plain(data), indent=1))
    os.replace(tmp, path)
    return path


def write_rank_record(
    run_dir: str | os.PathLike[str] | None, record: dict[str, Any], rank: int | None = None
) -> Path | None:
    """Write this rank's record to ``run_dir/rank{rank}.json`` (no-op without a run dir)."""
    if run_dir is None:
        return None
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return write_json(Path(run_dir) / f"rank{rank}.json", {"rank": rank, **record})


def read_rank_records(
    run_dir: str | os.PathLike[str], pattern: str = "rank*.json"
) -> list[dict[str, Any]]:
    """All records in ``run_dir`` matching ``pattern``, sorted by attempt, then rank.

    ``pattern``: ``rank*.json`` (one per rank), or e.g. ``attempt*-rank*.json``
    for the template's one record per rank per restart attempt.
    """
    records = [json.loads(p.read_text()) for p in Path(run_dir).glob(pattern)]
    return sorted(records, key=lambda r: (r.get("attempt", 0), r.get("rank", 0)))


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain-text table of dicts (one row each), for notebooks and terminals.

    Plain text on purpose: it reads the same in a notebook, a log and a diff.
    """
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)
