"""Helpers for the debugging lab (lesson 09): run a broken case, keep the lines that matter.

A failing DDP launch prints a lot: two ranks' tracebacks, torchrun's
summary, warnings. What a learner must read is one or two lines — gloo's
``Timed out waiting 5000ms for recv operation``, DDP's ``Parameters which did
not receive grad for rank 0: aux.bias, aux.weight``, ``Rank 1 failed to pass
monitoredBarrier``. :func:`key_lines` picks those out of the real output
(rank prefix kept: *which* rank said it is half the diagnosis).

A debugger that waits for input is run with
:func:`ddp_tutorial.harness.processes.run_command`: text on its stdin and a
hard timeout that kills the whole process tree, so it can never hang a
notebook or a test.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddp_tutorial.harness.launch import LaunchSpec, RunResult, run_together

KEY_PATTERNS = (
    r"Timed out waiting \d+ms",
    r"Application timeout caused pair closure",
    r"failed to pass monitoredBarrier",
    r"Detected mismatch between collectives",
    r"Expected to have finished reduction",
    r"did not receive grad",
    r"EADDRINUSE|[Aa]ddress already in use",
    r"Missing key\(s\)|Unexpected key\(s\)",
    r"unrecognized arguments",
    r"Connection closed by peer",
    r"RendezvousTimeoutError|[Rr]endezvous.*time",
    r"BackendError|DeviceError",
)


def key_lines(
    output: str,
    patterns: Iterable[str] = KEY_PATTERNS,
    width: int | None = 400,
) -> list[str]:
    """The lines of ``output`` that match any of ``patterns``, each message once.

    torchrun's ``--tee`` prefix (``[default0]:``) and C++ log timestamps
    (``[E1129 19:30:42.2 ProcessGroupGloo.cpp:68]``) are removed; the
    ``[rankN]:`` prefix is kept — *which* rank said it is half the diagnosis.
    A message already shown for a rank is not repeated, and the copy in
    torchrun's closing summary (no rank prefix) is dropped when a rank already
    said it. Lines longer than ``width`` are cut with ``…``.
    """
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    seen: set[tuple[str, str]] = set()
    said: set[str] = set()
    out = []
    for raw in output.splitlines():
        if not regex.search(raw):
            continue
        line = re.sub(r"^\[default\d+\]:", "", raw).strip()
        line = re.sub(r"\[[EWI]\d{4} [\d:.]+ (?:\d+ )?[\w./]+:\d+\] ?", "", line)
        if line.startswith(("File ", "raise ", "^")):
            continue
        match = re.match(r"^\[rank(\d+)\]:\s*", line)
        rank = match.group(1) if match else ""
        text = line[match.end() :] if match else line
        if (rank, text) in seen or (not rank and text in said):
            continue
        seen.add((rank, text))
        said.add(text)
        if width is not None and len(line) > width:
            line = line[: width - 1] + "…"
        out.append(line)
    return out


def first_match(output: str, pattern: str) -> str | None:
    """The first line of ``output`` containing ``pattern`` (a regex), or None."""
    regex = re.compile(pattern)
    return next((ln for ln in output.splitlines() if regex.search(ln)), None)


def case(
    script: str | os.PathLike[str], args: Sequence[object] = (), nproc: int = 2, **options: Any
) -> LaunchSpec:
    """One launch of the lab: 2 ranks unless said otherwise; ``options``: see LaunchSpec."""
    return LaunchSpec(script, args, nproc=nproc, **options)


def run_cases(
    cases: Mapping[str, LaunchSpec],
    timeout: float = 120.0,
    run_dir: str | os.PathLike[str] | None = None,
) -> dict[str, RunResult]:
    """Start every case at once under torchrun, wait for all; ``{name: RunResult}``.

    The broken cases mostly *wait* (for a timeout to end a hang), so running
    them side by side costs little more than the slowest one. Failures are
    results here, not exceptions: the lab reads them. ``timeout`` is the hard
    limit per launch, after which it is killed; case ``name`` writes to
    ``run_dir/name``.
    """
    base = Path(run_dir) if run_dir is not None else None
    specs = {
        name: replace(spec, timeout=timeout, echo=False,
                      run_dir=base / name if base is not None else spec.run_dir)
        for name, spec in cases.items()
    }  # fmt: skip
    return run_together(specs)
