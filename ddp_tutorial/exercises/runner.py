"""What torchrun starts to check exercises: every candidate file, one after the other.

    torchrun --standalone --nproc-per-node 2 -m ddp_tutorial.exercises.runner \\
        --out RUN_DIR --candidate 01_ring_average=scripts/exercises/01_ring_average.py ...

Several candidates share one launch (torchrun's start-up costs seconds; a candidate, a
fraction of one). For each, every rank writes ``RUN_DIR/c{i}/status-rank{r}.json``: ok or the
error, the line of the learner's file it came from, and what the exercise's ``run`` recorded.
Each candidate gets a process group of its own, under its own key prefix in torchrun's store
(a group made again under the same keys can read the last one's addresses and hang), made once
every rank has met in the store, and a short collective timeout: a rank left waiting by a peer
fails in seconds, named. After each candidate the ranks meet in the store before the next
begins, so a wrong answer — even one that hangs — costs only itself; only a rank that dies
(gloo aborts the process on some mistakes), or a group that formed on some ranks only (their
group counts then differ), ends the batch, and the checker launches the rest again.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist

from ddp_tutorial.distributed import set_collective_timeout
from ddp_tutorial.exercises.core import STARTED, Context, Exercise, find
from ddp_tutorial.records import write_json


def load(path: Path, tag: str) -> ModuleType:
    """Import the learner's file under a name of its own (two candidates never collide)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{tag}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def where(exc: BaseException, path: Path) -> str:
    """``line N, in f: code`` of the deepest frame in the learner's file, else the deepest."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
    frame = (mine or frames or [None])[-1]
    if frame is None:
        return ""
    name = "your file" if mine else Path(frame.filename).name
    return f"{name}, line {frame.lineno}, in {frame.name}: {(frame.line or '').strip()}"


@functools.cache
def agent_store() -> dist.Store:
    """A client of torchrun's store (``MASTER_ADDR:MASTER_PORT``), shared by every candidate."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=120))  # fmt: skip


# Every rank has met in torchrun's store (which waits 120 s: a peer still starting on a loaded
# host is no hang) before a candidate's group is made, so connecting takes a moment. gloo keeps
# this timeout for point-to-point sends and receives, which dist.set_timeout does not reach: it
# is also how long a deadlocked send (every rank sending first) waits before it fails.
CONNECT_TIMEOUT_S = 10.0


def init_kwargs(ctx: Context, ex: Exercise) -> dict[str, Any]:
    """A fresh group under this candidate's own prefix (what env:// would do, isolated)."""
    timeout = max(ex.collective_timeout_s, CONNECT_TIMEOUT_S)
    return {"store": dist.PrefixStore(ctx.out.name, agent_store()), "rank": ctx.rank,
            "world_size": ctx.world_size,
            "timeout": datetime.timedelta(seconds=timeout)}  # fmt: skip


def joined(ctx: Context, ex: Exercise) -> None:
    """After a rank's init returned: wait until every rank's has. A candidate that makes no
    collective would otherwise tear its group down while a slower peer is still connecting to
    it (gloo's "connectFullMesh failed ... Connection closed by peer", seen on a loaded host),
    and that peer's failed init leaves the ranks' group counts apart for every later
    candidate. A rank that never calls init is waited for as long as init waits."""
    store = agent_store()
    store.set(f"{ctx.out.name}/joined/{ctx.rank}", "")
    keys = [f"{ctx.out.name}/joined/{r}" for r in range(ctx.world_size)]
    store.wait(keys, datetime.timedelta(seconds=max(ex.collective_timeout_s, CONNECT_TIMEOUT_S)))


def cap_collective_timeout(ex: Exercise) -> None:
    """Once joined, a collective a peer never calls fails in seconds, not after gloo's 30 min."""
    set_collective_timeout(ex.collective_timeout_s)  # dist.set_timeout, or torch < 2.14's name


@contextlib.contextmanager
def restored_signals() -> Iterator[None]:
    """A candidate's signal handlers (lesson 08 installs them) end with the candidate."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_script(ex: Exercise, path: Path, ctx: Context) -> dict[str, Any]:
    """Run the learner's script as ``__main__``, as torchrun does; ``ex.run`` reads its files."""
    original = dist.init_process_group
    asked: dict[str, Any] = {}  # the rank= and world_size= the learner gave (replaced below)

    def init(backend: Any = None, init_method: Any = None, **kwargs: Any) -> None:
        if init_method in (None, "env://") and "store" not in kwargs:
            asked.update((k, _plain(kwargs[k])) for k in ("rank", "world_size") if k in kwargs)
            kwargs = {**kwargs, **init_kwargs(ctx, ex)}
        original(backend, **kwargs)
        joined(ctx, ex)
        cap_collective_timeout(ex)

    argv = sys.argv
    sys.argv = [str(path), *ex.args, "--out", str(ctx.out)]
    dist.init_process_group = init
    exit_code: Any = 0
    try:
        with ex.around(ctx) if ex.around else contextlib.nullcontext():
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0, *ex.exit_codes):
            raise
        exit_code = stop.code or 0
    finally:
        returned_at = time.time()  # when this rank's script was done (lesson 08: before a save?)
        sys.argv = argv
        dist.init_process_group = original
        left_open = dist.is_initialized()
        if left_open:
            dist.destroy_process_group()
        meet(ctx, "script-done")  # every rank's files are written before any rank reads them
    found = ex.run(None, ctx) if ex.run else {}  # type: ignore[arg-type]
    return {
        "left_group_open": left_open,
        "exit_code": exit_code,
        "returned_at": returned_at,
        "init_asked": asked,
        **found,
    }


def _plain(value: Any) -> Any:
    """A value for the record (JSON): an int stays one, anything else is shown as typed."""
    return value if isinstance(value, int) else repr(value)


def run_functions(ex: Exercise, path: Path, ctx: Context, tag: str) -> dict[str, Any]:
    """Import the learner's file and call the exercise's ``run`` in a process group of our own."""
    module = load(path, tag)
    assert ex.run is not None, f"{ex.name}: a functions exercise needs run()"
    return ex.run(module, ctx)


def one(ex: Exercise, path: Path, ctx: Context, tag: str) -> dict[str, Any]:
    """Run one candidate on this rank; never raises (the record says what went wrong)."""
    record: dict[str, Any] = {"exercise": ex.name, "file": str(path), "status": "ok"}
    try:
        with restored_signals():
            if ex.kind == "script":
                record["result"] = run_script(ex, path, ctx)
            else:
                dist.init_process_group("gloo", **init_kwargs(ctx, ex))
                joined(ctx, ex)
                cap_collective_timeout(ex)
                record["result"] = run_functions(ex, path, ctx, tag)
    except BaseException as exc:  # the learner's code may raise anything, SystemExit included
        record.update(status="error", error=f"{type(exc).__name__}: {exc}".strip(),
                      where=where(exc, path))  # fmt: skip
    return record


def meet(ctx: Context, what: str, value: str = "") -> list[str]:
    """Wait in torchrun's store until every rank has said ``what``; what each said."""
    store = agent_store()
    store.set(f"{ctx.out.name}/{what}/{ctx.rank}", value)
    keys = [f"{ctx.out.name}/{what}/{r}" for r in range(ctx.world_size)]
    store.wait(keys)
    return [store.get(k).decode() for k in keys]


def agree(ctx: Context, status: str) -> list[str]:
    """Wait for every rank to finish this candidate, through torchrun's store (the learner's
    group may be gone or out of step); every rank's status."""
    if dist.is_initialized():
        dist.destroy_process_group()
    return meet(ctx, "status", status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--candidate", action="append", default=[], metavar="NAME=FILE",
                        help="an exercise and the file to check for it (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # DDP's constructor imports torch._dynamo before its first collective: seconds on a busy
    # host, which a peer already waiting would count against the collective timeout. Now, once.
    importlib.import_module("torch._dynamo")
    for i, pair in enumerate(args.candidate):
        name, _, file = pair.partition("=")
        (ex,) = find(name)
        ctx = Context(rank=rank, world_size=world, out=args.out / f"c{i}")
        meet(ctx, "start")  # every rank is here: the group below connects at once
        if rank == 0:  # when this candidate began: one stopped in it long after, hung there
            ctx.out.mkdir(parents=True, exist_ok=True)
            (ctx.out / STARTED).touch()
        record = one(ex, Path(file), ctx, tag=f"{i}")
        write_json(ctx.out / f"status-rank{rank}.json", {"rank": rank, **record})
        agree(ctx, record["status"])
        # A group that failed to form on some ranks only still counted there: the next
        # candidate's group would wait for keys its peers never write. Stop; the checker
        # launches the candidates left again, in fresh processes.
        if len(set(meet(ctx, "groups", str(dist.get_pg_count())))) > 1:
            return


if __name__ == "__main__":
    main()
