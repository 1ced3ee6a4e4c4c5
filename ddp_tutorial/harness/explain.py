"""``ddp-tutorial explain LOG``: what the DDP, torchrun, gloo and NCCL messages in a log mean.

For each known message in a log (a file, or stdin): its cause, the fix and the lesson that
shows it (the catalogue: messages.py). Read together, the ranks' lines also say where each
rank failed (its last line of your code) and, from the NCCL watchdog's, which rank never
reached the collective. Nothing known: the first error line, which is where to start.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ddp_tutorial.harness.known import Known
from ddp_tutorial.harness.messages import KNOWN
from ddp_tutorial.harness.rank_lines import (
    RANK_PREFIX,
    lagging_ranks,
    rank_of,
    where_ranks_failed,
)

# A Python exception's line ("ValueError:", "torch.OutOfMemoryError:"), a tool's "error:",
# a logger's "ERROR"
ERROR_LINE = re.compile(  # NCCL's warnings, a C++ what(), a launcher's death signal too
    r"\b\w*(?:Error|Exception):|\berror:|\bERROR\b|NCCL WARN|\bwhat\(\):|death signal"
)
FAULT = re.compile(r"Fatal Python error: [\w ]+")  # faulthandler's, before the stack it prints


@dataclass
class Hit:
    """One known message: the first line that shows it, and how many lines do."""

    known: Known
    line_no: int
    line: str
    count: int = 1
    ranks: set[int] = field(default_factory=set)


def find_known(lines: list[str]) -> list[Hit]:
    """Every known message in ``lines``, once each, in the order they first appear; an entry
    whose ``when`` rules it out for this log (a key list that no prefix explains) is skipped."""
    text = "\n".join(lines)
    catalogue = [known for known in KNOWN if known.applies(text)]
    hits: dict[str, Hit] = {}
    for number, line in enumerate(lines, 1):
        for known in catalogue:
            if known.search(line):
                hit = hits.get(known.key)
                if hit is None:
                    hits[known.key] = hit = Hit(known, number, line.strip())
                else:
                    hit.count += 1
                if (rank := rank_of(line)) is not None:
                    hit.ranks.add(rank)
    return list(hits.values())


def root_cause(text: str) -> str | None:
    """torchrun's "Root Cause" in words: the rank that failed first and its last error line;
    for a rank killed by a signal, that it has none (torchrun's "traceback" field is no
    traceback, and reading its error_file or own lines for one is a dead end)."""
    from ddp_tutorial.harness.failures import parse_failures

    failures = parse_failures(text, Path("/nonexistent"))  # a log alone: no run folder
    if not failures:
        return None
    first = failures[0]
    lines = text.splitlines()
    if first.signal == "SIGABRT" and (what := _abort_reason(lines, first.rank)):
        return f"{first.describe()}, {what}"
    if first.signal and (fatal := next((ln for ln in lines if FAULT.search(ln)), None)):
        return (f"{first.describe()}: its Python stack is in the log, after faulthandler's "
                f"'{FAULT.search(fatal)[0]}' (most recent call first)")  # fmt: skip
    if first.signal:
        return f"{first.describe()}: no traceback, a killed rank writes none"
    last = next((ln for ln in reversed(first.traceback.splitlines()) if ln.strip()), "")
    if "To enable traceback" in last:  # no error_file (no @record): the rank's own lines have it
        own = [ln for ln in lines if rank_of(ln) == first.rank and ERROR_LINE.search(ln)]
        last = RANK_PREFIX.sub("", own[-1]) if own else _unprefixed_error(lines) or last
    return f"{first.describe()}: {last.strip()[:160]}" if last else first.describe()


def _unprefixed_error(lines: list[str]) -> str | None:
    """The last error line that no rank prefixed and torchrun did not print: a rank's error
    before its group was up (torch adds "[rankN]:" only once the rank is known)."""
    torchrun = re.compile(r"ChildFailedError|torch\.distributed\.elastic|^[EWI]\d{4} ")
    ours = [ln for ln in lines if rank_of(ln) is None and ERROR_LINE.search(ln)
            and not torchrun.search(ln)]  # fmt: skip
    return f"{ours[-1].strip()} (a line without a rank's prefix)" if ours else None


def _abort_reason(lines: list[str], rank: int | None) -> str:
    """A SIGABRT's C++ cause: the ``what():`` line of that rank (one that names it, or carries
    its prefix), or the log's only one; "" when none, or several and none of them its."""
    said = [ln for ln in lines if "what():" in ln]
    mine = [ln for ln in said if f"Rank {rank}]" in ln or rank_of(ln) == rank]
    if mine or len(said) == 1:
        return f"a C++ error's abort: {RANK_PREFIX.sub('', (mine or said)[0]).strip()[:200]}"
    if said:
        return "a C++ error's abort ('what():' lines above; none names this rank)"
    return ""


def explain_log(text: str) -> str:
    """The report for one log: each known message with cause, fix and lesson; then where
    the ranks were. An empty string when nothing in the log is known."""
    if not (hits := find_known(lines := text.splitlines())):
        return ""
    out = []
    for hit in hits:
        k = hit.known
        more = f" (and {hit.count - 1} more like it)" if hit.count > 1 else ""
        who = ", ".join(map(str, sorted(hit.ranks)))
        ranks = f", from rank{'s' * (len(hit.ranks) > 1)} {who}" if hit.ranks else ""
        out += [
            f"line {hit.line_no}{ranks}{more}: {hit.line[:200]}",
            f"  cause: {k.cause}",
            f"  fix:   {k.fix}",
            f"  see:   lesson {k.lesson} ({k.key})",
        ]
        if k.detail and (said := k.detail(hit.line, text)):
            out.append(f"  here:  {said}")
    if "child-failed" in [h.known.key for h in hits] and (first := root_cause(text)):
        out.append(f"torchrun's first failure: {first}")
    if lag := lagging_ranks(lines):
        out.append(f"the watchdog: {lag}")
    frames = where_ranks_failed(lines)
    if len(frames) > 1:
        places = "; ".join(f"rank {r} at {where}" for r, where in sorted(frames.items()))
        same = len(set(frames.values())) == 1
        verdict = "the same line" if same else "different lines: the ranks took different paths"
        out.append(f"where each rank failed: {places} ({verdict})")
    return "\n".join(out)


def first_error(text: str) -> str | None:
    """The first line that reads as an error ("ValueError: ...", "error: ...", "ERROR"), with
    its number: where to start when no message in the log is known."""
    for number, line in enumerate(text.splitlines(), 1):
        if ERROR_LINE.search(line):
            return f"line {number}: {line.strip()[:200]}"
    return None


def keys(text: str) -> list[str]:
    """The keys of the known messages in ``text`` (tests and lessons assert on them)."""
    return [hit.known.key for hit in find_known(text.splitlines())]


def main(paths: Iterable[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Explain each log ('-' or none: stdin). 0: something explained; 1: nothing known."""
    out, err = out or sys.stdout, err or sys.stderr
    paths = list(paths) or ["-"]
    known = unreadable = False
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(errors="replace")
        except OSError as exc:  # said, and the other files still explained
            print(f"ddp-tutorial explain: cannot read {path}: {exc.strerror}", file=err)
            unreadable = True
            continue
        report = explain_log(text)
        known = known or bool(report)
        if len(paths) > 1:
            print(f"== {path}", file=out)
        if not report and (line := first_error(text)):
            report = (
                f"no message this course knows; the first error line is the place to start\n{line}"
            )
        elif not report:
            report = ("no message this course knows, and no line it reads as an error "
                      "('...Error:', 'error:', 'ERROR'): look for how the run ended")  # fmt: skip
        print(report, file=out)
    return 2 if unreadable else 0 if known else 1
