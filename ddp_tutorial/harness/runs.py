"""Where a launch writes: one fresh run directory per launch, old ones pruned.

The root is ``$DDP_TUTORIAL_RUNS`` (``make run`` and the notebook tests point it
into ``build/`` or a temporary folder) or ``runs/`` under the current directory
(``notebooks/runs/`` in Jupyter; git-ignored, ``make clean`` removes it).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from ddp_tutorial import settings

KEEP_RUNS = 10
"""Run directories kept per script under the default root: a learner's ``make lab`` session
re-runs cells for hours, and each run can hold checkpoints (lesson 06: tens of MB)."""

_MADE_HERE: set[Path] = set()  # run directories this process handed out: never pruned


def default_run_dir(script: str | os.PathLike[str]) -> Path:
    """``<runs root>/<script>-<time>-<n>``: a fresh folder for one launch.

    The root is ``$DDP_TUTORIAL_RUNS`` or ``runs/`` under the current directory
    (git-ignored; ``make clean`` removes it). Older runs of the same script
    beyond the newest :data:`KEEP_RUNS` are deleted, except those this process
    made, so that a notebook still finds every run it launched.
    """
    root = Path(settings.runs_root())
    stem = Path(script).stem
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = root / f"{stem}-{stamp}"
    candidate, n = base, 1
    while candidate.exists() or candidate in _MADE_HERE:
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    _MADE_HERE.add(candidate)
    prune_runs(root, stem, keep=KEEP_RUNS)
    return candidate


def prune_runs(root: Path, stem: str, keep: int = KEEP_RUNS) -> list[Path]:
    """Delete the oldest ``<stem>-YYYYmmdd-HHMMSS*`` folders under ``root`` beyond ``keep``.

    Folders this process handed out are never deleted. Returns what was removed.
    """
    pattern = re.compile(rf"{re.escape(stem)}-\d{{8}}-\d{{6}}(-\d+)?")
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and pattern.fullmatch(p.name)]
    runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in runs[keep:]:
        if old in _MADE_HERE:
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed
