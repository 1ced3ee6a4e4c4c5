"""Lesson 01's second exercise: all_gather of tensors whose lengths differ by rank.

``01_gather_uneven``: each rank hands the learner's function a tensor of its own length (and
then the same plus 0.25, floats); ``run`` records what came back and which calls made it,
``judge_gather`` names the first mistake: values, order, dtype, padding left or trimmed by
value, a fixed size sent, a gather that is not one all_gather.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ddp_tutorial.exercises.core import Context, Exercise, Record, ranks_written_as
from ddp_tutorial.exercises.lesson01 import as_values, watched

# rank 0's is not the longest: its length taken for all shows; and it is longer than 1, so
# that output buffers that are one tensor ([t] * world: every rank's data lands in the same
# one) differ from rank 0's own data beyond the -1 every rank starts with; and the longest is
# longer than the mean rounded up (helper 168: a pad to ceil(total / world) passed on 3 and 4)
LENGTHS = (3, 5, 4, 3)


def uneven_input(rank: int) -> torch.Tensor:
    """Labels, say: int64, so that a float padding buffer shows; each starts with -1 (an
    ignored label), a longer one holds a 0 inside, and they end in 0 (even ranks) or -1 (odd):
    a padding of -1 or of 0 trimmed by value shows too, all of it or only at the end (helper
    147: trailing ones stripped passed; a loss of its end reads as a trim to the wrong length)."""
    x = torch.arange(LENGTHS[rank % len(LENGTHS)], dtype=torch.int64) + 100 * rank
    x[0], x[-1] = -1, 0 if rank % 2 == 0 else -1
    if len(x) > 3:
        x[1] = 0
    return x


def run_gather(module: ModuleType, ctx: Context) -> Record:
    calls: list[tuple[str, Any]] = []
    with watched(calls, module):
        got = module.gather_uneven(uneven_input(ctx.rank))
    # and floats (losses, say): a padding buffer of a fixed integer dtype truncates them
    floats = as_values(module.gather_uneven(uneven_input(ctx.rank) + 0.25))
    dtypes = [str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None
              for t in (got if isinstance(got, list | tuple) else [])]  # fmt: skip
    objects = [info for name, info in calls if name == "all_gather_object"]
    shared = any(name == "all_gather" and info == "shared" for name, info in calls)
    sent = [
        info
        for name, info in calls
        if name in ("all_gather", "all_gather_into_tensor") and isinstance(info, int)
    ]
    return {"got": as_values(got), "calls": [name for name, _ in calls], "dtypes": dtypes,
            "objects": objects, "shared": shared, "sent": sent, "floats": floats}  # fmt: skip


def judge_gather(records: list[Record]) -> str | None:
    n = len(records)
    want = [uneven_input(r).tolist() for r in range(n)]
    for rank, rec in enumerate(records):
        data = [kind for kind in rec["objects"] if kind != "length"]
        if data:  # the lengths, one number each, may go that way; the values may not
            return (f"all_gather_object sent a {data[0]}: it pickles on the CPU (and copies "
                    "through the GPU on nccl) - gather the tensors with dist.all_gather "
                    "(all_gather_object: for the lengths only, one number each)")  # fmt: skip
        if rec.get("shared"):
            return (f"on rank {rank}, the output list of dist.all_gather held one tensor "
                    "several times ([t] * world_size is world_size names for one tensor): "
                    "every rank's data lands in it, the last one written wins - one buffer per "
                    "rank: [torch.empty_like(padded) for _ in range(world_size)]")  # fmt: skip
        got = rec["got"]
        if not isinstance(got, list) or len(got) != n:
            return f"rank {rank} returned {got!r}: expected a list of {n} tensors, one per rank"
        if got != want and sorted(map(repr, got)) == sorted(map(repr, want)):  # helper 147
            return (f"on rank {rank}, every rank's tensor came back, in another order: result[i] "
                    "must be rank i's tensor on every rank - keep all_gather's order, which is "
                    "the ranks' (not this rank's own first)")  # fmt: skip
        for src, (g, w) in enumerate(zip(got, want, strict=True)):
            if mistake := _judge_tensor(f"on rank {rank}, rank {src}'s tensor", g, w, rec, src):
                return mistake
        longest = max(len(w) for w in want)
        # one more than the longest: a slot that carries the length with the values is fine
        if over := [k for k in rec.get("sent", []) if k > longest + 1]:
            return (f"rank {rank} sent {over[0]} values through dist.all_gather, the longest "
                    f"tensor has {longest}: pad to the longest length gathered, not to a "
                    "fixed size - it sends padding for nothing, and a longer tensor one day "
                    "no longer fits")  # fmt: skip
        gathered = {"all_gather", "all_gather_into_tensor"} & set(rec["calls"])
        if not gathered or "broadcast" in rec["calls"]:
            return (f"rank {rank} gathered with {', '.join(sorted(set(rec['calls'])))}: one "
                    "dist.all_gather of the padded tensors does it in one collective (not "
                    "one broadcast per rank)")  # fmt: skip
    return _judge_floats(records)


def _judge_tensor(where: str, g: Any, w: list[int], rec: Record, src: int) -> str | None:
    """One rank's tensor as another rank got it back (``g``) against what it sent (``w``)."""
    if g == w and rec["dtypes"][src] not in ("int64", None):
        return (f"{where} came back as "
                f"{rec['dtypes'][src]}; it was sent as int64: make the padding buffer "
                "with the input's dtype (torch.zeros(longest, dtype=tensor.dtype)) - "
                "else predictions and labels come back as floats")  # fmt: skip
    if g == w:
        return None
    if isinstance(g, list) and len(g) > len(w) and g[: len(w)] == w:
        return (
            f"{where} still has its padding ({len(g)} "
            f"values, not {len(w)}): trim each to the length its rank sent"
        )
    lost = [v for v in dict.fromkeys(w) if isinstance(g, list) and len(g) < len(w)
            and g == [x for x in w if x != v]]  # fmt: skip
    if lost:
        return (f"{where} lost its {lost[0]}s: trimmed by "
                f"value, like the padding - trim by the lengths gathered ({lost[0]} can "
                "be a real label)")  # fmt: skip
    cut = isinstance(g, list) and len(g) < len(w) and g == w[: len(g)]
    if cut and max(rec.get("sent") or [len(w)]) < len(w):  # helper 172: F.pad cut
        return (f"{where} lost its end ({len(g)} of "
                f"{len(w)} values): pad to the longest length gathered (the max of the "
                "lengths; F.pad with a negative amount cuts), then trim each to its "
                "own length")  # fmt: skip
    if isinstance(g, list) and len(g) != len(w):
        return (f"{where} has {len(g)} values, not {len(w)}: "
                "gather every rank's length first, then trim each to its own")  # fmt: skip
    return f"{where} is {g}, expected {w}"


def _judge_floats(records: list[Record]) -> str | None:
    """The second gather, of floats: a padding buffer of a fixed integer dtype truncates."""
    floats = [(uneven_input(r) + 0.25).tolist() for r in range(len(records))]
    for rank, rec in enumerate(records):
        if rec.get("floats") != floats:  # helper 158: a padding buffer of int64 always
            return (f"with float inputs (each +0.25) rank {rank} got {rec.get('floats')}: make "
                    "the padding buffer with the input's dtype (torch.zeros(longest, "
                    "dtype=tensor.dtype)), not a fixed one")  # fmt: skip
    return None


_UNEVEN_ERRORS = (
    ("The expanded size of the tensor", "a rank's tensor is longer than its padding buffer: "
     "pad to the longest length gathered (the max of the lengths), not to a size of your own "
     "(a mean, a share)"),  # helper 168: a pad to ceil(total / world)
    ("allgather: invalid tensor size", "the output list's tensors must have the shape every "
     "rank sends, the padded one: [torch.empty_like(padded) for _ in range(world_size)] (not "
     "buffers of this rank's own length)"),
    ("Received data size", "the ranks sent tensors of different lengths to one all_gather: "
     "every rank must send the same shape - gather the lengths, pad to the longest, trim"),
    ("EnforceNotMet", "the ranks sent tensors of different lengths to one all_gather: "
     "every rank must send the same shape - gather the lengths, pad to the longest, trim"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="01_gather_uneven", lesson="01", run=run_gather, judge=judge_gather,
        title="all_gather of tensors whose lengths differ by rank",
        teaches='lesson 01, "all_gather": every rank must send the same shape',
        hidden=((ranks_written_as(2) + r"|range\(\s*2\s*\)", "the number of ranks is "  # h. 168
                 "written as 2, this check's: on 4 ranks the lists are too short - "
                 "range(dist.get_world_size())"),),
        errors=_UNEVEN_ERRORS,
        proves=(
            "every rank got every rank's tensor back through one all_gather, at its own length "
            "and dtype"
        ),
    ),
]  # fmt: skip
