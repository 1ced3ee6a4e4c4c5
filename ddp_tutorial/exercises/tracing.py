"""Lesson 12's instruments: every ``dist.all_reduce`` the learner's DDP calls, and what on.

The check replaces ``dist.all_reduce`` while the learner's code runs: each call is recorded
(the step, how many gradients backward had accumulated, blocking or not, how many numbers,
and which tensor: a parameter's gradient, the parameter itself, or a buffer of its own), and
each ``wait()`` on what an asynchronous call returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from ddp_tutorial.exercises.spies import is_async, reduce_op, spying

# the calls that can copy rank 0's weights (send/recv too: helper 171's rank 0 sending to each)
WEIGHT_COPIES = ("broadcast_object_list", "all_gather", "all_gather_into_tensor",
                 "all_gather_object", "scatter", "send", "isend", "recv", "irecv")  # fmt: skip


class Trace:
    """What the learner's code did, in order, step by step: all_reduce calls, waits, gradients."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.step = -1  # -1: construction; then 0 ... STEPS - 1
        self.grads = 0  # gradients accumulated so far in this step's backward
        self.events: list[dict[str, Any]] = []
        self.unwaited: set[int] = set()
        self.touched: list[str] = []  # an async call's tensor changed in place before its wait
        self.same_front = False  # two gradients of one bucket began with the same numbers
        self.broadcasts_waited: list[bool] = []  # each async broadcast: waited on yet?
        self.copies = 0  # broadcasts, gathers, sends: the calls that copy rank 0's weights
        self.moved_weights = False  # a parameter changed between a step's start and its step()

    def add(self, kind: str, **info: Any) -> None:
        self.events.append({"kind": kind, "step": self.step, "grads": self.grads, **info})

    def target(self, tensor: torch.Tensor) -> str:
        """What an all_reduce was given: ``grad i`` or ``param i`` (the model's i-th parameter,
        by its memory), ``param values i`` (a tensor of its own that begins with that
        parameter's numbers: a bucket flattened from the weights, not from their gradients),
        else ``other`` (a bucket's flat buffer, a copy)."""
        ptr = tensor.data_ptr()
        for i, p in enumerate(self.params):
            if ptr == p.data_ptr():
                return f"param {i}"
            if p.grad is not None and ptr == p.grad.data_ptr():
                return f"grad {i}"
        flat = tensor.detach().reshape(-1)
        for i, p in enumerate(self.params):
            k = min(flat.numel(), p.numel())
            if k and torch.equal(flat[:k], p.detach().reshape(-1)[:k].to(flat.dtype)):
                return f"param values {i}"
        return "other"


@contextmanager
def traced_all_reduce(trace: Trace, module: ModuleType) -> Iterator[None]:
    """Each ``dist.all_reduce`` the learner's ``module`` makes, recorded while the block runs
    (blocking or not, how many numbers, on which tensor, with which op), and each wait on what
    it returned; and each ``dist.broadcast(..., async_op=True)`` that nothing waited on."""

    def note(_: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
        tensor, ident = args[0] if args else kwargs["tensor"], len(trace.events)
        if tensor is None:  # named here: the spy's own tensor.numel() would say less
            # (a closure over the loop's `p` reads the last parameter's .grad: lesson 12's MLP
            # defines its layers out of their order, so that one's gradient is not the first)
            raise TypeError(
                "dist.all_reduce(None): the gradient is not there yet - either the hook reads "
                "a parameter other than the one it is given (the loop's variable `p` holds "
                "the last parameter by the time backward runs: use the hook's argument, def "
                "hook(param): ... param.grad), or it runs before p.grad is set (a tensor's "
                "register_hook, a module's backward hook: they are given gradients, not the "
                "parameter with its .grad; register_post_accumulate_grad_hook's runs once "
                "p.grad is set)"
            )
        async_op = is_async(args, kwargs)
        trace.add("all_reduce", numel=tensor.numel(), async_op=async_op,
                  target=trace.target(tensor), op=reduce_op(args, kwargs))  # fmt: skip
        if not async_op:
            return None
        trace.unwaited.add(ident)

        def waited() -> None:
            trace.add("wait", id=ident)
            trace.unwaited.discard(ident)

        return waited

    def note_broadcast(_: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        trace.copies += 1
        if not is_async(args, kwargs):
            return None
        i = len(trace.broadcasts_waited)
        trace.broadcasts_waited.append(False)
        return lambda: trace.broadcasts_waited.__setitem__(i, True)

    def note_reduce(*_: Any) -> None:  # the sum on one rank only: named, not "no hook"
        trace.add("reduce")

    with (
        spying(("all_reduce",), note, module, touched=trace.touched),
        spying(("broadcast",), note_broadcast, module),
        spying(("reduce",), note_reduce, module),
        spying(WEIGHT_COPIES, lambda *_: setattr(trace, "copies", trace.copies + 1), module),
    ):
        yield


def coverage(targets: list[str], n: int, hooks: int = 0) -> str | None:
    """One backward's all_reduce targets, when each was a parameter's own gradient: which of
    the ``n`` gradients none reduced, or which one was reduced more than once (None: each once,
    or the learner reduced tensors of its own, which the weights judge instead)."""
    if not targets or any(not t.startswith("grad ") for t in targets):
        return None
    missing = [i for i in range(n) if f"grad {i}" not in targets]
    if missing:
        return (f"the gradients of parameters {missing} (of 0-{n - 1}) were never "
                "all_reduced: a hook on every parameter - loop over model.parameters(), biases "
                "included")  # fmt: skip
    again = max(set(targets), key=targets.count)
    if targets.count(again) > 1 and hooks == 1:  # helper 167: one hook, two calls in it
        return (f"{again} was all_reduced {targets.count(again)} times in one backward, by the "
                "one hook it has: the hook calls all_reduce more than once - once per gradient, "
                "then divide by the world size")  # fmt: skip
    if targets.count(again) > 1:
        return (f"{again} was all_reduced {targets.count(again)} times in one backward: its "
                "hook is registered more than once (model.modules() yields a parameter once for "
                "every module that holds it, the model itself included) - loop over "
                "model.parameters(), one hook each")  # fmt: skip
    return None
