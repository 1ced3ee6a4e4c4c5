"""One spy for every check: ``torch.distributed`` functions replaced while the learner's code runs.

A check must see what the learner called (which collective, on what, blocking or not) and
whether what an asynchronous call returned was waited on. The spy also replaces the names the
learner's file bound: ``from torch.distributed import all_reduce`` copies the function into the
file before the check runs, and a spy on ``dist`` alone would never see those calls (a ring
built from ``all_reduce`` passed as sends, an async buffer average never waited passed as
right). File operations are spied on in ``os``: :func:`paths_through_os` makes ``pathlib``'s
reach it on every Python.
"""

from __future__ import annotations

import builtins
import io
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

# (name, args, kwargs) of one call, before it runs -> what to do on each wait() of the Work it
# returns (None: hand back the Work itself); it may raise to refuse the call
OnCall = Callable[[str, tuple[Any, ...], dict[str, Any]], "Callable[[], None] | None"]


class NotedWork:
    """What a collective with ``async_op=True`` returned, each ``wait()`` on it noted
    (``on_wait``): a check tells a Work that was waited on from one that was not, and
    (``on_drop``) one the learner let go of before any wait: gloo may then never send.
    ``on_touch``: called at the first wait if ``tensor`` was changed in place since the call
    (its version counter moved): the background reduction and the learner's change raced."""

    def __init__(self, work: Any, on_wait: Callable[[], None],
                 on_drop: Callable[[], None] | None = None, tensor: torch.Tensor | None = None,
                 on_touch: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._work, self._on_wait, self._on_drop, self._waited = work, on_wait, on_drop, False
        self._tensor, self._on_touch = tensor, on_touch
        self._version = None if tensor is None else tensor._version

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.note_wait()
        return self._work.wait(*args, **kwargs)

    def note_wait(self) -> None:
        """A wait on this Work, or on its future (``get_future()``: lesson 11's hooks)."""
        self.settle()
        self._waited = True
        self._on_wait()

    def settle(self) -> None:
        """The result is there (a wait, or a ``then`` callback about to run): a change in
        place before now raced the reduction; one after it (the callback's own) did not."""
        touched = self._tensor is not None and self._tensor._version != self._version
        if touched and not self._waited and self._on_touch is not None:
            self._on_touch()
        self._tensor = None

    def is_completed(self) -> bool:
        """Polled until True (``while not work.is_completed()``): the result is there, as
        after a ``wait()`` (gloo on a CPU; a GPU's stream is then past the kernel too)."""
        done = self._work.is_completed()
        if done:
            self.note_wait()
        return done

    def get_future(self) -> torch.futures.Future:
        future = self._work.get_future()
        _FUTURES[id(future)] = (future, [self])
        return future

    def __del__(self) -> None:
        if not self._waited and self._on_drop is not None:
            self._on_drop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# A future a NotedWork handed out (or one made from it: collect_all, then) -> the Works that a
# wait on it waits for. torch's futures are C++ objects: their wait() is patched while a spy
# is on, and torch.futures.wait_all / collect_all are (they call torch._C directly).
_FUTURES: dict[int, tuple[Any, list[NotedWork]]] = {}
_PATCHED: list[int] = [0]  # nested spies patch the futures once


def _works(futures: Any) -> list[NotedWork]:
    return [w for f in futures for w in _FUTURES.get(id(f), (None, []))[1]]


@contextmanager
def _futures_noted() -> Iterator[None]:
    """While a spy is on: a wait on a future of a NotedWork (or its ``done()`` found True) is
    a wait on the Work."""
    if _PATCHED[0]:
        yield
        return
    cls, futures = torch._C.Future, torch.futures
    reals = {"wait": cls.wait, "done": cls.done, "then": cls.then, "wait_all": futures.wait_all,
             "collect_all": futures.collect_all}  # fmt: skip

    def wait(future: Any) -> Any:
        for work in _works([future]):
            work.note_wait()
        return reals["wait"](future)

    def done(future: Any) -> bool:  # polled until True: completed, as after a wait
        finished = reals["done"](future)
        for work in _works([future]) if finished else []:
            work.note_wait()
        return finished

    def derived(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(first: Any, *args: Any, **kwargs: Any) -> Any:
            made = real(first, *args, **kwargs)
            if works := _works(first if isinstance(first, list | tuple) else [first]):
                _FUTURES[id(made)] = (made, works)
            return made

        return call

    def then(future: Any, callback: Callable[[Any], Any]) -> Any:
        works = _works([future])

        def after(done_future: Any) -> Any:  # runs once the result is there
            for work in works:
                work.settle()
            return callback(done_future)

        made = reals["then"](future, after if works else callback)
        _FUTURES.update({id(made): (made, works)} if works else {})
        return made

    def wait_all(futures_: list[Any]) -> list[Any]:
        for work in _works(futures_):
            work.note_wait()
        return reals["wait_all"](futures_)

    patches = [(cls, "wait", wait), (cls, "done", done), (cls, "then", then),
               (futures, "collect_all", derived(reals["collect_all"])),
               (futures, "wait_all", wait_all)]  # fmt: skip
    _PATCHED[0] = 1
    for place, attr, value in patches:
        setattr(place, attr, value)
    try:
        yield
    finally:
        for place, attr, _ in patches:
            setattr(place, attr, reals[attr])
        _PATCHED[0] = 0
        _FUTURES.clear()


def watchable(tensor: Any) -> bool:
    """Whether a change to ``tensor`` shows in its own version counter alone: a tensor that
    spans all of its storage (a view of all of it too: ``torch.cat(...).view(-1)``, helper
    156). Slices of one buffer share one counter (a write to another slice would look like a
    write to this one), and an inference tensor keeps none."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_inference():
        return False
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def is_async(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``async_op`` of a call to ``all_reduce(tensor, op, group, async_op)``."""
    return bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))


def reduce_op(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The op of a call to ``all_reduce(tensor, op, ...)``, by name: "SUM", "MAX", "AVG"."""
    return str(kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)).rsplit(".")[-1]


def call_site(module: ModuleType | None) -> str:
    """`` (your file, line N: code)`` of the innermost frame in ``module``'s file ("" if none):
    a Work let go of unwaited is found when it is collected, far from the line that made it."""
    path = getattr(module, "__file__", None)
    path = os.path.realpath(path) if path else None
    frame = sys._getframe(1)
    while frame is not None and path is not None:
        if os.path.realpath(frame.f_code.co_filename) == path:
            code = linecache.getline(path, frame.f_lineno).strip()
            return f" (your file, line {frame.f_lineno}: {code})"
        frame = frame.f_back
    return ""


@contextmanager
def spying(names: Sequence[str], on_call: OnCall, module: ModuleType | None = None,
           also: Sequence[ModuleType] = (), source: ModuleType = dist,
           dropped: list[str] | None = None,
           touched: list[str] | None = None) -> Iterator[None]:  # fmt: skip
    """Inside the block, ``dist.<name>`` (``source``'s) for each of ``names`` calls ``on_call``
    first, then the real function; a Work it returns comes back as a ``NotedWork`` when
    ``on_call`` gave a function to call on ``wait()``. Replaced in ``source``, in each of
    ``also`` (where torch compares a function with its own: ``P2POp`` checks its op against
    ``distributed_c10d``'s), and under every name ``module`` (the learner's file) bound to one.
    ``dropped``: the name of each call whose NotedWork was let go of before any wait;
    ``touched``: of each whose tensor was changed in place between the call and its wait."""
    reals = {name: getattr(source, name) for name in names}

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            on_wait = on_call(name, args, kwargs)
            work = real(*args, **kwargs)
            if work is None or on_wait is None:
                return work
            called = name + call_site(module)  # while the learner's frame is on the stack
            on_drop = None if dropped is None else (lambda: dropped.append(called))
            tensor = args[0] if args else kwargs.get("tensor")
            # AVG divides in the background, in place, before any wait: not the learner's change
            avg = any(str(a).endswith("AVG") for a in (*args[1:], kwargs.get("op")))  # reduce too
            if touched is None or not watchable(tensor) or avg:
                return NotedWork(work, on_wait, on_drop)
            return NotedWork(work, on_wait, on_drop, tensor, lambda: touched.append(name))

        return call

    spies = {name: spy(name, real) for name, real in reals.items()}
    bound = {attr: name for attr, value in vars(module).items() for name, real in reals.items()
             if value is real} if module is not None else {}  # fmt: skip
    places = [(m, name, name) for m in (source, *also) for name in names]
    places += [(module, attr, name) for attr, name in bound.items()]
    for place, attr, name in places:
        setattr(place, attr, spies[name])
    try:
        with _futures_noted():
            yield
    finally:
        for place, attr, name in places:
            setattr(place, attr, reals[name])


def _unlink(path: Path, missing_ok: bool = False) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


@contextmanager
def paths_through_os() -> Iterator[None]:
    """``Path.replace``, ``.rename`` and ``.unlink`` call ``os.replace``, ``os.rename`` and
    ``os.unlink`` as they are when called, as on Python 3.11+: Python 3.10's pathlib calls
    the functions it bound at import, so a spy on ``os`` missed ``tmp.replace(path)`` (a
    right answer read as "no rename") and ``path.unlink()`` (a wrong one passed)."""
    with (
        mock.patch.object(Path, "replace", lambda p, t: (os.replace(p, t), type(p)(t))[1]),
        mock.patch.object(Path, "rename", lambda p, t: (os.rename(p, t), type(p)(t))[1]),
        mock.patch.object(Path, "unlink", _unlink),
    ):
        yield


@contextmanager
def spied_os(replaced: list[tuple[str, str, bool]], fsyncs: list[tuple[int, int]],
              hold: Callable[[], None] | None = None,
              folder: Path | None = None) -> Iterator[None]:  # fmt: skip
    """Renames (source, target, whether the source's bytes were all fsynced before), and
    fsyncs (the file's inode and its size then: an fsync before flush sees fewer bytes;
    fdatasync counts: it writes the data and the size, all a rename needs; so does os.sync(),
    every file of every file system: noted for each file of ``folder`` as it is then).
    ``hold``: called before each rename (a rank that returns before it did not wait).
    Lesson 05's atomic snapshot: what a crash-safe save calls, in which order."""
    real_replace, real_rename, real_sync = os.replace, os.rename, os.sync
    real_syncs = {"fsync": os.fsync, "fdatasync": getattr(os, "fdatasync", None)}

    def sync_all() -> None:
        real_sync()
        files = [f for f in folder.iterdir() if f.is_file()] if folder is not None else []
        fsyncs.extend((st.st_ino, st.st_size) for st in map(os.stat, files))

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                st = os.stat(src)
                synced = any(ino == st.st_ino and size >= st.st_size for ino, size in fsyncs)
            except (OSError, TypeError):  # the real call then says what is wrong
                synced = False
            # absolute: `tempfile` names are, the check's folder is relative to the rank's cwd
            replaced.append((os.path.abspath(src), os.path.abspath(dst), synced))
            if hold is not None:
                hold()
            return real(src, dst, *args, **kwargs)

        return move

    def noted(real: Callable[..., Any]) -> Callable[..., Any]:
        def sync(fd: Any) -> Any:
            number = fd if isinstance(fd, int) else fd.fileno()
            st = os.fstat(number)
            fsyncs.append((st.st_ino, st.st_size))
            return real(fd)

        return sync

    spies = {"replace": spy(real_replace), "rename": spy(real_rename), "sync": sync_all}
    spies.update((name, noted(real)) for name, real in real_syncs.items() if real is not None)
    with ExitStack() as stack:
        for name, fake in spies.items():
            stack.enter_context(mock.patch.object(os, name, fake))
        stack.enter_context(paths_through_os())  # Python 3.10: tmp.replace(path) is seen too
        yield


@contextmanager
def barriers_return() -> Iterator[None]:
    """One rank alone in a call its peers are not in (lesson 05's saves on rank 0): its barriers
    return at once, the monitored one too (helper 133: it waited for peers that never came)."""
    with ExitStack() as stack:
        for name in ("barrier", "monitored_barrier"):
            stack.enter_context(mock.patch.object(dist, name, lambda *a, **k: None))
        yield


@contextmanager
def large_write_buffers() -> Iterator[None]:
    """Files opened for writing keep 1 MiB in Python's buffer (the default: the file system's
    block, 4 KiB here). The snapshot (about 4 KiB) then reaches the OS only at a flush, so an
    fsync before the flush is seen on every file system, not only where the snapshot fits
    in one block (helper 118: on this one, a single 4,109-byte write went past the buffer)."""
    real = io.open

    def opened(file: Any, mode: str = "r", buffering: int = -1, *args: Any, **kwargs: Any) -> Any:
        if buffering == -1 and "b" in mode and any(c in mode for c in "wax+"):
            buffering = 1 << 20
        return real(file, mode, buffering, *args, **kwargs)

    with mock.patch.object(builtins, "open", opened), mock.patch.object(io, "open", opened):
        yield
