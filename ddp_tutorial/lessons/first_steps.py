"""Lesson 00's helpers: a script's code, the diff of the two twin scripts, their printed losses.

``scripts/single_process.py`` and ``scripts/minimal_ddp.py`` are the two files a
learner copies first. The lesson shows their diff (read from the files when the
notebook runs, so the diff and the explanation beside it cannot drift apart
unnoticed) and compares what the two printed and saved.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EPOCH_LINE = re.compile(r"epoch (\d+): loss ([0-9.]+)")
"""What both twins print once per epoch (the DDP one on rank 0 only)."""


def code_after_docstring(path: str | Path) -> str:
    """The file's text after its module docstring: the code a reader compares.

    The two twins' docstrings say different things about how to run them;
    the diff that teaches is the one of the code.
    """
    text = Path(path).read_text()
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    skip = 0
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        skip = first.end_lineno or 0
    return "\n".join(text.splitlines()[skip:]).strip("\n") + "\n"


def code_diff(old: str | Path, new: str | Path, context: int = 1) -> str:
    """Unified diff of the code (after the docstrings) of ``old`` and ``new``."""
    a = code_after_docstring(old).splitlines()
    b = code_after_docstring(new).splitlines()
    lines = difflib.unified_diff(a, b, Path(old).name, Path(new).name, n=context, lineterm="")
    return "\n".join(lines) + "\n"


def changed_lines(diff: str) -> tuple[list[str], list[str]]:
    """``(removed, added)``: the code lines a diff takes away and puts in, stripped.

    Blank lines and lines that are only a comment are left out: they explain,
    they do not change what runs.
    """
    removed, added = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        body = line[1:].strip()
        if not body or body.startswith("#"):
            continue
        if line.startswith("-"):
            removed.append(body)
        elif line.startswith("+"):
            added.append(body)
    return removed, added


def unexplained(diff: str, explained: Mapping[str, Any]) -> list[str]:
    """Changed lines of ``diff`` that contain none of the ``explained`` fragments."""
    removed, added = changed_lines(diff)
    return [line for line in removed + added if not any(f in line for f in explained)]


def epoch_losses(output: str) -> list[float]:
    """The per-epoch losses a twin printed, in epoch order (``epoch k: loss x``)."""
    found = [(int(e), float(v)) for e, v in EPOCH_LINE.findall(output)]
    epochs = [e for e, _ in found]
    if epochs != list(range(len(found))):
        raise ValueError(f"expected epochs 0, 1, ... once each, got {epochs}")
    return [v for _, v in found]


def max_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Largest absolute difference between two state_dicts with the same keys and shapes."""
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(a)} vs {sorted(b)}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
