"""Lesson 05's first exercise: a rank-0 atomic snapshot (the second: ``lesson05_resume``).

``05_atomic_snapshot`` (functions): the learner's ``save_snapshot`` is called on every rank,
over an older snapshot, while the check slows rank 0's write and rename down (a rank that
returns before the new file is in place did not wait: polling, or a barrier before the
rename), then once more on rank 0 with ``torch.save`` killed halfway through (the old snapshot
must survive); ``load_snapshot`` reads a file whose tensors say "cuda:0", as rank 0 of a GPU
job writes them, on ranks that have no GPU (only ``map_location`` makes that load work).
"""

from __future__ import annotations

import datetime
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn

from ddp_tutorial.exercises.core import Context, Exercise, Record, one_line
from ddp_tutorial.exercises.lesson01 import COLLECTIVES
from ddp_tutorial.exercises.runner import agent_store, meet
from ddp_tutorial.exercises.spies import (
    barriers_return,
    large_write_buffers,
    paths_through_os,
    spied_os,
    spying,
)

DELAY_S = 1.5  # the longest rank 0's first save (write, then rename) waits for the others
# what a rank that waits for rank 0's file calls (a sleep that outlasts DELAY_S waits for none):
# any collective, since rank 0 reaches it only after its rename
WAITS = (*COLLECTIVES, "barrier", "monitored_barrier", "broadcast_object_list", "gather_object",
         "scatter_object_list")  # fmt: skip
EPOCH, STEP = 3, 120  # what the first save is asked to store


class Killed(BaseException):
    """The process died in the middle of torch.save (simulated: nothing can catch a SIGKILL,
    so this is not an Exception that a ``try/except Exception`` would swallow)."""


def _target(f: Any) -> str:
    return str(f) if isinstance(f, str | os.PathLike) else str(getattr(f, "name", repr(f)))


@contextmanager
def _spied_save(calls: list[str], hold: Callable[[], None] | None = None,
                kill: bool = False) -> Iterator[None]:  # fmt: skip
    """Record every torch.save target; hold the write up (``hold``), or write half and die."""
    real = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(_target(f))
        if not kill:
            if hold is not None:
                hold()
            return real(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, str | os.PathLike):
            with open(f, "wb") as out:
                out.write(half)
        else:
            f.write(half)
            f.flush()
        raise Killed("killed in the middle of torch.save")

    with mock.patch.object(torch, "save", save):
        yield


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny DDP model after one SGD step with momentum (so the optimizer has state)."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def _read(path: Path) -> dict[str, Any]:
    """What the file holds, as the judge needs it (the check's own load)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    if not isinstance(state, dict):
        return {"error": f"a {type(state).__name__}, not a dict"}
    model, optimizer = state.get("model"), state.get("optimizer")
    return {"keys": sorted(map(str, state)), "epoch": state.get("epoch"),
            "step": state.get("step"),
            "model_keys": sorted(model) if isinstance(model, dict) else None,
            "momentum": bool(isinstance(optimizer, dict) and optimizer.get("state"))}  # fmt: skip


def _save_phase(
    module: ModuleType, ctx: Context, model: Any, optimizer: Any, path: Path, record: Record
) -> None:
    folder = path.parent
    # 1. every rank saves over an older snapshot (epoch EPOCH - 1: a rank that finds a file
    # there has not found this save's); rank 0's write and its rename wait until the other
    # ranks have returned (a rank that returns before the new file is in place did not wait
    # for it), DELAY_S at most in all
    if ctx.rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": EPOCH - 1}, path)
    meet(ctx, "05-old-snapshot")
    store, returned = agent_store(), f"{ctx.out.name}/05-returned"

    def hold() -> None:  # each its own half: a rename after a barrier waits for the reads too
        try:
            store.wait([f"{returned}/{r}" for r in range(1, ctx.world_size)],
                       datetime.timedelta(seconds=DELAY_S / 2))  # fmt: skip
        except Exception:  # they are waiting for this write, as they should: go on
            pass

    calls: list[str] = []
    replaced: list[tuple[str, str, bool]] = []
    fsyncs: list[tuple[int, int]] = []
    waits: list[str] = []
    try:
        with (
            _spied_save(calls, hold if ctx.rank == 0 else None),
            large_write_buffers(),
            spied_os(replaced, fsyncs, hold if ctx.rank == 0 else None, folder),
            mock.patch.dict(os.environ, {"LOCAL_RANK": "0"}),  # as if each rank had a node
            spying(WAITS, lambda name, *_: waits.append(name), module, also=(c10d,)),
        ):
            module.save_snapshot(path, model, optimizer, EPOCH, STEP)
    except Exception as exc:
        record["save_error"] = one_line(exc)
    found = _read(path) if path.is_file() else {}
    record.update(saves=calls, replaced=replaced, fsyncs=len(fsyncs), waits=waits,
                  there_on_return=found.get("epoch") == EPOCH)  # fmt: skip
    store.set(f"{returned}/{ctx.rank}", "")
    meet(ctx, "05-saved")
    record["saved"] = _read(path) if path.is_file() else None
    written = {Path(target).name for target in calls}  # what torch.save wrote: a temporary
    # file still there was never renamed; a copy the learner keeps on purpose is not judged
    record["left_in_folder"] = sorted(p.name for p in folder.iterdir()
                                      if p.name != path.name and p.name in written)  # fmt: skip
    meet(ctx, "05-read")


def _kill_phase(
    module: ModuleType, ctx: Context, model: Any, optimizer: Any, path: Path, record: Record
) -> None:
    # 2. rank 0 alone saves again, and dies halfway through torch.save
    if ctx.rank == 0 and record["saved"] and "error" not in record["saved"]:
        died: list[str] = []
        try:
            with _spied_save(died, kill=True), barriers_return():
                module.save_snapshot(path, model, optimizer, EPOCH + 1, STEP + 40)
            record["kill"] = "caught" if died else "torch.save was never called"
        except (Killed, Exception) as exc:  # Killed, or raised again as another error
            if any(isinstance(e, Killed) for e in (exc, exc.__cause__, exc.__context__)):
                after = _read(path) if path.is_file() else {"error": "the file is gone"}
                record["kill"] = after.get("error", "").split(". ")[0] or (
                    "intact" if after.get("epoch") == EPOCH else f"epoch {after.get('epoch')}"
                )
            else:
                record["kill"] = f"raised {one_line(exc)}"
    meet(ctx, "05-killed")


def _replace_phase(
    module: ModuleType, ctx: Context, model: Any, optimizer: Any, path: Path, record: Record
) -> None:
    # 3. rank 0 alone saves over its snapshot: was the old one deleted before the rename?
    if ctx.rank == 0 and path.is_file():
        removed: list[str] = []

        def noted(real: Callable[..., Any]) -> Callable[..., Any]:
            def remove(target: Any, *args: Any, **kwargs: Any) -> Any:
                if isinstance(target, str | os.PathLike):  # not a directory fd
                    removed.append(os.path.realpath(target))
                return real(target, *args, **kwargs)

            return remove

        try:
            with (
                mock.patch.object(os, "unlink", noted(os.unlink)),
                mock.patch.object(os, "remove", noted(os.remove)),
                paths_through_os(),  # Python 3.10: path.unlink() is seen too
                barriers_return(),
            ):
                module.save_snapshot(path, model, optimizer, EPOCH + 2, STEP + 80)
        except Exception:  # named by the first save already
            pass
        record["removed_snapshot"] = os.path.realpath(path) in removed
    meet(ctx, "05-replaced")


def _load_phase(
    module: ModuleType, ctx: Context, model: Any, optimizer: Any, path: Path, record: Record
) -> None:
    folder = path.parent
    # 3. every rank loads a snapshot whose tensors rank 0 saved from cuda:0
    gpu_file = folder / "from-gpu.pt"
    if ctx.rank == 0:
        weights = {"model": model.module.state_dict(), "epoch": EPOCH}
        with mock.patch.object(torch.serialization, "location_tag", lambda storage: "cuda:0"):
            torch.save(weights, gpu_file)
    meet(ctx, "05-gpu-file")
    loads: list[dict[str, Any]] = []
    real_load = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:  # not torch's own of a broadcast object (h. 178)
        if not isinstance(args[0] if args else kwargs.get("f"), io.BytesIO):
            loads.append({"map_location": repr(kwargs.get("map_location", args[1] if len(args)
                                                          > 1 else None)),
                          "weights_only": kwargs.get("weights_only")})  # fmt: skip
        return real_load(*args, **kwargs)

    try:
        with mock.patch.object(torch, "load", load):
            got = module.load_snapshot(gpu_file, torch.device("cpu"))
        want = model.module.state_dict()
        mine = got.get("model", {}) if isinstance(got, dict) else {}
        record["loaded"] = {
            "epoch": got.get("epoch") if isinstance(got, dict) else None,
            "same": set(mine) == set(want) and all(
                isinstance(mine[k], torch.Tensor) and mine[k].device.type == "cpu"
                and torch.equal(mine[k], want[k]) for k in want),
        }  # fmt: skip
        # cuda:0, unopenable here: a right answer fails trying, one ignoring `device` returns
        with mock.patch.object(torch.cuda, "is_available", lambda: True):
            gpu = module.load_snapshot(gpu_file, torch.device("cuda", 0))
        tensors = gpu.get("model", {}).values() if isinstance(gpu, dict) else []
        record["on_gpu"] = sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)})
    except Exception as exc:  # asked for cuda:0, a right answer raises: not judged on it
        if "loaded" not in record:
            record["load_error"] = one_line(exc)
    record["loads"] = loads


def run_atomic(module: ModuleType, ctx: Context) -> Record:
    folder = ctx.out / "snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "snapshot.pt"
    # DDP's constructor imports torch._dynamo before its first collective: seconds on a busy
    # machine, not the same on every rank. Imported here, then the ranks meet in torchrun's
    # store (no collective timeout there), so that a slow import cannot pass for a hang.
    import torch._dynamo  # noqa: F401

    meet(ctx, "05-ready")  # the check's own waits go through torchrun's store: a learner's
    # collective left unmatched costs only the learner's call, not the check's next step
    model, optimizer = _model()
    record: Record = {"rank": ctx.rank}
    for phase in (_save_phase, _kill_phase, _replace_phase, _load_phase):
        phase(module, ctx, model, optimizer, path, record)
    return record


def _judge_writes(records: list[Record]) -> str | None:
    """Who wrote, what the file holds, then (a wrong epoch reads as late) who waited."""
    first = records[0]
    writers = [r["rank"] for r in records if r["saves"]]
    if len(writers) > 1:
        return (f"ranks {writers} all called torch.save: only global rank 0 writes (`if "
                "dist.get_rank() == 0`); two writers of one file can corrupt it (the check "
                "saves as if each rank were on a node of its own, where every LOCAL_RANK is "
                "0: `local_rank == 0` is one writer per node) "
                '(lesson 05, "1 · The hazard, measured: several writers, one file")')  # fmt: skip
    if writers and writers != [0]:
        return (f"rank {writers[0]} wrote the snapshot: the writer is global rank 0 "
                '(lesson 05, "1 · The hazard, measured: several writers, one file")')  # fmt: skip
    names = [(Path(a).name, Path(b).name) for a, b, _ in first.get("replaced", [])]
    if {"snapshot.pt"} <= {a for a, _ in names} & {b for _, b in names}:  # helper 178
        return ("the old snapshot was renamed away before the new one took its name: between "
                "the two renames there is no snapshot.pt at all - os.replace(tmp, path) alone "
                "replaces it in one step (a backup of the old one: shutil.copy2 or os.link) "
                '(lesson 05, "2 · Killed in the middle of a save")')  # fmt: skip
    if swapped := [(a, b) for a, b in names if b != a and b.startswith(a)]:
        return (f"os.replace({swapped[0][0]!r}, {swapped[0][1]!r}) moves the snapshot onto "
                "the temporary name: the file being renamed comes first - os.replace(tmp, "
                'path) (lesson 05, "2 · Killed in the middle of a save")')  # fmt: skip
    for r in records:
        error = r.get("save_error", "")
        if "Timed out" in error:
            return (f"rank {r['rank']} waited in save_snapshot for ranks that never came: is "
                    "the dist.barrier() under an `if` (or its `else`) on the rank? Every rank "
                    'must reach the same barrier (lesson 05, "The lines you write")')  # fmt: skip
        if "cross-device link" in error:
            return ("the temporary file was on another file system than the snapshot, and "
                    "os.replace cannot move a file across: write it beside the snapshot "
                    '(lesson 05, "2 · Killed in the middle of a save")')  # fmt: skip
        if error.startswith("FileNotFoundError") and ".tmp" in error:  # closed, then renamed
            return (f"rank {r['rank']}: save_snapshot raised {error} - a "
                    "NamedTemporaryFile deletes itself when it is closed: delete=False, then "
                    "os.replace it")  # fmt: skip
        if error:
            return f"rank {r['rank']}: save_snapshot raised {error}"
    if not writers or first["saved"] is None:
        return "no snapshot was written: rank 0 must torch.save the state"
    saved = first["saved"]
    if "error" in saved:
        return f"the snapshot does not load with weights_only=True: {saved['error']}"
    missing = {"model", "optimizer", "epoch", "step"} - set(saved["keys"])
    if missing:
        return (f"the snapshot has no {sorted(missing)}: save model, optimizer, epoch and "
                f'step (lesson 05, "The lines you write")')  # fmt: skip
    if saved["model_keys"] is None:
        return "snapshot['model'] is not a state_dict: save model.module.state_dict()"
    if any(k.startswith("module.") for k in saved["model_keys"]):
        return ("the model's keys start with 'module.' (DDP's wrapper): save "
                "model.module.state_dict(), the plain model inside "
                '(lesson 05, "4 · `module.` and `_orig_mod.`")')  # fmt: skip
    if (saved["epoch"], saved["step"]) != (EPOCH, STEP):
        return (f"the snapshot says epoch {saved['epoch']}, step {saved['step']}; it was asked "
                f"to save epoch {EPOCH}, step {STEP}")  # fmt: skip
    if not saved["momentum"]:
        return "the optimizer's state is empty: save optimizer.state_dict() (its momentum)"
    return _judge_waits(records)


def _judge_waits(records: list[Record]) -> str | None:
    """Every rank but 0 came back with this save's file in place, having waited for it."""
    late = [r["rank"] for r in records if not r["there_on_return"]]
    idle = [r["rank"] for r in records if r["rank"] and not r["waits"]]  # slept long enough
    if late or idle:
        return (
            f"rank {(late or idle)[0]} returned from save_snapshot "
            + (
                "before rank 0's new file was in place (rank 0 was still writing or renaming "
                "it; the folder held an older snapshot)"
                if late
                else "without a collective: "
                "rank 0's file was there by luck (a sleep, a poll) - a slower save is not"
            )
            + ": every rank must wait at dist.barrier() after the rename - not before it, not "
            "by polling for the file - so that no rank reads a file that is not this save's "
            '(lesson 05, "The lines you write")'
        )
    return None


def _judge_crash_safety(first: Record) -> str | None:
    """A save killed halfway left the old snapshot; temp file beside it, fsynced, renamed."""
    kill = first.get("kill")
    if kill == "caught":  # helper 169: told the snapshot was lost (it was not)
        return ("rank 0's save_snapshot caught the check's stand-in for a crash inside torch.save"
                " and returned as if it had saved: a real crash (SIGKILL, power loss) cannot be "
                "caught, and a failed save must not pass for a done one - remove the temporary "
                'file if you like, then raise again (lesson 05, "2 · Killed in the middle of a '
                'save")')  # fmt: skip
    if kill != "intact":
        return (
            f"rank 0 died in the middle of torch.save, and the snapshot it had written "
            f"before was lost ({kill}): write to a temporary file, then os.replace it over "
            "the snapshot - a crash then leaves the old file or the new one, never half "
            '(lesson 05, "2 · Killed in the middle of a save")'
        )
    moves = first["replaced"]
    if not moves:
        return ("no rename: write to a temporary file, then os.replace(tmp, path) "
                '(lesson 05, "2 · Killed in the middle of a save")')  # fmt: skip
    if first.get("removed_snapshot"):
        return ("the old snapshot was deleted before the rename: until the rename there is no "
                "snapshot at all - os.replace(tmp, path) replaces it in one step "
                '(lesson 05, "2 · Killed in the middle of a save")')  # fmt: skip
    src, dst, synced = moves[-1]
    if Path(src).parent != Path(dst).parent:
        return (
            f"the temporary file was in {Path(src).parent}, not beside the snapshot: "
            "os.replace is atomic only within one file system, and another folder can be "
            "another mount - put it in the snapshot's own folder "
            '(lesson 05, "2 · Killed in the middle of a save")'
        )
    if first["fsyncs"] == 0:
        return (
            "the temporary file was not fsynced before the rename: after a power loss the "
            "rename can be on disk before the bytes are - f.flush(); os.fsync(f.fileno()) "
            'before os.replace (lesson 05, "2 · Killed in the middle of a save")'
        )
    if not synced:
        return (
            "the temporary file was renamed before all its bytes were fsynced: f.flush() "
            "(Python's buffer to the OS), then os.fsync(f.fileno()) (the OS's to the disk), "
            "then os.replace - an fsync before the flush, or after the rename, syncs too little "
            'or too late (lesson 05, "2 · Killed in the middle of a save")'
        )
    if first["left_in_folder"]:
        return (f"files written by torch.save left beside the snapshot after a save: "
                f"{first['left_in_folder']} - rename the temporary file over the snapshot "
                "(os.replace), so that none is left")  # fmt: skip
    return None


def _judge_loads(records: list[Record]) -> str | None:
    """Every rank loaded the snapshot onto its own device, weights only."""
    for r in records:
        if "load_error" in r:
            if "CUDA device" in r["load_error"]:
                given = r["loads"][-1]["map_location"] if r["loads"] else "None"
                passed = "" if given == "None" else f"map_location={given} is not `device`: "
                return (
                    f"rank {r['rank']}: loading a snapshot saved from cuda:0 on a rank "
                    f"without that GPU failed ({r['load_error'][:90]}...): {passed}pass "
                    "map_location=device, so the tensors land on this rank's device (lesson "
                    '05, "6 · `map_location`")'
                )
            return f"rank {r['rank']}: load_snapshot raised {r['load_error']}"
        if any(call["weights_only"] is False for call in r["loads"]):
            return ("torch.load(..., weights_only=False) runs whatever the file names: load "
                    'with weights_only=True, the default since torch 2.6 (lesson 05, "5 · '
                    '`weights_only=True`")')  # fmt: skip
        if not r["loaded"]["same"] or r["loaded"]["epoch"] != EPOCH:
            return (f"rank {r['rank']}: load_snapshot did not return the file's contents on "
                    "this rank's device: return torch.load(path, map_location=device, "
                    "weights_only=True)")  # fmt: skip
        if "cpu" in r.get("on_gpu", []):
            return ("load_snapshot loads onto the CPU whatever `device` it is given (asked "
                    "for cuda:0, its tensors came back on the cpu): "
                    "map_location=device, so that a GPU rank's tensors land on its own GPU "
                    '(lesson 05, "6 · `map_location`")')  # fmt: skip
    return None


def judge_atomic(records: list[Record]) -> str | None:
    return (_judge_writes(records) or _judge_crash_safety(records[0])
            or _judge_loads(records))  # fmt: skip


EXERCISES = [
    Exercise(
        name="05_atomic_snapshot", lesson="05", run=run_atomic, judge=judge_atomic,
        title="a snapshot written by rank 0 alone, atomically, and read back anywhere",
        teaches='lesson 05, "The lines you write" and "2 · Killed in the middle of a save"',
        collective_timeout_s=6.0,
        proves=(
            "rank 0 alone wrote, through a temporary file and a rename, and the others waited for"
            " it; the snapshot holds model (no 'module.'), optimizer, epoch and step, loads with "
            "weights_only=True, and every rank reads it back, weights only, mapped to its device"
        ),
    ),
]  # fmt: skip
