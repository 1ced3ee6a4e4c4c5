"""What the ranks' own lines in a log say: where each one failed, and who fell behind.

``ddp-tutorial explain`` reads a log for known messages; these read it rank by rank, from
torchrun's "[rankN]:" prefixes: each rank's last frame of the user's code, and from the NCCL
watchdog's lines the rank that never reached a collective.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# torchrun's prefixes: "[rank1]:", and with --tee "[default1]:[rank1]:" (role, local rank);
# in front of them what a launcher or a log collector adds: a time ("2025-02-18 12:54 "),
# a pid ("[80746] ")
RANK_PREFIX = re.compile(
    r"^[\d\-/:.,T ]*(?:\[\d+\] )?"
    r"(?:(?:\[[A-Za-z_]+\d+\]:)*?\[rank(?P<rank>\d+)\]:|\[default(?P<local>\d+)\]:)"
)
WATCHDOG = re.compile(
    r"\[Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: "
    r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
)
ENQUEUED = re.compile(
    r"Rank (?P<rank>\d+)\][^\n]*?(?:at work: (?P<work>\d+), )?"
    r"last enqueued (?:NCCL )?work: (?P<enqueued>-?\d+), "
    r"last completed (?:NCCL )?work: (?P<completed>-?\d+)"
)
# The process group NCCL's lines name: "[PG ID 0 PG GUID 0(default_pg) Rank 1]" (2.6+),
# "[PG 1 Rank 0]" (2.4); torch 1.x names none. Their "Rank N" counts inside that group.
PG_NAME = re.compile(
    r"\[PG (?:ID (?P<id>\d+) )?(?:PG GUID (?P<guid>\S+) )?(?:(?P<n>\d+) )?Rank \d+\]"
)
FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3\.\d+/|<frozen ")
# A traceback's last line ("ValueError: ...", "torch.distributed.DistBackendError: ...")
RAISED = re.compile(r"^\s*(?:\w+\.)*\w*(?:Error|Exception|Group|Interrupt|Exit)(?::|$)")
GROUP_BAR = re.compile(r"^\s*\|(?= )")  # an ExceptionGroup draws its frames behind "  |"


def rank_of(line: str) -> int | None:
    m = RANK_PREFIX.match(line)
    if not m:
        return None
    return int(m["rank"] if m["rank"] is not None else m["local"])


def where_ranks_failed(lines: list[str]) -> dict[int, str]:
    """Each rank's last frame of its own code, with its line ('train.py:52 in f: y = m(x)'):
    the rank's next line indented as a frame's source (not a line another thread printed in
    between, such as torch's "Flight Recorder dumped to ...", seen on a loaded host). A frame
    without a source line (code compiled from a string) keeps none: the exception's line ends
    the wait, so an indented line of its message is not taken for code."""
    frames: dict[int, str] = {}
    pending: set[int] = set()  # ranks whose next indented line is their last own frame's code
    for line in lines:
        if (rank := rank_of(line)) is None:
            continue
        m, text = FRAME.search(line), GROUP_BAR.sub("", RANK_PREFIX.sub("", line))
        if m is None and rank in pending:
            if RAISED.match(text):
                pending.discard(rank)
            elif text.startswith("    "):  # else another thread's line, not the frame's source
                pending.discard(rank)
                if (code := text.strip()) and not set(code) <= set("^~ "):
                    frames[rank] += f": {code}"
        elif m is None or LIBRARY.search(m["file"]):
            pending.discard(rank)
        else:
            frames[rank] = f"{Path(m['file']).name}:{m['line']} in {m['func']}"
            pending.add(rank)
    return frames


@dataclass
class Timeouts:
    """What the NCCL watchdog's lines say, by rank: the global rank where torchrun's prefix
    gives it, else NCCL's "[Rank N]" (which counts inside the line's process group)."""

    waited: dict[int, tuple[int, str]] = field(default_factory=dict)  # the highest SeqNum, op
    enqueued: dict[int, int] = field(default_factory=dict)  # the last work each one enqueued
    seen: set[int] = field(default_factory=set)  # every rank that logged a line
    group_of: dict[tuple[int, int], str] = field(default_factory=dict)  # (rank, SeqNum): PG


def _group(line: str) -> str | None:
    if not (m := PG_NAME.search(line)):
        return None
    return (
        f"PG GUID {m['guid']}" if m["guid"] else f"PG ID {m['id']}" if m["id"] else f"PG {m['n']}"
    )


def read_timeouts(lines: list[str]) -> Timeouts:
    """Each rank's highest timed-out collective (a rank in several groups logs one per
    group), its last enqueued work, and the group a line names beside a SeqNum."""
    t = Timeouts()
    for line in lines:
        if (prefixed := rank_of(line)) is not None:
            t.seen.add(prefixed)
        group = _group(line)
        if m := WATCHDOG.search(line):
            rank, seq = prefixed if prefixed is not None else int(m["rank"]), int(m["seq"])
            if seq > t.waited.get(rank, (-1, ""))[0]:
                t.waited[rank] = (seq, m["op"])
            t.seen.add(rank)
            if group:
                t.group_of[rank, seq] = group
        if m := ENQUEUED.search(line):
            rank = prefixed if prefixed is not None else int(m["rank"])
            t.enqueued[rank] = max(int(m["enqueued"]), t.enqueued.get(rank, -1))
            t.seen.add(rank)
            if group and m["work"]:
                t.group_of[rank, int(m["work"])] = group
    return t


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _several_groups(t: Timeouts, groups: set[str]) -> str:
    """Timeouts in several process groups: each group numbers its own collectives, so a
    lower SeqNum says nothing about being behind. Each rank's wait, with its group."""
    each = ", ".join(
        f"rank {r} in {op} #{s}" + (f" ({g})" if (g := t.group_of.get((r, s))) else "")
        for r, (s, op) in sorted(t.waited.items())
    )
    return (
        f"timeouts in {len(groups)} process groups ({', '.join(sorted(groups))}), each "
        f"counting its own collectives, so no rank is named as behind: {each}; compare the "
        "ranks of one group"
    )


def lagging_ranks(lines: list[str]) -> str | None:
    """From the NCCL watchdog's lines: who waited in which collective, and who fell behind.

    Every rank that reached collective number S and waited logs a timeout for SeqNum S.
    A rank whose last enqueued work is below S never called it; a rank that logged
    nothing at all while the others timed out was busy elsewhere (ranks 0 to the highest
    that logged exist): either is the one to look at. SeqNums count inside one process
    group: across several none is compared, and where no line names its group (torch 1.x)
    a lower one may be another group's."""
    t = read_timeouts(lines)
    if not t.waited:
        return None
    if len(groups := set(t.group_of.values())) > 1:
        return _several_groups(t, groups)
    seq = max(s for s, _ in t.waited.values())
    op = next(o for s, o in t.waited.values() if s == seq)
    in_it = {r for r, (s, _) in t.waited.items() if s == seq}
    in_it |= {r for r, e in t.enqueued.items() if e >= seq and r not in t.waited}
    lower = {r for r, (s, _) in t.waited.items() if s < seq}
    behind = {r for r, e in t.enqueued.items() if e < seq} | (t.seen - in_it - lower)
    if groups:  # one group named: its numbers compare
        behind, lower = behind | lower, set()
    text = f"{_ranks(in_it)} waited in {op} #{seq}"
    if behind:
        text += (
            f"; the rank that fell behind: {', '.join(map(str, sorted(behind)))} (never called it)"
        )
    if lower:
        at = ", ".join(f"rank {r} at #{t.waited[r][0]}" for r in sorted(lower))
        text += (
            f"; lower: {at}: behind, or counting another process group's collectives "
            "(no line names the group)"
        )
    if behind or lower:
        return text
    if silent := sorted(set(range(max(t.seen) + 1)) - t.seen):  # ranks 0..max exist: no line
        top = max(t.seen)  # a rank above it would be known from no line at all (helper 138)
        return (
            f"{text}; silent: {_ranks(silent)} (behind, or logs elsewhere; ranks above {top}: "
            "unknown)"
        )
    return text + "; every rank that logged reached it: the slow one logged nothing (look for it)"
