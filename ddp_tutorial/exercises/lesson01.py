"""Lesson 01's exercises: collectives built by hand.

``01_ring_average``: the mean over ranks from point-to-point sends around a ring (3 ranks;
there both other ranks are neighbours, so a ring is told from a star or an exchange with
everyone by its links: each rank sends to one of them and receives from the other).
(``01_gather_uneven`` is in lesson01_gather.) ``run_ring`` records, on its rank, what the
learner's function returned and which calls it made; ``judge_ring`` names the first mistake.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_tutorial.exercises.core import Context, Exercise, Record, divided_by
from ddp_tutorial.exercises.spies import is_async, reduce_op, spying

COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_gather_object",
               "all_reduce_coalesced", "scatter", "gather")  # fmt: skip
POINT_TO_POINT = ("send", "isend", "recv", "irecv")


def _check_peer(name: str, peer: Any, tensor: Any, sending: set[int]) -> None:
    """Refuse what torch would only hang on: a peer that is no rank (it waits for a key no
    rank writes), a receive into a tensor an isend is still sending."""
    world = dist.get_world_size()
    if isinstance(peer, int) and not 0 <= peer < world:
        side = "dst" if name in ("send", "isend") else "src"
        raise ValueError(f"{side}={peer} is not a rank (0..{world - 1}): the ring's neighbours "
                         "are (rank + 1) % world_size and (rank - 1) % world_size")  # fmt: skip
    if (
        name in ("recv", "irecv")
        and isinstance(tensor, torch.Tensor)
        and (tensor.data_ptr() in sending)
    ):
        raise ValueError("received into the tensor an isend is still sending (not waited on "
                         "yet): receive into a buffer of its own (torch.empty_like)")  # fmt: skip


def _object_kind(obj: Any) -> str:
    """What an all_gather_object sent: "length" for one number (an int, or a sequence of one
    int: a length, a shape), else its type's name (a Tensor, a list of values: the data)."""
    one = obj[0] if isinstance(obj, list | tuple) and len(obj) == 1 else obj
    if isinstance(one, int) or (isinstance(one, torch.Tensor) and one.numel() == 1):
        return "length"
    return type(obj).__name__


def _shared(outputs: Any, sent: Any = None) -> str | int | None:
    """An all_gather output list holding one tensor twice ([t] * n) is marked "shared"; else
    the number of values per row this rank sent (a padding to a fixed size shows against the
    longest)."""
    if not isinstance(outputs, list | tuple):
        return None
    ptrs = [t.data_ptr() for t in outputs if isinstance(t, torch.Tensor)]
    if len(set(ptrs)) < len(ptrs):
        return "shared"
    if not isinstance(sent, torch.Tensor):
        return None  # per row: values and a mask in a [2, longest] block are one padding (h147)
    return sent.shape[-1] if sent.dim() else 1


class _HeldReceive:
    """An irecv's Work whose data reaches the learner's tensor at its ``wait()``, not before."""

    def __init__(self, work: Any, held: torch.Tensor, into: torch.Tensor) -> None:
        self._work, self._held, self._into = work, held, into

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self._work.wait(*args, **kwargs)
        self._deliver()
        return done

    def is_completed(self) -> bool:  # polled until True, then read: right too
        done = bool(self._work.is_completed())
        if done:
            self._deliver()
        return done

    def _deliver(self) -> None:
        if self._held is not None:
            self._into.copy_(self._held)
            self._held = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def held_receives(module: ModuleType) -> Iterator[None]:
    """A ``dist.irecv`` from the learner's code receives into a buffer of its own, and the
    learner's tensor holds NaN until the receive's ``wait()`` copies the data in: a read
    before the wait is then always wrong, and named (on an idle host the data often arrives
    in time, and the race passes by luck). Entered before :func:`watched`, which spies on it."""
    real = dist.irecv

    def irecv(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # frame 2: who called watched's spy (batch_isend_irecv waits for its own)
        if (not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point()
                or sys._getframe(2).f_globals.get("__name__") == c10d.__name__):  # fmt: skip
            return real(tensor, *args, **kwargs)
        held = torch.empty_like(tensor)
        work = real(held, *args, **kwargs)
        tensor.fill_(math.nan)
        return work if work is None else _HeldReceive(work, held, tensor)

    bound = [attr for attr, value in vars(module).items() if value is real]
    places = [(dist, "irecv"), (c10d, "irecv"), *((module, attr) for attr in bound)]
    for place, attr in places:
        setattr(place, attr, irecv)
    try:
        yield
    finally:
        for place, attr in places:
            setattr(place, attr, real)


@contextmanager
def watched(calls: list[tuple[str, Any]], module: ModuleType, dropped: list[str] | None = None,
            asyncs: list[str] | None = None, touched: list[str] | None = None,
            unwaited: list[int] | None = None) -> Iterator[None]:  # fmt: skip
    """Record each collective and send/recv that the learner's ``module`` makes: (name, peer)
    for a send or a recv, (name, op) for an all_reduce ("SUM", "AVG", ...), else (name, None);
    ``asyncs``: the name of each collective called with async_op=True; ``touched``: of each
    isend/irecv whose tensor was changed in place before its wait; ``unwaited``: a mark for
    each async all_reduce, taken off at its first wait."""
    sending: set[int] = set()  # the tensors of isends not waited on yet

    def note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        info = {"all_reduce": lambda: reduce_op(args, kwargs),  # the op, or what was gathered
                "all_gather_object": lambda: _object_kind(args[1] if len(args) > 1
                                                          else kwargs.get("obj")),
                "all_gather": lambda: _shared(args[0] if args else kwargs.get("tensor_list"),
                                              args[1] if len(args) > 1 else kwargs.get("tensor")),
                "all_gather_into_tensor": lambda: _shared([], args[1] if len(args) > 1
                                                          else kwargs.get("input_tensor")),
                }.get(name, lambda: None)()  # fmt: skip
        calls.append((name, peer if name in POINT_TO_POINT else info))
        if name == "all_reduce" and is_async(args, kwargs):
            if asyncs is not None:
                asyncs.append(name)
            if unwaited is not None:
                unwaited.append(mark := len(calls))
                return lambda: mark in unwaited and unwaited.remove(mark)  # type: ignore[func-returns-value]
        if name not in POINT_TO_POINT:
            return None
        tensor = args[0] if args else kwargs.get("tensor")
        _check_peer(name, peer, tensor, sending)
        # frame 2: who called the spy; batch_isend_irecv waits for its own isends
        if name not in ("isend", "irecv") or sys._getframe(2).f_globals.get(
                "__name__") == c10d.__name__:  # fmt: skip
            return None
        if name == "irecv":
            return lambda: None  # a NotedWork all the same: one dropped unwaited is named
        sending.add(ptr := tensor.data_ptr())
        return lambda: sending.discard(ptr)

    with (spying(COLLECTIVES, note, module),
          spying(POINT_TO_POINT, note, module, also=(c10d,), dropped=dropped,
                 touched=touched)):  # fmt: skip
        yield


def as_values(x: Any) -> Any:
    """What a rank returned, as JSON can carry it to the judge: tensors as lists."""
    if isinstance(x, torch.Tensor):
        return x.detach().tolist()
    if isinstance(x, list | tuple):
        return [as_values(v) for v in x]
    return repr(x)


DROPPED = (
    "dist.{0} returned a Work that was let go of before its wait(): on gloo the "
    "transfer may then never happen, and the peer waits for ever - keep what isend and "
    "irecv return, and call .wait() on it"
)


def ring_input(rank: int) -> torch.Tensor:
    """Four values: a ring that chunks the tensor by the world size (3 ranks) meets a length
    that does not divide (helper 158: three values hid a chunk() that drops a piece)."""
    return torch.tensor([rank + 1.0, 10.0 * (rank + 1), -(rank**2), rank - 0.5])


def run_ring(module: ModuleType, ctx: Context) -> Record:
    calls: list[tuple[str, Any]] = []
    dropped: list[str] = []  # isend/irecv Works let go of unwaited
    touched: list[str] = []  # ... whose tensor was changed before the wait
    mine = ring_input(ctx.rank)
    try:
        with held_receives(module), watched(calls, module, dropped, touched=touched):
            got = module.ring_average(mine.clone())
    except Exception as exc:
        if dropped:  # named: the hang it causes would say only "a peer that never came"
            # with the hang's traceback: "at" then names the learner's line that waited
            hung = DROPPED.format(dropped[0]) + "; this rank then waited for ever"
            raise RuntimeError(hung).with_traceback(exc.__traceback__) from exc
        raise
    return {"got": as_values(got), "calls": calls, "dropped": dropped, "touched": touched}


def _ring_off(rank: int, got: torch.Tensor, inputs: list[torch.Tensor]) -> str | None:
    """The usual wrong rings, told by their numbers: a divisor of world_size - 1, one step
    too many (the rank's own tensor comes back round), running totals passed on."""
    n, total = len(inputs), torch.stack(inputs).sum(0)
    if n > 2 and torch.allclose(got, total / (n - 1)):
        return (f"rank {rank} returned the sum divided by world_size - 1: the mean divides by "
                "world_size, the number of tensors added (every rank's own included); "
                "world_size - 1 is the number of steps")  # fmt: skip
    if torch.allclose(got, (total + inputs[rank]) / n):
        return (f"rank {rank} added its own tensor twice: after world_size - 1 steps every other "
                "rank's tensor has arrived, and one more step brings your own back round the "
                "ring - loop range(world_size - 1)")  # fmt: skip
    running = list(inputs)
    for _ in range(n - 1):  # each rank adds the running total of the rank before it
        running = [running[r] + running[r - 1] for r in range(n)]
    if n > 2 and torch.allclose(got, running[rank] / n):
        return (f"rank {rank} passed on its running total: the next rank then adds tensors it "
                "has already counted - pass on the tensor that just came in (what you "
                "received), and keep the sum apart")  # fmt: skip
    return None


def _not_a_ring(rank: int, calls: list[tuple[str, Any]]) -> str | None:
    """A ring's links: one rank sent to, another received from (a star's centre receives from
    everyone; an exchange with everyone sends to everyone)."""
    to = sorted({p for c, p in calls if c in ("send", "isend") and p is not None})
    came = sorted({p for c, p in calls if c in ("recv", "irecv") and p is not None})
    if len(to) > 1 or len(came) > 1 or (to and to == came):
        return (f"rank {rank} sent to rank(s) {to} and received from {came}: in a ring each "
                "rank sends to one neighbour, (rank + 1) % world_size, and receives from the "
                "other, (rank - 1) % world_size, passing on what it received - every link "
                "carries the same load (a rank that gathers from everyone carries them "
                "all)")  # fmt: skip
    return None


def judge_ring(records: list[Record]) -> str | None:
    n = len(records)
    inputs = [ring_input(r) for r in range(n)]
    mean, total = torch.stack(inputs).mean(0), torch.stack(inputs).sum(0)
    for rank, rec in enumerate(records):
        used = sorted({name for name, _ in rec["calls"] if name in COLLECTIVES})
        if used:
            return (
                f"rank {rank} called dist.{used[0]}: build the average from dist.send/recv "
                "(or isend/irecv) only - each rank adds what it receives and passes it on"
            )
        neighbours = ((rank + 1) % n, (rank - 1) % n)
        far = [p for c, p in rec["calls"] if c in POINT_TO_POINT and p not in (None, *neighbours)]
        if far:
            return (f"rank {rank} talked to rank {far[0]}: in a ring, rank r sends only to "
                    "(r + 1) % world_size and receives only from (r - 1) % world_size")  # fmt: skip
        if mistake := _not_a_ring(rank, rec["calls"]):
            return mistake
        if rec.get("touched"):  # a race: right or wrong by luck, so named before the numbers
            return (f"rank {rank} changed the tensor of an {rec['touched'][0]} before its .wait() "
                    "(a write, or a receive into that same tensor: `send_buf = recv_buf` makes "
                    "them one): the neighbour may get the old values or the new - wait on it "
                    "before reusing its buffer, and pass on a copy (recv_buf.clone())")  # fmt: skip
        got = rec["got"]
        if isinstance(got, list) and any(isinstance(v, float) and math.isnan(v) for v in got):
            return (
                f"rank {rank} read the tensor of a dist.irecv before its .wait(): until the "
                "wait returns, the data may not have arrived (this check keeps it NaN until "
                "then; on an idle machine the race often passes by luck) - wait on the "
                "receive before using its buffer, or receive with the blocking dist.recv"
            )
        if not isinstance(got, list) or len(got) != len(mean):
            return (
                f"rank {rank}'s ring_average returned {got!r}, not a tensor of {len(mean)} numbers"
            )
        got_t = torch.tensor(got, dtype=torch.float32)
        if torch.allclose(got_t, inputs[rank]):
            return f"rank {rank} returned its own tensor: nothing from the other ranks was added"
        if rec.get("dropped"):
            return f"rank {rank}: " + DROPPED.format(rec["dropped"][0])
        if torch.allclose(got_t, torch.floor(mean)) and not torch.allclose(got_t, mean):
            return (f"rank {rank} returned {got}, the mean rounded down: `//` is floor "
                    "division - divide with `/`")  # fmt: skip
        if torch.allclose(got_t, total):
            return f"rank {rank} returned the sum {got}: divide by the world size for the mean"
        if mistake := _ring_off(rank, got_t, inputs):
            return mistake
        if not torch.allclose(got_t, mean):
            return (
                f"rank {rank} returned {got}, expected the mean {mean.tolist()}: after "
                "world_size - 1 steps every rank must hold every rank's contribution once - "
                "pass on what you received (not your own tensor again), and divide once, "
                "after the last step"
            )
    return None


EXERCISES = [
    Exercise(
        name="01_ring_average", lesson="01", nproc=3, run=run_ring, judge=judge_ring,
        title="the mean over ranks, from point-to-point sends around a ring",
        teaches='lesson 01, "send and recv"',
        hidden=(  # helper 168: passed on the check's 3 ranks, or on gloo only
            (r"\bfor\s+\w+\s+in\s+range\(\s*2\s*\)\s*:|" + divided_by(3),
             "the ring's 3 ranks are written in (range(2) steps, a division by 3): on 2 or 8 "
             "ranks the mean comes out wrong - world - 1 steps, divide by world "
             "(dist.get_world_size())"),
            (r"\bi?recv\(\s*[\w.\[\]]+\s*\)", "a recv without src= takes a message from "
             "any rank: gloo allows it, nccl has no receive from any source - name the left "
             "neighbour: dist.recv(buf, src=(rank - 1) % world)"),
        ),
        when_hung=(  # helper 147: both read as "every rank must call the same collectives"
            (r"(?m)^( +)dist\.recv\([^\n]*\n\1dist\.send\(", "every rank receives first, "
             "and nobody sends: a blocking recv waits for a send that never starts - let even "
             "ranks send first and odd ranks receive first, or dist.isend first"),
            (r"(?s)(?=.*dst=\(rank ([+-]) 1\))(?=.*src=\(rank \1 1\))", "each rank receives "
             "from the rank it sends to: around a ring, send to (rank + 1) % world and "
             "receive from (rank - 1) % world"),
        ),
        proves=(
            "only send/recv, only to the ring's neighbours; every rank returned the mean of the 3"
            " ranks' tensors"
        ),
    ),
]  # fmt: skip
