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
import torch.distributed as dist


class Trace:
    """What the learner's code did, in order, step by step: all_reduce calls, waits, gradients."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.step = -1  # -1: construction; then 0 ... STEPS - 1
        self.grads = 0  # gradients accumulated so far in this step's backward
        self.events: list[dict[str, Any]] = []
        self.unwaited: set[int] = set()

    def add(self, kind: str, **info: Any) -> None:
        self.events.append({"kind": kind, "step": self.step, "grads": self.grads, **info})

    def target(self, tensor: torch.Tensor) -> str:
        """What an all_reduce was given: ``grad i`` or ``param i`` (the model's i-th parameter,
        by its memory), else ``other`` (a bucket's flat buffer, a copy)."""
        ptr = tensor.data_ptr()
        for i, p in enumerate(self.params):
            if ptr == p.data_ptr():
                return f"param {i}"
            if p.grad is not None and ptr == p.grad.data_ptr():
                return f"grad {i}"
        return "other"


class TracedWork:
    """What ``dist.all_reduce(..., async_op=True)`` returned, with its ``wait()`` recorded."""

    def __init__(self, work: Any, trace: Trace, ident: int) -> None:
        self._work, self._trace, self._id = work, trace, ident

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._trace.add("wait", id=self._id)
        self._trace.unwaited.discard(self._id)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def traced_all_reduce(trace: Trace, module: ModuleType | None = None) -> Iterator[None]:
    """``dist.all_reduce`` records each call (blocking or not, how many numbers) while it runs;
    also under the names ``module`` bound it to (``from torch.distributed import all_reduce``
    copies the function into the learner's file before the check can replace it)."""
    real: Callable[..., Any] = dist.all_reduce
    bound = [n for n, v in vars(module).items() if v is real] if module is not None else []

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        ident = len(trace.events)
        trace.add(
            "all_reduce", numel=tensor.numel(), async_op=async_op, target=trace.target(tensor)
        )
        work = real(tensor, *args, **kwargs)
        if work is None:
            return None
        trace.unwaited.add(ident)
        return TracedWork(work, trace, ident)

    dist.all_reduce = spy
    for name in bound:
        setattr(module, name, spy)
    try:
        yield
    finally:
        dist.all_reduce = real
        for name in bound:
            setattr(module, name, real)


def coverage(targets: list[str], n: int) -> str | None:
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
    if targets.count(again) > 1:
        return (f"{again} was all_reduced {targets.count(again)} times in one backward: its "
                "hook is registered more than once (model.modules() yields a parameter once for "
                "every module that holds it, the model itself included) - loop over "
                "model.parameters(), one hook each")  # fmt: skip
    return None
