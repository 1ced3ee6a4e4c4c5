"""What the ranks' own lines in a log say: where each one failed, and who fell behind.

``ddp-tutorial explain`` reads a log for known messages; these read it rank by rank, from
torchrun's "[rankN]:" prefixes: each rank's last frame of the user's code, and from the NCCL
watchdog's lines the rank that never reached a collective.
"""

from __future__ import annotations

import re
from pathlib import Path

# torchrun's prefixes: "[rank1]:", and with --tee "[default1]:[rank1]:" (role, local rank)
RANK_PREFIX = re.compile(
    r"^(?:\[[A-Za-z_]+\d+\]:)*?\[rank(?P<rank>\d+)\]:|^\[default(?P<local>\d+)\]:"
)
WATCHDOG = re.compile(
    r"\[Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: "
    r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
)
ENQUEUED = re.compile(
    r"Rank (?P<rank>\d+)\][^\n]*?last enqueued (?:NCCL )?work: (?P<enqueued>-?\d+), "
    r"last completed (?:NCCL )?work: (?P<completed>-?\d+)"
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


def lagging_ranks(lines: list[str]) -> str | None:
    """From the NCCL watchdog's lines: who waited in which collective, and who fell behind.

    Every rank that reached collective number S and waited logs a timeout for SeqNum S.
    A rank whose last enqueued work is below S never called it; a rank that logged
    nothing at all while the others timed out was busy elsewhere (ranks 0 to the highest
    that logged exist): either is the one to look at."""
    waited: dict[int, tuple[int, str]] = {}
    enqueued: dict[int, int] = {}
    seen: set[int] = set()
    for line in lines:
        if (rank := rank_of(line)) is not None:
            seen.add(rank)
        if m := WATCHDOG.search(line):
            waited.setdefault(int(m["rank"]), (int(m["seq"]), m["op"]))
            seen.add(int(m["rank"]))
        if m := ENQUEUED.search(line):
            enqueued[int(m["rank"])] = int(m["enqueued"])
    if not waited:
        return None
    seq = max(s for s, _ in waited.values())
    op = next(o for s, o in waited.values() if s == seq)
    in_it = sorted(r for r, (s, _) in waited.items() if s == seq)
    behind = sorted(
        {r for r, e in enqueued.items() if e < seq}
        | {r for r, (s, _) in waited.items() if s < seq}
        | (seen - set(waited))
    )
    text = f"ranks {', '.join(map(str, in_it))} waited in {op} #{seq}"
    if behind:
        return f"{text}; the rank that fell behind: {', '.join(map(str, behind))} (never called it)"
    if silent := sorted(set(range(max(seen) + 1)) - seen):  # ranks 0..max exist: they did not log
        named = f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
        return f"{text}; silent: {named} (behind, or logs elsewhere)"
    return text + "; every rank that logged reached it: the slow one logged nothing (look for it)"
