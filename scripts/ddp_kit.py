"""What train.py should not make you rewrite: copy this file beside it ("copy these two files").

torch, torchvision, numpy and the standard library only; ``import ddp_kit`` from train.py.
Each helper says why it exists: an atomic save from one writer, a load that runs no code,
snapshots an exact resume needs (RNG states of every rank), a sampler that resumes
mid-epoch on any number of ranks, one stop decision for every rank (a signal, a loss
gone inf/nan, a timed save), the store a restarted job joins through, exact evaluation.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import random
import re
import signal
import site
import sys
import threading
import time
import uuid
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler

PathLike = str | os.PathLike[str]
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: each rank's status; torchrun, signalled too, exits 1
SIGNALS = ("SIGTERM", "SIGUSR1")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP/DataParallel, torch.compile
TEMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d+)\.pt$")
SCHEDULE_FLAGS = ("epochs", "batch_size", "grad_accum", "lr", "warmup")
MODEL_NAMES = ("mlp", "cnn", "resnet18")
DATA_KINDS = ("synthetic", "folder", "cifar10")
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
NORM_STATISTICS = ("running_mean", "running_var")
STORE_ROOT = "job"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the problem."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that cannot be read back (cut short, damaged): an older one may do."""


class DataError(ValueError):
    """The data cannot be used; the message names the flag or file and what to do."""


class DivergedError(RuntimeError):
    """The loss (or the weights) stopped being finite; nothing after the last good save kept."""


def group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if group_active() else (0, 1)


# ------------------------------------------------------------------ saving: one writer, atomic

_PLAIN = (str, int, float, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)


def find_unsafe(obj: Any, where: str = "state") -> list[str]:
    """Where ``obj`` holds what ``torch.load(weights_only=True)`` refuses (empty: safe).

    Checked before saving, a resume that would fail weeks later fails now. Exact types:
    np.float64 is a float subclass, yet weights_only refuses it."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return []
    problems: list[str] = []
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if find_unsafe(key):
                problems.append(f"{where} has a key of type {type(key).__qualname__}")
            problems += find_unsafe(value, f"{where}[{key!r}]")
    elif type(obj) in (list, tuple, set):  # not frozenset: weights_only refuses it
        for i, value in enumerate(obj):
            problems += find_unsafe(value, f"{where}[{i}]")
    else:
        problems.append(f"{where} is {type(obj).__module__}.{type(obj).__qualname__}")
    return problems


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    with contextlib.suppress(OSError):  # some filesystems cannot open directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Sink:
    """A file keeping its OSError (disk full): torch's zip writer only says "unexpected pos"."""

    def __init__(self, file: Any):
        self.file, self.error, self.flush = file, None, file.flush

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise


def temp_path_for(path: PathLike) -> Path:
    """A hidden, unique ``.tmp`` name beside ``path`` (same folder: the rename stays atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def atomic_save(obj: Any, path: PathLike, check_plain: bool = True) -> Path:
    """``path`` is always the old or the new file, never half: temp file, fsync, rename,
    fsync of the folder. A process killed at any point leaves the old file (and a temp)."""
    path = Path(path)
    if check_plain and (problems := find_unsafe(obj)):
        raise CheckpointError(
            f"refusing to save {path}: it must hold only tensors and plain Python values (so "
            f"that torch.load(weights_only=True) can read it back), but {'; '.join(problems[:5])}"
            f". Save the object's state instead (e.g. vars(args), model.state_dict())."
        )

    def save_into(f: Any) -> None:  # its callers' rank test guards it (one writer: rank 0)
        sink = _Sink(f)
        try:
            torch.save(obj, sink)
        except RuntimeError as exc:  # the OS's own error names the cause
            raise sink.error or exc from None

    return _atomically(path, save_into)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """:func:`atomic_save` for a small text file (best.json, failed.json): the same steps."""
    return _atomically(Path(path), lambda f: f.write(text.encode()))


def _atomically(path: Path, write: Any) -> Path:
    """``write(file)`` into a temp file beside ``path``, fsync, rename, fsync of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # never someone else's file
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _failed_crc(path: Path) -> str | None:
    """The first member of a zip checkpoint whose bytes fail their CRC-32, if any: torch.load
    reads no checksum, so bytes damaged on disk load without an error, as other weights.
    (A member saved with torch's CRC-32 off holds 0 there: not checked.)"""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0 and info.file_size:
                    continue
                try:
                    with archive.open(info) as member:
                        while member.read(1 << 24):
                            pass
                except zipfile.BadZipFile:  # "Bad CRC-32 for file ..."
                    return info.filename
    except (zipfile.BadZipFile, OSError):
        return None  # not readable as a zip at all: torch.load says why, below
    return None


def share_outcome(failure: BaseException | str | None, path: PathLike) -> None:
    """Rank 0's save outcome on every rank (a broadcast: call it on every rank).

    The barrier (nobody reads a half-written file) and, if rank 0 failed, its error raised
    on every rank at once: a rank left waiting in a barrier would wait out the timeout."""
    text = failure if isinstance(failure, str | None) else f"{type(failure).__name__}: {failure}"
    message = [text]
    if group_active() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise CheckpointError(f"rank 0 failed to save {path}: {message[0]}")


class FolderInUse(RuntimeError):
    """Another live job holds the checkpoint folder: this one must not touch it."""


def hold_folder(directory: PathLike) -> Any:
    """An exclusive lock on ``directory`` (its ``.lock`` file) for as long as the returned file
    stays open, taken by global rank 0 before anything in the folder is touched: two jobs given
    one folder (the same job submitted twice) delete each other's saves in progress, prune each
    other's snapshots and overwrite each other's best.pt. The OS drops the lock when the process
    ends, however it ends (SIGKILL too): a restart takes it again. None where the filesystem
    has no flock (some parallel filesystems; Windows): unguarded, as before."""
    try:
        import fcntl
    except ImportError:
        return None
    path = Path(directory) / ".lock"
    try:
        handle = open(path, "a+")  # noqa: SIM115 - held open on purpose
    except PermissionError:  # another user's .lock in a shared folder: read-only locks too
        try:
            handle = open(path)  # noqa: SIM115
        except OSError:
            return None
    except OSError:  # .lock is a folder, the filesystem refuses: unguarded
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that wrote nothing"
        handle.close()
        raise FolderInUse(
            f"{directory} is in use by another job ({holder}): give this job its own "
            "--checkpoint-dir, or stop the other one first"
        ) from None
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks on this filesystem
        handle.close()
        return None
    if handle.writable():  # who holds it, for the job that is refused
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {os.uname().nodename}, pid {os.getpid()}, since {time.ctime()}\n")
        handle.flush()
    return handle


def stale_temp_files(directory: PathLike) -> list[Path]:
    """Temp files of writers killed mid-save (safe to delete when no save runs)."""
    found = Path(directory).iterdir() if Path(directory).is_dir() else ()
    return sorted(p for p in found if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX))


# ------------------------------------------------------------------ loading: no code runs


def _corrupt(path: Path, size: int, detail: str) -> CheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {path} ({size} bytes) is truncated or corrupt — typically a process killed "
        f"while writing it, or several processes writing it at once (save from global rank 0 "
        f"only, atomically). torch says: {detail}"
    )


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def load_checkpoint(path: PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain values only, so a file cannot run
    code. Every failure is a :class:`CheckpointError` naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        others = (
            sorted(p.name for p in path.parent.glob("*.pt"))[:8] if path.parent.is_dir() else []
        )
        hint = f" Checkpoints in {path.parent}: {', '.join(others)}." if others else ""
        if not path.parent.exists():
            hint = f" (the directory {path.parent} does not exist either)"
        what = "is a directory, not a file" if path.is_dir() else "does not exist."
        raise CheckpointError(f"checkpoint {path} {what}{hint}")
    size = path.stat().st_size
    with open(path, "rb") as f:  # torch.save writes a zip ("PK"); torch < 1.6 a pickle (0x80),
        head = f.read(512)  # and the first releases a tar ("ustar" at 257)
    if head and not head.startswith((b"PK", b"\x80")) and head[257:262] != b"ustar":
        what = "zeros" if not head.strip(b"\0") else f"bytes {head[:4]!r}"
        raise _corrupt(path, size, f"not a file torch.save writes: it begins with {what}")
    if head.startswith(b"PK") and (member := _failed_crc(path)):
        raise _corrupt(path, size, f"{member} fails its CRC-32: its bytes changed on disk")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Weights only load failed" not in text:
            raise _corrupt(path, size, _first_line(text)) from None
        found = re.search(r"GLOBAL ([\w.]+)|Unsupported (?:operand \d+|class [\w.]+)", text)
        what = (found.group(1) or found.group(0)) if found else "an object that is not a tensor"
        raise CheckpointError(
            f"checkpoint {path} holds {what}, which torch.load(weights_only=True) refuses to "
            f"rebuild. That refusal is a security feature: unpickling an arbitrary object can run "
            f"any code its author chose, so a downloaded or shared checkpoint must never be loaded "
            f"with weights_only=False unless you trust whoever wrote it. Keep checkpoints to "
            f"tensors and plain types (dicts, lists, numbers, strings); if this file is your own, "
            f"re-save it that way."
        ) from None
    except EOFError:
        raise CorruptCheckpointError(
            f"checkpoint {path} is empty ({size} bytes): the writer was killed "
            f"right after opening it, or it is still being written"
        ) from None
    except (RuntimeError, KeyError, ValueError, IndexError, zipfile.BadZipFile) as exc:
        text = str(exc)
        if "deserialize object on a CUDA device" in text or (
            "CUDA" in text and "is_available" in text
        ):
            raise CheckpointError(
                f"checkpoint {path} holds tensors saved on a GPU and this process has no CUDA "
                f"device for them: load it with map_location='cpu' (or this rank's device). "
                f"torch says: {_first_line(text)}"
            ) from None
        if "legacy .tar format" in text:
            raise CheckpointError(
                f"checkpoint {path} uses the tar format of the earliest torch "
                f"releases, which weights_only=True cannot read; re-save it "
                f"with a current torch.save"
            ) from None
        if (
            "PytorchStreamReader" in text
            or "does not match expected size" in text
            or isinstance(exc, KeyError | IndexError | zipfile.BadZipFile)
        ):
            raise _corrupt(path, size, _first_line(text) or type(exc).__name__) from None
        raise CheckpointError(f"cannot load checkpoint {path}: {_first_line(text)}") from None
    except PermissionError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror}") from None
    except OSError as exc:  # EINVAL when the zip index points past the end of a cut file
        raise _corrupt(path, size, str(exc)) from None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``)."""
    while True:
        if isinstance(model, DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict: loads into a plain model anywhere, with or without DDP."""
    return unwrap_model(model).state_dict()


def strip_prefixes(
    state_dict: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> OrderedDict[str, Any]:
    """A copy without wrapper prefixes, only where *every* key has one (not ``k[7:]``)."""
    result: OrderedDict[str, Any] = OrderedDict(state_dict)
    if (metadata := getattr(state_dict, "_metadata", None)) is not None:
        result._metadata = metadata.copy()  # type: ignore[attr-defined]
    changed = True
    while changed and result:  # a compiled model inside DDP: module._orig_mod.
        changed = False
        for prefix in prefixes:
            if all(str(k).startswith(prefix) for k in result):
                consume_prefix_in_state_dict_if_present(result, prefix)
                changed = True
    return result


def describe_mismatch(
    model: nn.Module, state_dict: Mapping[str, Any], limit: int = 10
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, shape_mismatches)`` between a model and a state_dict."""
    expected = model.state_dict()
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state_dict.items()
        if k in expected
        and isinstance(v, torch.Tensor)
        and tuple(v.shape) != tuple(expected[k].shape)
    ]
    return (
        [k for k in expected if k not in state_dict],
        [k for k in state_dict if k not in expected],
        shapes,
    )


def load_model_state(
    model: nn.Module,
    source: PathLike | Mapping[str, Any],
    strict: bool = True,
    map_location: Any = "cpu",
    key: str = "model",
) -> tuple[list[str], list[str]]:
    """Weights from a file (loaded safely) or a dict, a bare state_dict or one under ``key``;
    prefixes stripped; a mismatch lists the keys (usually another architecture)."""
    name = str(source) if isinstance(source, str | os.PathLike) else "the given state"
    obj = load_checkpoint(source, map_location) if isinstance(source, str | os.PathLike) else source
    if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
        obj = obj[key]
    if not (isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        keys = f" with keys {list(obj)[:8]}" if isinstance(obj, Mapping) else ""
        raise CheckpointError(
            f"{name} is not a model state_dict (got {type(obj).__qualname__}"
            f"{keys}); expected a dict of tensors, or a training state with "
            f"one under {key!r}"
        )
    state_dict, target = strip_prefixes(obj), unwrap_model(model)
    missing, unexpected, shapes = describe_mismatch(target, state_dict)
    if shapes or (strict and (missing or unexpected)):
        parts = [f"{name} does not fit {type(target).__name__}"]
        for label, items in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", shapes),
        ):
            if items:
                more = f" … and {len(items) - 8} more" if len(items) > 8 else ""
                parts.append(f"{label} ({len(items)}): {', '.join(items[:8])}{more}")
        raise CheckpointError(
            "; ".join(parts) + ". Is it a checkpoint of another architecture or configuration?"
        )
    target.load_state_dict(state_dict, strict=strict)
    return missing, unexpected


# ------------------------------------------------------------------ snapshots: an exact resume


def capture_rng_state() -> dict[str, Any]:
    """This process's generators: torch, this rank's own GPU, Python's, numpy's global one.
    Dropout, noise and worker seeds draw from them: an exact resume puts them back."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # is_available() would ask the CUDA driver (lesson 01)
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` captured (the inverse, exactly)."""
    try:
        torch.set_rng_state(state["torch"].cpu())
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"not an RNG state from capture_rng_state(): {exc}") from None
    if (cuda := state.get("cuda")) is not None and torch.cuda.is_available():
        if isinstance(cuda, list | tuple):
            raise CheckpointError(
                "this RNG state holds every visible GPU's generator (an older snapshot); only "
                "the rank's own device can be restored safely: resume with restore_rng=False, "
                "or from a snapshot written by this version"
            )
        torch.cuda.set_rng_state(cuda.cpu(), torch.cuda.current_device())
    if (n := state.get("numpy")) is not None:
        np.random.set_state(
            (
                n["kind"],
                n["keys"].cpu().numpy().astype(np.uint32),
                n["pos"],
                n["has_gauss"],
                n["cached_gaussian"],
            )
        )


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, by rank (a collective): each rank draws its own dropout."""
    mine = capture_rng_state()
    if not group_active() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return [
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in states
    ]


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    epoch: int,
    step: int,
    batch_in_epoch: int = 0,
    sampler_epoch: int | None = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    own_buffers: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Everything an exact resume needs, plain values only; a collective (RNG states).

    ``own_buffers``: this rank's buffers before they were averaged for the saved model
    (:func:`buffers_of`); every rank's are kept, so that a resume on the same world size
    goes on with each rank's own BatchNorm statistics, as the run it resumes did."""
    gathered = None
    if own_buffers is not None:
        gathered = [{k: v.cpu() for k, v in own_buffers.items()}]
        if group_active() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, {k: v.cpu() for k, v in own_buffers.items()})
    return {
        "buffers": gathered,
        "format": FORMAT_VERSION,
        "model": model_state(model),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": int(epoch),
        "step": int(step),
        "batch_in_epoch": int(batch_in_epoch),
        "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
        "world_size": _rank_world()[1],
        "rng": gather_rng_states(),
        "extra": dict(extra or {}),
    }


def restore_training_state(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    restore_rng: bool = True,
) -> dict[str, int]:
    """Load a :func:`training_state` back; returns its epoch, step, batch_in_epoch,
    sampler_epoch. RNG states need the same world size (else ``restore_rng=False``)."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT_VERSION:
        keys = list(state)[:8] if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(f"not a training state of format {FORMAT_VERSION} (keys: {keys})")
    load_model_state(model, state, strict=True)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise CheckpointError("the training state holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):  # {}: saved disabled (no fp16): start fresh
        scaler.load_state_dict(state["scaler"])
    if restore_rng:
        rank, world_size = _rank_world()
        if len(state["rng"]) != world_size:
            raise CheckpointError(
                f"the checkpoint holds RNG states of {len(state['rng'])} rank(s) but this job has "
                f"{world_size}: an exact resume needs the same world size (or pass "
                f"restore_rng=False)"
            )
        restore_rng_state(state["rng"][rank])
        if state.get("buffers"):  # this rank's own statistics (the model holds their average)
            put_buffers(model, state["buffers"][rank])
    return {k: int(state[k]) for k in ("epoch", "step", "batch_in_epoch", "sampler_epoch")}


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's buffers (BatchNorm statistics), by name."""
    return {k: b.detach().clone() for k, b in unwrap_model(model).named_buffers()}


@torch.no_grad()
def put_buffers(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (from :func:`buffers_of`) back into ``model``."""
    for name, buffer in unwrap_model(model).named_buffers():
        buffer.copy_(buffers[name])


def snapshot_path(directory: PathLike, step: int) -> Path:
    """``directory/snapshot-000000123.pt``: zero-padded, so names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(directory) / f"snapshot-{step:09d}.pt"


def list_snapshots(directory: PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every snapshot in ``directory``, oldest first (temps ignored)."""
    if not Path(directory).is_dir():
        return []
    found = ((SNAPSHOT_PATTERN.match(p.name), p) for p in Path(directory).iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_file())


def latest_snapshot(directory: PathLike) -> Path | None:
    """The snapshot with the highest step, or None (nothing to resume)."""
    snapshots = list_snapshots(directory)
    return snapshots[-1][1] if snapshots else None


def prune_snapshots(directory: PathLike, keep: int = 2) -> list[Path]:
    """Delete all but the newest ``keep`` snapshots (rank 0); returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed = [path for _, path in list_snapshots(directory)[:-keep]]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def from_rank0(value: Any) -> Any:
    """Global rank 0's ``value`` on every rank (a collective): what rank 0 read from a shared
    folder (best.json, whether final.pt exists) decides for all, so that a node whose view of
    the folder lags cannot take another branch and leave the others in a collective save."""
    box = [value]
    if group_active() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_latest_snapshot(directory: PathLike | None) -> Path | None:
    """The newest snapshot as global rank 0 sees it, the same on every rank (a collective):
    a node whose view of a shared folder lags would otherwise resume from an older step."""
    choice: list[str | None] = [None]
    if _rank_world()[0] == 0 and directory is not None:
        latest = latest_snapshot(directory)
        choice = [str(latest) if latest is not None else None]
    if group_active() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if not (path := Path(choice[0])).is_file():
        raise CheckpointError(
            f"rank {_rank_world()[0]} cannot read {path}, the snapshot rank 0 resumes from: every "
            f"node must see the same checkpoint directory (a shared filesystem, not a per-node "
            f"copy)"
        )
    return path


def resume_point(directory: PathLike | None) -> Path | None:
    """:func:`agreed_latest_snapshot`, after rank 0 deleted what killed saves left."""
    if directory is not None and _rank_world()[0] == 0:
        for stale in stale_temp_files(directory):
            stale.unlink(missing_ok=True)
    return agreed_latest_snapshot(directory)


def load_resume_point(
    directory: PathLike | None, map_location: Any
) -> tuple[Path, Any, list[Path]] | None:
    """(path, state, the newer snapshots set aside): the newest snapshot every rank can load,
    loaded (a collective); None: nothing to resume.

    A snapshot cut short or damaged on disk (not by the atomic save: by a copy onto a full
    disk, a filesystem fault) is passed over for the one before it, and once one loads, rank 0
    renames the passed-over ones ``*.corrupt`` (kept to look at, never tried or pruned again):
    a restart loses a save interval instead of being refused until someone steps in. Any other
    failure (a file that would run code, one it cannot read), or no older snapshot that loads:
    every rank raises the newest one's error, and nothing is renamed.
    """
    if resume_point(directory) is None:  # rank 0 cleared killed saves' temps; all see it
        return None
    rank, world = _rank_world()
    names = [[p.name for _, p in reversed(list_snapshots(directory))] if rank == 0 else []]
    if group_active() and world > 1:
        dist.broadcast_object_list(names, src=0)
    candidates = [Path(directory) / name for name in names[0]]  # newest first
    errors: list[tuple[int, str]] = []
    for i, path in enumerate(candidates):
        state, mine = None, (0, "")
        try:
            state = load_checkpoint(path, map_location)
        except CheckpointError as exc:  # 1: damaged, try the one before; 2: stop
            mine = (1 if isinstance(exc, CorruptCheckpointError) else 2, str(exc))
        every = [mine]
        if group_active() and world > 1:
            every = [(0, "")] * world
            dist.all_gather_object(every, mine)
        worst = max(every)
        if worst[0] == 0:
            if rank == 0:
                for passed in candidates[:i]:
                    passed.rename(passed.with_name(passed.name + ".corrupt"))
            return path, state, candidates[:i]
        errors.append(worst)
        if worst[0] == 2:
            break
    kind, message = errors[0]
    if len(errors) > 1:
        message += f" (and the {len(errors) - 1} older snapshot(s) could not be loaded either)"
    raise (CorruptCheckpointError if kind == 1 else CheckpointError)(message)


def schedule_changes(
    saved: Mapping[str, Any], now: Mapping[str, Any], flags: tuple[str, ...] = SCHEDULE_FLAGS
) -> list[str]:
    """``["--epochs 3 -> 5", ...]``: flags of a resume that move the LR schedule under it (or
    others among ``flags``) since the snapshot's run."""
    return [
        f"--{k.replace('_', '-')} {saved[k]} -> {now.get(k)}"
        for k in flags
        if k in saved and saved[k] != now.get(k)
    ]


# ------------------------------------------------------------------ what each rank reads


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    num_replicas = _rank_world()[1] if num_replicas is None else num_replicas
    rank = _rank_world()[0] if rank is None else rank
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    return num_replicas, rank


class UnpaddedDistributedSampler(Sampler[int]):
    """Every index exactly once over all ranks (``order[r::N]``), for exact evaluation only:
    in training each rank must run the same number of backward passes (all_reduces)."""

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.length, self.shuffle, self.seed, self.epoch = len(dataset), shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=gen).tolist() if self.shuffle else None
        return iter((order or range(self.length))[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s shards, resumable mid-epoch on any world size.

    One seeded order per epoch, the same on every rank, padded with its own start to a
    multiple of the world size (DistributedSampler's padding); rank r of N takes positions
    r, r+N, ...: after k steps of batch B the job consumed the first k*B*N positions,
    whatever N was. ``set_epoch(epoch, consumed)`` starts there, dealing exactly what the
    uninterrupted epoch would have. When another world size took over the epoch at position
    ``since`` (a resume on more or fewer ranks), the positions from there on are padded
    instead, with their own start, to a multiple of the new world size."""

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.length, self.seed, self.shuffle = len(dataset), seed, shuffle
        self.epoch, self.consumed, self.since = 0, 0, 0

    def set_epoch(self, epoch: int, consumed: int = 0, since: int = 0) -> None:
        """Start ``epoch`` after its first ``consumed`` samples (all ranks, padding included),
        ``since``: the position at which this world size took the epoch over (0: it began it)."""
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        if not 0 <= since <= consumed:
            raise ValueError(f"need 0 <= since <= consumed, got since={since}, consumed={consumed}")
        if since < self.length and (consumed - since) % self.num_replicas:  # unequal shards
            raise ValueError(
                f"{consumed - since} samples since this world size took over is not a multiple "
                f"of its {self.num_replicas} ranks: was the epoch begun on another world size? "
                "Pass since= the position where this one took over"
            )
        self.epoch, self.consumed, self.since = epoch, consumed, min(since, self.length)

    def _positions(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=gen).tolist() if self.shuffle else None
        tail = list(order or range(self.length))[self.since :]
        if tail and (padding := -len(tail) % self.num_replicas):
            tail += (tail * math.ceil(padding / len(tail)))[:padding]
        return tail[self.consumed - self.since :]

    def __iter__(self) -> Iterator[int]:
        return iter(self._positions()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        tail = math.ceil((self.length - self.since) / self.num_replicas) * self.num_replicas
        return math.ceil(max(0, tail - (self.consumed - self.since)) / self.num_replicas)


def rank_seed(seed: int, rank: int, *streams: int) -> int:
    """A 63-bit seed from ``(seed, rank, *streams)`` (``seed + rank`` would collide)."""
    words = np.random.SeedSequence([seed, rank, *streams]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), Python's ``random`` and numpy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def loader_generator(seed: int, rank: int, epoch: int = 0) -> torch.Generator:
    """A DataLoader ``generator``: worker seeds that depend on ``(seed, rank, epoch)`` only."""
    return torch.Generator().manual_seed(rank_seed(seed, rank, epoch, 1))


def _installed(module: str) -> bool:
    """Whether ``module`` was imported from site-packages (found there from any folder)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    return file is not None and any(
        Path(file).is_relative_to(folder) for folder in site.getsitepackages()
    )


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A DataLoader worker from the fork server, whose one limit of its own is named: the
    server hands the worker each tensor of the dataset as a file descriptor, and at most
    ``MAXFDS_TO_SEND`` (256) of them; beyond, Python says only "too many fds"."""

    def start(self) -> None:
        try:
            super().start()
        except ValueError as exc:
            if "too many fds" not in str(exc):
                raise
            raise DataError(
                f"a DataLoader worker cannot start: the dataset holds more tensors than the "
                f"fork server can hand a worker ({multiprocessing.forkserver.MAXFDS_TO_SEND} "
                f"file descriptors at most). Keep the samples in a few large tensors (one "
                f"flat tensor and the offsets), or call torch.multiprocessing."
                f"set_sharing_strategy('file_system') at the top of train.py, or --num-workers 0"
            ) from exc


class _WorkerContext(multiprocessing.context.ForkServerContext):
    Process = _WorkerProcess


def worker_context(
    num_workers: int, dataset: object = None
) -> multiprocessing.context.BaseContext | None:
    """How DataLoader workers start: from a fork server, not forked from the rank.

    A rank has threads (gloo's, the previous loader's queue feeders); a fork taken while one
    of them holds a lock of the interpreter leaves the child stuck in ``os.fork()`` forever:
    on CPython 3.11 about 1 run in 50 of a two-worker job hung so on a loaded host, its rank
    waiting for the batch. The server is a fresh process that imports torch, this file and
    the installed package of ``dataset``'s class once (torchvision's for an ImageFolder or
    CIFAR10), so each worker still starts in milliseconds; a plain forkserver would import
    them in every worker, at every epoch (about a second each for torchvision). Your own
    modules are not preloaded: before CPython 3.12.8 and 3.13.1 (gh-117378) the server looks
    names up in the folder it was started from, not the script's, where a module of the same
    name could stand. The script itself (``__main__``, where your Dataset class may be) stays
    on the list, as Python's default has it: a CPython with gh-126631 (3.14; 3.13 since late
    2025) imports it once in the server; older ones skip it, and each worker imports the
    script (not measured here: no such Python). The first call starts the server: give it
    the training set. Each worker receives the dataset pickled: tensors travel as shared
    memory (a file descriptor each: a dataset of more than about 250 tensors is refused, with
    what to do), anything else (a list, a numpy array) is copied into every worker."""
    if num_workers == 0 or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = _WorkerContext()
    layers = [dataset]  # and a Subset's, a split's, a wrapper's own dataset, all the way in
    while (inner := getattr(layers[-1], "dataset", None)) is not None and len(layers) < 10:
        layers.append(inner)
    installed = {m for d in layers if _installed(m := type(d).__module__)}
    context.set_forkserver_preload(["__main__", "torch", __name__, *sorted(installed)])
    # A preemption signals the whole process group, the server too: killed, its workers
    # would end and fail the rank before it saves. Started with the signals blocked (a
    # mask kept through fork and exec), it ends with its rank instead. Its resource tracker
    # first: starting one unblocks SIGTERM (multiprocessing's own mask dance).
    multiprocessing.resource_tracker.ensure_running()
    atexit.unregister(_kill_workers)  # once, however many loaders
    atexit.register(_kill_workers)  # runs before multiprocessing's own exit handler
    blocked = {getattr(signal, name) for name in SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return context


def _kill_workers() -> None:
    """At exit, the workers a crash left running: the traceback keeps their loader alive, they
    ignore SIGTERM (seed_worker), and multiprocessing's exit handler would terminate() them,
    then join() for ever: the rank would never end, and torchrun never restart the job."""
    for child in multiprocessing.active_children():
        child.kill()


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: a worker leaves preemption to its rank, and a dataset that keeps a
    generator gets the worker's own seed (``reseed``).

    A scheduler signals every process of the job: a worker killed by SIGTERM makes its
    rank raise "DataLoader worker ... killed by signal" before the rank can save. Ignored
    in the worker, the rank saves, then shuts its workers down itself.

    A rank killed outright (SIGKILL: the OOM killer, a scheduler's second signal) shuts down
    nothing. torch's own check in the worker watches the worker's parent, here the fork
    server, which lives on as long as a worker does: the worker would wait for batches for
    ever, holding its memory. A thread waits on the rank itself and ends the worker with it."""
    if (rank := multiprocessing.parent_process()) is not None:  # in a worker, not the rank
        for name in SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        threading.Thread(target=_end_with, args=(rank,), daemon=True).start()
    info = torch.utils.data.get_worker_info()
    if info is not None and callable(reseed := getattr(info.dataset, "reseed", None)):
        reseed(info.seed)


def _end_with(rank: multiprocessing.process.BaseProcess) -> None:
    """In a DataLoader worker: wait until the rank is gone, then end (what it would have sent
    has no reader left)."""
    rank.join()
    os._exit(0)


# ------------------------------------------------------------------ joining, one decision


def job_store(rank: int, world_size: int, timeout_s: float = 600) -> tuple[dist.Store, int]:
    """``(store, attempt)``: this (re)start's own keys, and its number, agreed by every node.

    torchrun's agent store outlives a restart: keys of the last attempt point at dead
    ranks, and each node's agent counts only its own restarts. Rank 0 takes the next value
    of a counter and hands it to each rank under a key named by a token that rank just
    made up (a key no earlier attempt wrote). Without a store to share
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) each attempt's store is new, its keys fresh
    anyway, and the number is rank 0's ``TORCHELASTIC_RESTART_COUNT`` (on several nodes it
    can miss a restart another node caused). Call it on every rank before init."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not shared,
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=not shared,
    )
    root = STORE_ROOT
    if rank == 0:
        counted = store.add(f"{root}/attempts", 1) - 1
        attempt = counted if shared else int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        pending, answered = set(range(1, world_size)), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                if store.check([f"{root}/{attempt}/joined/{r}"]):
                    pending.discard(r)
                elif store.check([f"{root}/hello/{r}"]):
                    token = store.get(f"{root}/hello/{r}").decode()
                    if answered.get(r) != token:  # an old token too: nobody waits on it
                        store.set(f"{root}/answer/{token}", str(attempt))
                        answered[r] = token
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(pending)[:8]} did not reach the job's store "
                    f"within {timeout_s:g} s (attempt {attempt}); did they start?"
                )
            time.sleep(0.005 if pending else 0)
    else:
        token = uuid.uuid4().hex
        store.set(f"{root}/hello/{rank}", token)
        attempt = int(store.get(f"{root}/answer/{token}"))
        store.set(f"{root}/{attempt}/joined/{rank}", "1")
    return dist.PrefixStore(f"{root}/{attempt}", store), attempt


class BackendError(RuntimeError):
    """The requested backend cannot run here; the message says what to use."""


def choose_backend(
    requested: str, local_world_size: int, gpus: int | None = None
) -> tuple[str, str]:
    """``(backend, reason)``: "auto" is nccl when every local rank can have a GPU, else gloo;
    an explicit nccl that cannot work raises now, not as a hang later."""
    if (requested := requested.lower()) not in {"auto", "gloo", "nccl"}:
        raise BackendError(f"backend must be 'auto', 'gloo' or 'nccl', got {requested!r}")
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "gloo":
        return "gloo", "gloo requested"
    if requested == "nccl":
        if not dist.is_nccl_available():
            raise BackendError(
                "backend 'nccl' requested but this PyTorch build has no NCCL "
                "(CPU-only or non-Linux build). Use backend='gloo'."
            )
        if gpus < local_world_size:
            raise BackendError(
                f"backend 'nccl' needs one CUDA GPU per local rank: {local_world_size} local "
                f"rank(s) but {gpus} visible GPU(s). Use backend='gloo' (CPU), or start at most "
                f"{gpus} processes per node (torchrun --nproc-per-node {gpus})."
                if gpus
                else "backend 'nccl' needs CUDA GPUs, and this process sees none "
                "(torch.cuda.is_available() is False). Use backend='gloo' to train on the CPU."
            )
        return "nccl", "nccl requested"
    if gpus == 0:
        return "gloo", "no CUDA GPU visible: gloo on CPU"
    if gpus < local_world_size:
        return "gloo", (
            f"{gpus} GPU(s) for {local_world_size} local ranks: gloo on CPU "
            "(nccl needs one GPU per rank)"
        )
    if not dist.is_nccl_available():
        return "gloo", "this PyTorch build has no NCCL: gloo"
    return "nccl", f"{gpus} GPU(s) for {local_world_size} local rank(s): nccl"


def agree_backends(choices: list[str]) -> tuple[str, str]:
    """One backend from each rank's own choice: nodes that chose differently would hang."""
    if len(set(choices)) == 1:
        return choices[0], f"every rank chose {choices[0]}"
    without = [r for r, c in enumerate(choices) if c != "nccl"]
    return "gloo", (
        f"the nodes disagree: ranks {without} cannot use nccl (no GPU of their own), "
        f"so every rank uses gloo on the CPU. Give every rank a GPU, or ask for the "
        f"same backend on every node."
    )


def agreed_backend(
    requested: str, rank: int, world_size: int, local_world_size: int, store: dist.Store
) -> tuple[str, str]:
    """:func:`choose_backend` for this node, agreed with the other nodes through ``store``;
    a node whose GPUs go unused says so once."""
    name, reason = choose_backend(requested, local_world_size)
    if requested == "auto" and world_size > local_world_size:
        store.set(f"backend/{rank}", name)
        choices = [store.get(f"backend/{r}").decode() for r in range(world_size)]
        agreed, why = agree_backends(choices)
        name, reason = agreed, reason if agreed == name else why
    if (warning := fallback_warning(requested, name, reason)) and rank % local_world_size == 0:
        print(warning, file=sys.stderr, flush=True)
    return name, reason


def fallback_warning(requested: str, backend: str, reason: str) -> str | None:
    """A loud line when "auto" runs on the CPU although this machine has GPUs."""
    if requested != "auto" or backend != "gloo" or not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    return (
        f"WARNING: this node has {gpus} GPU(s), but the job runs on the CPU with gloo "
        f"({reason}). Start at most {gpus} ranks per node (torchrun --nproc-per-node {gpus}) "
        f"to train on them."
    )


def set_collective_timeout(timeout_s: float) -> None:
    """The collectives' timeout once everyone joined: a missing rank fails in ``timeout_s``.
    gloo honours it from torch 2.9 (on 2.4-2.8 its collectives keep the group's timeout)."""
    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:  # torch < 2.14: the same call under its private name
        from torch.distributed.distributed_c10d import _set_pg_timeout as set_timeout
    set_timeout(timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Verdict:
    """What every rank does after a check (the same on every rank)."""

    stop: bool  # a signal arrived on some rank: save and exit
    save: bool  # a timed snapshot is due
    signal: str | None = None


def next_agreement(at: int, seconds: float, every: int, within_s: float) -> int:
    """The next step (or batch) at which the ranks agree, after agreeing at ``at``: ``every``
    later at most, and soon enough to come within ``within_s`` when each takes ``seconds``
    (the same numbers on every rank: they come out of the agreement's all_reduce)."""
    fits = int(within_s / seconds) if seconds > 0 else every
    return at + max(1, min(every, fits))


class StopCheck:
    """A signal, a loss gone inf/nan, a timed save: noticed by one rank, acted on by all.

    The signal handler only sets a flag; at agreed steps (or ``force``: before a save or an
    evaluation) one small all_reduce makes it every rank's decision, so every rank saves (or
    stops) at the same step. The first step agrees, then every ``every`` steps, or fewer
    when steps are slow: the all_reduce carries the seconds a step took, and the next
    agreement comes within ``within_s`` of this one (a SIGTERM must be saved inside the
    scheduler's grace, 30 s for torchrun and SLURM). ``clock``: seconds, monotonic."""

    def __init__(
        self,
        device: torch.device,
        every: int = 10,
        save_minutes: float = 0.0,
        clock: Any = time.monotonic,
        within_s: float = 5.0,
    ):
        self.device, self.every, self.save_s, self.clock = device, every, save_minutes * 60, clock
        self.within_s = within_s
        self.received: int | None = None
        self.first_bad = torch.full((), math.inf, dtype=torch.float64, device=device)
        self.last_save = clock()
        self.next_step = 0  # the first step agrees: it measures a step (set-up included)
        self.last: tuple[int | None, float] = (None, clock())  # (step, time) of the last one
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame: object) -> None:  # only a flag: safe anywhere
        self.received = signum

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """After each step: the first step whose loss was not finite, kept on the device."""
        now = torch.full((), float(step), dtype=torch.float64, device=self.device)
        worse = torch.minimum(self.first_bad, now)
        self.first_bad = torch.where(loss.detach().isfinite(), self.first_bad, worse)

    def saved(self) -> None:
        """A snapshot was written: the timed interval starts again."""
        self.last_save = self.clock()

    def check(
        self, step: int, force: bool = False, params: Iterable[torch.Tensor] | None = None
    ) -> Verdict:
        """At the agreed step (or ``force``), agree across ranks; ``params``: weights
        checked too. Raises :class:`DivergedError` on every rank at once."""
        if not force and step < self.next_step:
            return Verdict(False, False)
        finite = [p.detach().isfinite().all().to(self.device) for p in params or ()]
        if finite and not torch.stack(finite).all():  # one host sync, whatever the devices
            self.first_bad.fill_(min(float(step), self.first_bad.item()))
        now = self.clock()
        due = self.save_s > 0 and now - self.last_save >= self.save_s
        since, then = self.last
        step_s = (now - then) / (1 if since is None else max(step - since, 1))
        mine = [self.received or 0, due, step_s]
        flags = torch.cat([torch.tensor(mine, dtype=torch.float64, device=self.device),
                           -self.first_bad.reshape(1)])  # fmt: skip
        if group_active() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        received, due_any, step_s, bad = flags.tolist()  # the same numbers on every rank
        self.next_step = next_agreement(step, step_s, self.every, self.within_s)
        self.last = (step, now)
        if math.isfinite(bad):
            raise DivergedError(
                f"the loss, the weights or the buffers stopped being finite at step {int(-bad)}: "
                f"every rank stops before saving them (any snapshot in --checkpoint-dir is from "
                f"before). "
                f"Lower --lr, keep --clip-grad on, use --warmup, or look for a bad batch there"
            )
        name = signal.Signals(int(received)).name if received else None
        return Verdict(stop=name is not None, save=bool(due_any), signal=name)


def average_buffers(module: nn.Module) -> float:
    """Every rank's buffers made equal in one all_reduce: norm statistics averaged (each rank
    ran its own shard through BatchNorm), every other buffer rank 0's exactly (a counter, a
    constant). Call it on every rank before evaluating or saving; returns how far they moved."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    ignored = set(getattr(inner, "_ddp_params_and_buffers_to_ignore", ()))  # meant to differ
    buffers, averaged = [], []
    for prefix, sub in inner.named_modules():
        norm = isinstance(sub, nn.modules.batchnorm._NormBase)
        for name, buffer in sub.named_buffers(prefix=prefix, recurse=False):
            if buffer is not None and name not in ignored and not buffer.is_complex():
                buffers.append(buffer)
                averaged.append(norm and name.rsplit(".", 1)[-1] in NORM_STATISTICS)
    rank, world = _rank_world()
    if not buffers or world == 1:
        return 0.0
    flat = torch.cat(
        [
            b.detach().reshape(-1).double()
            if avg or rank == 0
            else torch.zeros(b.numel(), dtype=torch.float64, device=b.device)
            for b, avg in zip(buffers, averaged, strict=True)
        ]
    )
    dist.all_reduce(flat)  # a copy from rank 0 is its value plus the others' zeros
    moved, offset = [], 0
    for buffer, avg in zip(buffers, averaged, strict=True):
        new = flat[offset : offset + buffer.numel()].view_as(buffer)
        new, offset = new / world if avg else new, offset + buffer.numel()
        moved.append((new - buffer.double()).abs().max() if buffer.numel() else flat.new_zeros(()))
        buffer.copy_(new)
    return torch.stack(moved).max().item()


# ------------------------------------------------------------------ exact evaluation


@dataclass(frozen=True)
class EvalResult:
    """Metrics over every rank's samples and this rank's share: ``count`` is target elements
    (samples x outputs for a multi-output regression). Targets that are not class indices (a
    regression's) have no accuracy: ``nan``, ``correct`` 0."""

    accuracy: float
    loss: float
    correct: int
    count: int
    local_count: int
    interrupted: bool = False  # ``stop`` said so on some rank: partial sums, not a score


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device``: a tensor, or the tensors in its tuples, lists and dicts, so
    that a collate_fn may give the model (tokens, lengths) or a dict of tensors."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def counted_targets(target: torch.Tensor, loss_fn: Any = None) -> torch.Tensor:
    """What a mean loss divides by, float64 on the target's device (no host sync): the number
    of targets, class indices equal to the loss's ``ignore_index`` (-100 by default: padding)
    left out, as cross_entropy leaves them out; with class weights (``weight``), the sum of
    the counted targets' weights, its weighted mean's divisor. Float targets: every element."""
    if getattr(loss_fn, "reduction", "mean") != "mean":
        raise DataError(
            f"loss_fn has reduction={loss_fn.reduction!r}: the template weighs each "
            f"micro-batch's mean by its share of the step's targets; use reduction='mean'"
        )
    if target.is_floating_point():
        return torch.full((), float(target.numel()), dtype=torch.float64, device=target.device)
    # a mask, not target[mask]: a selection's size is known only on the host (a GPU sync
    # before every forward); ignored targets read weight[0], then count 0
    counted = target != getattr(loss_fn, "ignore_index", -100)
    if (weight := getattr(loss_fn, "weight", None)) is not None:
        weight = weight.to(target.device, torch.float64)
        return (weight[torch.where(counted, target, 0)] * counted).sum()
    return counted.sum(dtype=torch.float64)


@torch.no_grad()
def local_sums(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device,
    amp: torch.dtype | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    class_dim: int = 1,
    prediction: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[correct, count, loss_sum, loss_divisor]`` over one loader, float64 (exact counts).
    ``loss_fn``: training's, a mean over a batch's targets (default: cross-entropy); its sum is
    that mean times :func:`counted_targets` (a weighted loss: their weights). ``prediction``:
    what of the model's output is scored, for a model that returns a dict or a tuple (the
    loss, as in training, receives the whole output). Accuracy is the
    argmax's over ``class_dim`` for class indices (integers, one dimension fewer than the
    scores); other targets (a regression's) count ``nan`` correct: an argmax compared with them
    would broadcast into a number that means nothing. A class target equal to the loss's
    ``ignore_index`` (-100 by default: a sequence's padding) is not a sample: not counted, not
    scored, as in the loss."""
    model = unwrap_model(model)  # a DDP forward may sync buffers: a collective not all join
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    ignored = getattr(loss_fn, "ignore_index", -100)  # cross_entropy's default, as below
    try:
        for x, y in loader:
            x, y = to_device(x, device), y.to(device)
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                output = model(x)
            logits = output if prediction is None else prediction(output)
            if not isinstance(logits, torch.Tensor):
                raise DataError(
                    f"the model returns a {type(logits).__name__}, not a tensor of scores: set "
                    f"PREDICTION in train.py to what holds them (lambda out: out['logits'])"
                )
            count = y.numel()
            if not y.is_floating_point() and logits.dim() == y.dim() + 1:
                kept = y != ignored
                sums[0] += ((logits.argmax(dim=_class_dim(logits, y, class_dim)) == y) & kept).sum()
                count = kept.sum()
            elif not _outgrows(logits, y):
                sums[0] = math.nan
            else:  # (B, 1) against (B,): the loss would broadcast to B x B pairs, silently
                raise DataError(
                    f"the model's outputs {tuple(logits.shape)} and the targets "
                    f"{tuple(y.shape)} differ in shape: make them equal (y.view_as(output))"
                )
            sums[1] += count
            divisor = counted_targets(y, loss_fn)  # of the loss's mean: what training weighs by
            sums[3] += divisor
            if loss_fn is None:
                scores = logits.float().movedim(class_dim, 1)  # where cross_entropy takes them
                sums[2] += nn.functional.cross_entropy(scores, y, reduction="sum").double()
            elif divisor:  # a mean over the batch's counted targets, times their number
                scored = logits.float() if prediction is None else output  # training's input
                sums[2] += loss_fn(scored, y).double() * divisor
    finally:
        model.train(was_training)
    return sums


def check_scoring(
    model: nn.Module,
    dataset: Dataset,
    device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **scoring: Any,
) -> None:
    """Score two samples of ``dataset`` as the evaluation will (:func:`local_sums`, its
    ``scoring`` keywords), before training: outputs the evaluation cannot score (a dict, a shape
    the loss would broadcast) stop the run in seconds with a :class:`DataError`, not after an
    epoch of training that nothing saved."""
    from torch.utils.data import default_collate

    if scoring.get("loss_fn") is not None:
        given = scoring["loss_fn"]
        scoring["loss_fn"] = lambda output, target: _backward_checked(given, output, target)
    if len(dataset):
        batch = (collate_fn or default_collate)([dataset[i] for i in range(min(2, len(dataset)))])
        local_sums(model, [batch], device, **scoring)


def _backward_checked(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], output: Any,
                      target: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The loss, and its backward into a detached copy of the outputs (the model untouched): a
    target dtype the backward refuses ("Found dtype Long but expected Float": a regression's
    integer or float64 targets) stops the run before training, named, not in its first step."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return loss_fn(output, target)
    with torch.enable_grad():
        leaf = output.detach().requires_grad_()
        loss = loss_fn(leaf, target)
        try:
            loss.backward()
        except RuntimeError as exc:
            raise DataError(
                f"the loss's backward refuses these targets ({_first_line(str(exc))}): the "
                f"outputs are {output.dtype}, the targets {target.dtype} - return targets the "
                "loss takes from your Dataset (a regression's: float32, .float(); class "
                "indices: int64)"
            ) from None
    return loss.detach()


def _class_dim(scores: torch.Tensor, target: torch.Tensor, dim: int) -> int:
    """``dim``, where the classes are in ``scores`` (1: (B, C, T) as cross_entropy takes them;
    -1: (B, T, C) as a language model gives them, its loss flattening both), once the other
    dimensions are the target's: declared, not guessed, since (B, T, C) with T == C fits both.
    Scores that do not fit are named, not broadcast."""
    others = scores.shape[:1] + scores.shape[2:] if dim == 1 else scores.shape[:-1]
    if others != target.shape:
        raise DataError(
            f"the model's outputs {tuple(scores.shape)} do not score the targets "
            f"{tuple(target.shape)} with the classes at dimension {dim}: CLASS_DIM in train.py "
            f"says where they are (1: (B, C, ...); -1: (B, ..., C))"
        )
    return dim


def _outgrows(output: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a loss of the two would broadcast the targets to more elements (or cannot)."""
    try:
        return math.prod(torch.broadcast_shapes(output.shape, target.shape)) > target.numel()
    except RuntimeError:
        return True


def agreed_batches(
    loader: Iterable[Any],
    stop: Callable[[], bool],
    shared: int,
    stopped: torch.Tensor,
    every: int = 10,
    within_s: float = 5.0,
) -> Iterator[Any]:
    """``loader``'s batches until ``stop()`` is true on any rank: one small all_reduce (MAX)
    before batch 0, 1, then every ``every`` batches or sooner, so that the next comes within
    ``within_s`` (it carries a batch's seconds, the same on every rank); only among the first
    ``shared`` batches, which every rank has (an uneven split leaves some ranks one more). A
    stop sets ``stopped`` and ends every rank's batches at the same one: a rank that stopped
    alone would wait in the next collective while the others evaluate on."""
    next_at, since, then = 0, 0, time.monotonic()
    for i, batch in enumerate(loader):
        if i == next_at and i < shared:
            now = time.monotonic()
            mine = [float(stop()), (now - then) / max(i - since, 1) if i else 0.0]
            flags = torch.tensor(mine, dtype=torch.float64, device=stopped.device)
            if group_active() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop_any, batch_s = flags.tolist()
            if stop_any:
                stopped.fill_(1)
                return
            nxt = next_agreement(i, batch_s, every, within_s) if i else 1  # 0: measure one
            next_at, since, then = nxt, i, time.monotonic()  # batches only: not a peer's lag
        yield batch


def distributed_evaluate(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    *,
    exact: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    amp: torch.dtype | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    stop: Callable[[], bool] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    class_dim: int = 1,
    prediction: Callable[[Any], torch.Tensor] | None = None,
) -> EvalResult:
    """Accuracy and mean loss over ``dataset``, split across the ranks, each sample counted
    once (``exact``: no padding, one all_reduce of the sums); a collective.
    ``exact=False`` is the naive padded DistributedSampler, which counts repeats twice.
    ``collate_fn``: training's (sequences of different lengths padded into one batch);
    ``class_dim``, ``prediction``: where the model's output holds the scores (:func:`local_sums`).
    ``stop`` (given on every rank, or on none): a SIGTERM's flag, agreed on as training's
    :class:`StopCheck` does (:func:`agreed_batches`): every rank stops at the same batch and the
    result says ``interrupted``, so that a long evaluation never eats the preemption's grace
    period before the snapshot."""
    from torch.utils.data.distributed import DistributedSampler

    device, (rank, world) = torch.device(device), _rank_world()
    sampler: Sampler[int] = (
        UnpaddedDistributedSampler(dataset, world, rank)
        if exact
        else DistributedSampler(dataset, world, rank, shuffle=False)
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        worker_init_fn=seed_worker,
        multiprocessing_context=worker_context(num_workers, dataset),
        generator=torch.Generator(),  # its own: evaluating leaves training's RNG alone
    )
    stopped = torch.zeros(1, dtype=torch.float64, device=device)
    shared = -(-(len(dataset) // world if exact else len(sampler)) // batch_size)  # every rank's
    batches = loader if stop is None else agreed_batches(loader, stop, shared, stopped)
    scored = local_sums(model, batches, device, amp, loss_fn, class_dim, prediction)
    sums = torch.cat([scored, stopped])
    local_count = int(sums[1])
    if group_active():
        dist.all_reduce(sums)
    correct, count, loss_sum, divisor, interrupted = (float(v) for v in sums.cpu())
    nan = float("nan")
    return EvalResult(
        correct / count if count else nan,
        loss_sum / divisor if divisor else nan,  # training's mean, over every rank's targets
        0 if math.isnan(correct) else int(correct),
        int(count),
        local_count,
        interrupted > 0,
    )


# ------------------------------------------------------------------ the model and the data


class MLP(nn.Module):
    """Flatten, two hidden layers, logits."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks with BatchNorm (buffers that differ per rank), pooling, a linear head."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def resnet18(num_classes: int, image_size: int = 32) -> nn.Module:
    """torchvision's resnet18, random weights; below 64 px a 3x3 stride-1 stem (CIFAR-style)."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    if image_size < 64:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def build_model(
    name: str, num_classes: int, image_size: int = 32, in_channels: int = 3
) -> nn.Module:
    """One of :data:`MODEL_NAMES` for ``in_channels x image_size x image_size`` inputs."""
    if name == "mlp":
        return MLP(in_channels * image_size * image_size, num_classes)
    if name == "cnn":
        return SmallCNN(in_channels, num_classes)
    if name == "resnet18" and in_channels == 3:
        return resnet18(num_classes, image_size)
    raise ValueError(f"unknown model {name!r} for {in_channels} channels; one of {MODEL_NAMES}")


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Learnable images, no download: class c is a coloured stripe pattern plus noise.

    Sample i is a pure function of ``(seed, i)``: the same on every rank and every epoch.
    Class recipes do not depend on ``seed``: seed 0 trains, seed 1 validates."""

    def __init__(
        self,
        num_samples: int = 2048,
        image_size: int = 32,
        num_classes: int = 10,
        channels: int = 3,
        seed: int = 0,
        difficulty: float = 1.0,
    ):
        if num_samples < 1 or image_size < 4 or num_classes < 2 or channels < 1:
            raise ValueError(
                "SyntheticImages needs num_samples >= 1, image_size >= 4, num_classes >= 2, "
                f"channels >= 1; got {num_samples}, {image_size}, {num_classes}, {channels}"
            )
        self.num_samples, self.image_size, self.num_classes = num_samples, image_size, num_classes
        self.channels, self.seed, self.difficulty = channels, seed, difficulty
        gen = torch.Generator().manual_seed(10_007 * num_classes + channels)
        n_orient, c = max(2, math.ceil(num_classes / 2)), torch.arange(num_classes)
        self.angles = math.pi * (c % n_orient).float() / n_orient
        self.freqs = torch.where(c < n_orient, 1 / 8, 1 / 4)  # cycles per pixel
        self.colors = torch.rand(num_classes, channels, generator=gen) * 1.5 + 0.25
        gen.manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=gen)
        coords = torch.arange(image_size, dtype=torch.float32)
        self._yy, self._xx = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        label = int(self.labels[index])
        gen = torch.Generator().manual_seed(1_000_003 * self.seed + index)
        phase, contrast, jitter = torch.rand(3, generator=gen)
        angle = self.angles[label] + (jitter - 0.5) * 0.2
        proj = self._xx * torch.cos(angle) + self._yy * torch.sin(angle)
        stripes = torch.sin(2 * math.pi * (self.freqs[label] * proj + phase))
        color = self.colors[label] * (0.8 + 0.4 * torch.rand(self.channels, generator=gen))
        image = (0.6 + 0.6 * contrast) * stripes * color[:, None, None]
        noise = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        return image + self.difficulty * noise, label


def check_image_folder(root: PathLike, rank: int = 0, world_size: int = 1) -> list[str]:
    """The classes of ``root/train`` after checking the layout, and the headers of this rank's
    share of the files (``[rank::world_size]``: together the ranks open each file once)."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.datasets.folder import IMG_EXTENSIONS

    root, hint = Path(root), "expected DIR/train/<class>/*.png|jpg and DIR/val/<class>/*.png|jpg"
    if not root.is_dir():
        raise DataError(f"--data-dir {root}: no such folder ({hint})")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(f"--data-dir {root}: no {split}/ folder inside ({hint})")

    def classes(split: str) -> list[str]:
        return sorted(p.name for p in (root / split).iterdir() if p.is_dir() and p.name[0] != ".")

    if len(names := classes("train")) < 2:
        raise DataError(f"--data-dir {root}: train/ needs at least 2 class folders ({hint})")
    files = []
    for split in ("train", "val"):
        for name in names:
            found = sorted(  # as ImageFolder walks: into linked folders too (rglob does not)
                Path(folder, file)
                for folder, _, names in os.walk(root / split / name, followlinks=True)
                for file in names
                if Path(file).suffix.lower() in IMG_EXTENSIONS
            )
            if not found:
                raise DataError(
                    f"--data-dir {root}: class {name!r} has no images in {split}/ "
                    f"(every class of train/ needs {split}/{name}/ with .png or .jpg "
                    f"files)"
                )
            files += found
    for path in files[rank::world_size]:
        try:
            with Image.open(path) as image:  # the header only
                image.size  # noqa: B018
        except (UnidentifiedImageError, OSError) as exc:
            raise DataError(
                f"--data-dir: {path} is not a readable image ({exc}); delete or replace it"
            ) from None
    if extra := sorted(set(classes("val")) - set(names)):
        raise DataError(f"--data-dir {root}: val/ has classes that train/ lacks: {extra}")
    return names


def load_image(path: str) -> Any:
    """ImageFolder's loader, naming the file it cannot decode. The check at the start reads
    headers only: a file cut short (a copy that stopped) passes it, and fails when its pixels
    are read, mid-epoch, where PIL says "image file is truncated" and not which file."""
    from torchvision.datasets.folder import pil_loader

    try:
        return pil_loader(path)
    except OSError as exc:
        if exc.errno is not None:  # no such file, permission, an I/O error: not the image
            raise
        raise DataError(f"{path} cannot be decoded ({exc}); delete or replace it") from None


def _transforms(image_size: int, train: bool) -> Any:
    from torchvision import transforms as T

    steps = (
        [T.RandomResizedCrop(image_size, scale=(0.6, 1.0)), T.RandomHorizontalFlip()]
        if train
        else [T.Resize(image_size), T.CenterCrop(image_size)]
    )
    return T.Compose([*steps, T.ToTensor(), T.Normalize(MEAN, STD)])


def image_folder(
    root: PathLike, image_size: int, rank: int = 0, world_size: int = 1
) -> tuple[Dataset, Dataset, int]:
    """``(train, val, num_classes)`` from a checked ImageFolder layout."""
    from torchvision.datasets import ImageFolder

    classes, root = check_image_folder(root, rank, world_size), Path(root)
    train = ImageFolder(root / "train", transform=_transforms(image_size, True), loader=load_image)
    val = ImageFolder(root / "val", transform=_transforms(image_size, False), loader=load_image)
    for split, found in (("train", train.classes), ("val", val.classes)):
        if found != classes:  # ImageFolder counts hidden folders (.ipynb_checkpoints) as classes
            raise DataError(
                f"--data-dir {root}: {split}/ has the class folders {found}, the check expected "
                f"{classes}: remove the others (hidden ones too), or labels would shift"
            )
    return train, val, len(classes)


def cifar10(root: PathLike | None, image_size: int, download: bool) -> tuple[Any, Any, int]:
    """CIFAR-10 from ``root``; a clear :class:`DataError` when it is not there."""
    from torchvision.datasets import CIFAR10

    if root is None:
        raise DataError("--data cifar10 needs --data-dir: the folder that holds (or will hold) it")
    try:
        train, val = (
            CIFAR10(root, train=s, download=download, transform=_transforms(image_size, s))
            for s in (True, False)
        )
    except OSError as exc:  # --download without a network (URLError)
        raise DataError(
            f"--data cifar10 --download: {exc}. Download it where there is a network and copy "
            f"the folder to {root}"
        ) from None
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted. ..."
        raise DataError(
            f"--data cifar10: no intact copy in {root} ({exc}). Add --download to "
            f"fetch it once (needs internet; one process: torchrun --nproc-per-node "
            f"1 ... --download --max-steps 1)"
        ) from None
    return train, val, 10


def build_datasets(args: Any, rank: int = 0, world_size: int = 1) -> tuple[Dataset, Dataset, int]:
    """``(train, val, num_classes)`` for the flags data, data_dir, download, image_size and,
    synthetic, num_samples, num_val, num_classes, seed."""
    kind = args.data or ("folder" if args.data_dir else "synthetic")
    if kind == "folder":
        if args.data_dir is None:
            raise DataError("--data folder needs --data-dir DIR (DIR/train/<class>/…, DIR/val/…)")
        return image_folder(args.data_dir, args.image_size, rank, world_size)
    if kind == "cifar10":
        return cifar10(args.data_dir, args.image_size, args.download)
    try:
        return (
            SyntheticImages(args.num_samples, args.image_size, args.num_classes, seed=args.seed),
            SyntheticImages(args.num_val, args.image_size, args.num_classes, seed=args.seed + 1),
            args.num_classes,
        )
    except ValueError as exc:
        raise DataError(
            f"synthetic data: {exc} (--num-samples, --image-size, --num-classes)"
        ) from None


# ------------------------------------------------------------------ the step's tools


def amp_dtype(
    device: torch.device, amp: str | bool | None, native_bf16: Any = None
) -> torch.dtype | None:
    """The autocast dtype for ``--amp`` (None without it); bfloat16 refused where a GPU only
    emulates it (V100, T4: slower than float32; use fp16 with a GradScaler there)."""
    if not amp:
        return None
    if amp == "fp16":
        return torch.float16
    if amp not in (True, "bf16"):
        raise ValueError(f"--amp must be bf16 or fp16, got {amp!r}")
    native = native_bf16 or (lambda: torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type == "cuda" and not native():
        raise ValueError(
            "--amp trains in bfloat16, which this GPU does not support natively (compute "
            "capability below 8.0, e.g. V100 or T4): it would be emulated, slower than "
            "float32. Use --amp fp16 (float16 with a GradScaler), or no --amp."
        )
    return torch.bfloat16


def make_deterministic() -> dict[str, object]:
    """Deterministic kernels from here on (before the first CUDA call: cuBLAS reads its
    workspace setting once); an op without a deterministic version then raises. One a
    template may meet: cross_entropy on CUDA over scores of more than two dimensions
    (``CLASS_DIM = 1`` with (B, C, T): nll_loss2d, in torch's list of ops that raise); the
    same loss over the scores flattened to (N, C) and the targets to (N,) runs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True)
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cudnn.deterministic": True,
        "cudnn.benchmark": False,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def comm_hook(name: str, start_powersgd_iter: int = 1000) -> tuple[Any, Any]:
    """``(state, hook)`` for ``ddp.register_comm_hook``: gradients compressed on the wire."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("fp16", "bf16"):
        return None, getattr(default_hooks, f"{name}_compress_hook")
    if name == "powersgd":  # exact all_reduces until start_powerSGD_iter (its default warm-up)
        return powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=start_powersgd_iter
        ), powerSGD_hook.powerSGD_hook
    raise ValueError(f"--comm-hook must be one of {COMM_HOOKS[1:]} (or none), got {name!r}")


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum 0.9), no decay on biases and norm weights; fused: a few
    multi-tensor kernels instead of several per parameter, and GradScaler.step skips an
    inf/nan step on the device (no host sync)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    fused_or_default = True if fused else None
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=fused_or_default)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, fused=fused_or_default)
    raise ValueError(f"optimizer must be adamw or sgd, got {name!r}")


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to 0."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def set_lr(optimizer: torch.optim.Optimizer, lr: float, peak: float) -> None:
    """``lr`` times each group's own multiple of ``peak`` (``lr_scale``, saved with the
    optimizer: a resume on another world size keeps every group's ratio)."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("lr_scale", group["lr"] / peak if peak else 1.0) * lr


class TrainLog:
    """Rank 0's line every ``every`` steps: the window's mean loss over every rank, LR, grad
    norm, training samples/s (evaluating and saving paused), GPU memory; TensorBoard.

    ``sums`` is the loop's own ``[loss sum, targets]`` tensor: the window is what it gained
    since the last line (the loop zeroes it at each epoch's end, after :meth:`epoch_end`:
    a window that spans the end keeps the old epoch's last steps), so a step costs the log
    nothing but a modulo; a line costs an all_reduce of 2 numbers and a host sync."""

    def __init__(
        self,
        rank: int,
        every: int,
        global_batch: int,
        directory: str | None = None,
        sums: torch.Tensor | None = None,
        window: Iterable[float] = (0.0, 0.0),
        purge_step: int | None = None,
    ):
        self.main, self.every, self.global_batch = rank == 0, every, global_batch
        self.mark = sums.detach().clone() if sums is not None else torch.zeros(2)
        self.mark -= torch.tensor(list(window), dtype=self.mark.dtype, device=self.mark.device)
        self.carry = torch.zeros_like(self.mark)  # the last epoch's steps since the last line
        self.seconds, self.steps, self.last = 0.0, 0, time.perf_counter()
        self.writer: Any = None
        if directory and self.main:
            from torch.utils.tensorboard import SummaryWriter  # pip install tensorboard

            self.writer = SummaryWriter(directory, purge_step=purge_step)  # a resume's: drop
            # what the last attempt logged after its snapshot, or each later step shows twice

    def pause(self) -> None:
        """Evaluating or saving is not training: the clock stops until :meth:`resume`."""
        self.seconds += time.perf_counter() - self.last

    def resume(self) -> None:
        self.last = time.perf_counter()

    def epoch_end(self, sums: torch.Tensor) -> None:
        """Before the loop zeroes ``sums`` for a new epoch: keep what the window has so far."""
        self.carry = self.carry.to(sums.device) + sums.detach() - self.mark.to(sums.device)
        self.mark = torch.zeros_like(self.carry)

    def window(self, sums: torch.Tensor) -> torch.Tensor:
        """This rank's [loss sum, targets] since the last line: a snapshot keeps them (summed
        over the ranks) so that the first line after a resume is the whole window's mean."""
        return self.carry.to(sums.device) + sums.detach() - self.mark.to(sums.device)

    def step(self, step: int, sums: torch.Tensor, lr: float, norm: torch.Tensor | None) -> None:
        """After optimizer step ``step``; when due, call it on EVERY rank (an all_reduce)."""
        self.steps += 1
        if step % self.every:
            return
        window = self.window(sums)
        self.mark, self.carry = sums.detach().clone(), torch.zeros_like(window)
        if group_active():
            dist.all_reduce(window)
        mean = (window[0] / window[1].clamp(min=1)).item()
        seconds = self.seconds + time.perf_counter() - self.last
        rate = self.steps * self.global_batch / seconds if seconds > 0 else math.nan
        self.seconds, self.steps, self.last = 0.0, 0, time.perf_counter()
        if not self.main:
            return
        grad = f"{norm.item():.3g}" if norm is not None else "off"
        memory = ""
        if torch.cuda.is_initialized():  # is_available() would ask the CUDA driver (lesson 01)
            memory = f", {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB max allocated"
        print(f"step {step}: loss {mean:.4f}, lr {lr:.4g}, grad norm {grad}, {rate:.0f} "
              f"samples/s{memory}", flush=True)  # fmt: skip
        norms = {"grad_norm": norm.item()} if norm is not None else {}
        self.scalars(step, loss=mean, lr=lr, samples_per_sec=rate, **norms)

    def scalars(self, step: int, prefix: str = "train", **values: float) -> None:
        """TensorBoard scalars (rank 0, with a directory); nothing otherwise."""
        for key, value in values.items():
            if self.writer is not None:
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
