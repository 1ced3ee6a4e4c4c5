"""Checkpoints that survive DDP: one atomic writer, safe loading, exact resume.

Three things go wrong when every rank of a DDP job calls ``torch.save``:

* **Concurrent writers.** Every rank (or, with seed 000's ``local_rank == 0``
  guard, one rank per node) opens the same path on a shared disk and writes it
  at the same time. The file that is left can interleave bytes from different
  writers: a load fails (``PytorchStreamReader failed …``, seed 000's
  "storage has wrong size") or, worse, silently returns a mix of two states.
* **Crashes mid-save.** ``torch.save(obj, path)`` truncates ``path`` first and
  then writes it; a process killed in between leaves neither the old nor the
  new checkpoint, only a file cut short.
* **Unsafe loading.** ``torch.load`` unpickles, and unpickling can run any
  code the file names. ``weights_only=True`` only rebuilds tensors and plain
  Python values, so checkpoints must contain nothing else.

This module is what every script in the course uses:

* :func:`save_checkpoint` — call it on **every** rank; only global rank 0 writes,
  atomically (temp file, fsync, ``os.replace``), then all ranks learn its outcome:
  nobody reads early, and a failure on rank 0 is raised on every rank, not a hang.
* :func:`load_checkpoint` — ``weights_only=True`` and ``map_location``;
  every problem becomes a :class:`CheckpointError` that names the file and says
  what is wrong (missing, truncated/corrupt, an object ``weights_only`` refuses).
* :func:`load_model_state` — strips ``module.`` (DDP/DataParallel) and
  ``_orig_mod.`` (``torch.compile``) with torch's
  ``consume_prefix_in_state_dict_if_present`` and checks keys strictly,
  listing missing/unexpected keys and shape mismatches.

What goes *into* a resumable checkpoint (optimizer, position, RNG states) and how
snapshot folders are kept is :mod:`ddp_tutorial.snapshots`; this module makes files safe.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import uuid
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddp_tutorial.models import unwrap_model

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Prefixes added by wrappers: DDP/DataParallel ``module.``, ``torch.compile`` ``_orig_mod.``."""

TEMP_SUFFIX = ".tmp"

PathLike = str | os.PathLike[str]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the problem."""


# --------------------------------------------------------------------------- plain types


_PLAIN_SCALARS = (str, int, float, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)


def find_unsafe(obj: Any, where: str = "state") -> list[str]:
    """Where ``obj`` holds something other than tensors and plain Python values.

    ``torch.load(..., weights_only=True)`` rebuilds only tensors, dicts, lists,
    tuples, sets and scalars; anything else (an ``argparse.Namespace``, a
    dataclass, a numpy array, a model object) is refused at load time. Checking
    before saving turns a resume that fails weeks later into an error now.
    Returns ``["state['args'] is argparse.Namespace", ...]`` (empty when safe).
    """
    problems: list[str] = []
    # Exact types: np.float64 is a float subclass, yet weights_only refuses it.
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN_SCALARS:
        return problems
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if find_unsafe(key):  # a tuple of plain values is a fine key; an object is not
                problems.append(f"{where} has a key of type {type(key).__qualname__}")
            problems += find_unsafe(value, f"{where}[{key!r}]")
        return problems
    if type(obj) in (list, tuple, set):  # not frozenset: weights_only refuses it
        for i, value in enumerate(obj):
            problems += find_unsafe(value, f"{where}[{i}]")
        return problems
    cls = type(obj)
    problems.append(f"{where} is {cls.__module__}.{cls.__qualname__}")
    return problems


# --------------------------------------------------------------------------- saving


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    with contextlib.suppress(OSError):  # some platforms/filesystems cannot open directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Sink:
    """A file keeping its OSError (disk full...): torch's zip writer says "unexpected pos"."""

    def __init__(self, file: Any):
        self.file, self.error, self.flush = file, None, file.flush

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise


def temp_path_for(path: PathLike) -> Path:
    """A unique temporary name next to ``path`` (same directory: ``os.replace`` stays atomic):
    hidden, ending in ``.tmp`` (never a snapshot), with the writer's pid in it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def atomic_save(obj: Any, path: PathLike, check_plain: bool = True) -> Path:
    """Write ``obj`` to ``path`` so that ``path`` is always the old or the new file, never half.

    The bytes go to a temp file in the same directory; after ``flush`` + ``fsync`` it
    is renamed over ``path`` (``os.replace``: atomic on POSIX and Windows within one
    filesystem), then the directory is fsynced so the rename survives a power cut. A
    process killed at any point leaves the previous ``path`` untouched (and at worst a
    stale temp file). The single-process primitive; in a job: :func:`save_checkpoint`.
    """
    path = Path(path)
    if check_plain:
        problems = find_unsafe(obj)
        if problems:
            raise CheckpointError(
                f"refusing to save {path}: it must hold only tensors and plain Python values "
                f"(so that torch.load(weights_only=True) can read it back), but "
                + "; ".join(problems[:5])
                + ". Save the object's state instead (e.g. vars(args), model.state_dict())."
            )
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    # O_EXCL: never write into someone else's file; 0o666 & ~umask like a normal open().
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, sink)
            except RuntimeError as exc:  # the OS's own error names the cause
                raise sink.error or exc from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return path


def group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def save_checkpoint(path: PathLike, state: Any, check_plain: bool = True) -> Path:
    """Save ``state`` to ``path`` from global rank 0, atomically; a collective in a job.

    Call it on **every** rank: rank 0 writes with :func:`atomic_save`, then
    :func:`share_outcome`. Not ``local_rank == 0``: one writer per node, and nodes
    sharing a disk write one file at once. Other ranks may pass ``state=None``.
    """
    path, failure = Path(path), None
    if not group_active():
        return atomic_save(state, path, check_plain)
    if dist.get_rank() == 0:
        try:
            atomic_save(state, path, check_plain)
        except Exception as exc:  # reported to every rank below
            failure = exc
    share_outcome(failure, path)
    return path


def share_outcome(failure: BaseException | str | None, path: PathLike) -> None:
    """Rank 0's save outcome to every rank (a broadcast, after the save; call it on every rank).

    It is the barrier (nobody reads a half-written file) and, if rank 0 failed (disk
    full, a file-size limit), raises :class:`CheckpointError` with rank 0's error on
    every rank at once: a rank left in ``barrier()`` would wait out the timeout on nccl.
    """
    text = failure if isinstance(failure, str | None) else f"{type(failure).__name__}: {failure}"
    message = [text]
    if group_active() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise CheckpointError(f"rank 0 failed to save {path}: {message[0]}")


def is_save_epoch(epoch: int, epochs: int, every: int) -> bool:
    """Should the end of 0-based ``epoch`` (of ``epochs``) be saved, saving every ``every``?

    Seed 001 saves when ``epoch % save_epoch == 0 and epoch != 0``: with 100
    epochs and ``save_epoch=10`` it saves after epochs 10, 20, … 90 (0-based,
    so after 11, 21, … 91 epochs of training) and **never** the last nine:
    the final model is lost. Count finished epochs instead, and always save
    the last one.
    """
    if every < 1:
        raise ValueError(f"save interval must be >= 1 epoch, got {every}")
    if not 0 <= epoch < epochs:
        raise ValueError(f"epoch {epoch} is outside 0..{epochs - 1}")
    done = epoch + 1
    return done % every == 0 or done == epochs


# --------------------------------------------------------------------------- loading


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _refused_global(message: str) -> str | None:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    if match:
        return match.group(1)
    match = re.search(r"Unsupported operand \d+|Unsupported class ([\w.]+)", message)
    return match.group(0) if match else None


def _corrupt(path: Path, size: int, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} ({size} bytes) is truncated or corrupt — typically a process "
        f"killed while writing it, or several processes writing it at once (save from "
        f"global rank 0 only, atomically). torch says: {detail}"
    )


def load_checkpoint(
    path: PathLike,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> Any:
    """Load a checkpoint safely: ``weights_only=True``, tensors placed by ``map_location``.

    ``map_location``: ``"cpu"`` (default: load anywhere, move later), this
    rank's device (``info.device``), a dict such as ``{"cuda:0": "cuda:1"}``
    (seed 001: a file written by rank 0 opened on rank 1's GPU), or a callable.
    Every failure is a :class:`CheckpointError` naming the file and the problem.
    """
    path = _existing_file(path)
    size = path.stat().st_size
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(path, size, str(exc)) from None
    except EOFError:
        raise CheckpointError(
            f"checkpoint {path} is empty ({size} bytes): the writer was killed right after "
            f"opening it, or it is still being written by another process"
        ) from None
    except (RuntimeError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise _load_error(path, size, exc) from None
    except PermissionError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror}") from None
    except OSError as exc:  # e.g. EINVAL when the zip index points past the end of a cut file
        raise _corrupt(path, size, str(exc)) from None


def _existing_file(path: PathLike) -> Path:
    """``path`` if it is a file; otherwise an error that lists what the folder does hold."""
    path = Path(path)
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            others = sorted(p.name for p in path.parent.glob("*.pt"))[:8]
            hint = f" Checkpoints in {path.parent}: {', '.join(others)}." if others else ""
        elif not path.parent.exists():
            hint = f" (the directory {path.parent} does not exist either)"
        raise CheckpointError(f"checkpoint {path} does not exist.{hint}")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    return path


def _unpickling_error(path: Path, size: int, text: str) -> CheckpointError:
    """``weights_only`` refusing an object (say why that is a feature), or a corrupt file."""
    if "Weights only load failed" not in text:
        return _corrupt(path, size, _first_line(text))
    what = _refused_global(text) or "an object that is not a tensor or a plain value"
    return CheckpointError(
        f"checkpoint {path} holds {what}, which torch.load(weights_only=True) refuses "
        f"to rebuild. That refusal is a security feature: unpickling an arbitrary "
        f"object can run any code its author chose, so a downloaded or shared "
        f"checkpoint must never be loaded with weights_only=False unless you trust "
        f"whoever wrote it. Keep checkpoints to tensors and plain types (dicts, lists, "
        f"numbers, strings); if this file is your own, re-save it that way."
    )


def _load_error(path: Path, size: int, exc: Exception) -> CheckpointError:
    """torch's RuntimeError/KeyError/… in words: GPU tensors, legacy format, corruption."""
    text = str(exc)
    if "Attempting to deserialize object on a CUDA device" in text or (
        "CUDA" in text and "is_available" in text
    ):
        return CheckpointError(
            f"checkpoint {path} holds tensors saved on a GPU and this process has no CUDA "
            f"device for them: load it with map_location='cpu' (or this rank's device). "
            f"torch says: {_first_line(text)}"
        )
    if "legacy .tar format" in text:
        return CheckpointError(
            f"checkpoint {path} uses the tar format of the earliest torch releases, which "
            f"weights_only=True cannot read; re-save it with a current torch.save"
        )
    if (
        "PytorchStreamReader" in text
        or "does not match expected size" in text
        or isinstance(exc, KeyError | zipfile.BadZipFile)
    ):
        return _corrupt(path, size, _first_line(text) or type(exc).__name__)
    return CheckpointError(f"cannot load checkpoint {path}: {_first_line(text)}")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's ``state_dict()``: keys without ``module.``/``_orig_mod.``.

    What to save: it loads into a plain model on any machine, with or without DDP.
    """
    return unwrap_model(model).state_dict()


def strip_prefixes(
    state_dict: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` with wrapper prefixes removed, only where *every* key has one.

    Uses torch's ``consume_prefix_in_state_dict_if_present``, which — unlike
    seed 002's ``k[7:]`` — leaves a state_dict without the prefix alone
    instead of cutting seven characters off every key. Repeated until no
    prefix is left (a compiled model inside DDP gives ``module._orig_mod.``).
    """
    result: OrderedDict[str, Any] = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        result._metadata = metadata.copy()  # type: ignore[attr-defined]
    changed = True
    while changed and result:
        changed = False
        for prefix in prefixes:
            if all(str(k).startswith(prefix) for k in result):
                consume_prefix_in_state_dict_if_present(result, prefix)
                changed = True
    return result


def _looks_like_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values())


def describe_mismatch(
    model: nn.Module, state_dict: Mapping[str, Any], limit: int = 10
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, shape_mismatches)`` between a model and a state_dict."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state_dict.items()
        if k in expected
        and isinstance(v, torch.Tensor)
        and tuple(v.shape) != tuple(expected[k].shape)
    ]
    return missing, unexpected, shapes


def _listing(label: str, items: list[str], limit: int = 8) -> str:
    more = f" … and {len(items) - limit} more" if len(items) > limit else ""
    return f"{label} ({len(items)}): {', '.join(items[:limit])}{more}"


def load_model_state(
    model: nn.Module,
    source: PathLike | Mapping[str, Any],
    strict: bool = True,
    map_location: Any = "cpu",
    key: str = "model",
) -> tuple[list[str], list[str]]:
    """Load weights into ``model`` from a file or a dict; returns ``(missing, unexpected)``.

    ``source``: a path or an already-loaded object — a bare ``state_dict`` or
    a training state holding one under ``key`` ("model"). Wrapper prefixes are
    stripped (:func:`strip_prefixes`) and ``model`` may itself be wrapped
    (weights go into the unwrapped module). With ``strict`` (default) any
    missing/unexpected key or shape mismatch raises :class:`CheckpointError`
    listing them: usually a checkpoint of another architecture.
    """
    name = str(source) if isinstance(source, str | os.PathLike) else "the given state"
    obj = (
        load_checkpoint(source, map_location=map_location)
        if isinstance(source, str | os.PathLike)
        else source
    )
    if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
        obj = obj[key]
    if not _looks_like_state_dict(obj):
        kind = type(obj).__qualname__
        keys = list(obj)[:8] if isinstance(obj, Mapping) else []
        raise CheckpointError(
            f"{name} is not a model state_dict (got {kind}"
            + (f" with keys {keys}" if keys else "")
            + f"); expected a dict of tensors, or a training state with one under {key!r}"
        )
    state_dict = strip_prefixes(obj)
    target = unwrap_model(model)
    missing, unexpected, shapes = describe_mismatch(target, state_dict)
    if shapes or (strict and (missing or unexpected)):
        parts = [f"{name} does not fit {type(target).__name__}"]
        if missing:
            parts.append(_listing("missing keys", missing))
        if unexpected:
            parts.append(_listing("unexpected keys", unexpected))
        if shapes:
            parts.append(_listing("shape mismatches", shapes))
        parts.append("Is it a checkpoint of another architecture or configuration?")
        raise CheckpointError("; ".join(parts[:-1]) + ". " + parts[-1])
    target.load_state_dict(state_dict, strict=strict)
    return missing, unexpected


def stale_temp_files(directory: PathLike) -> list[Path]:
    """Temp files left by a writer that died mid-save (safe to delete when no save runs)."""
    found = Path(directory).iterdir() if Path(directory).is_dir() else ()
    return sorted(p for p in found if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX))
