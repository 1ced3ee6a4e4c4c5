"""Join (and leave) the process group that torchrun prepared for this rank.

torchrun hands every rank its identity through environment variables:
``RANK`` (global, unique across nodes), ``LOCAL_RANK`` (index on this node:
the one that picks the GPU), ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``. :func:`setup` reads them, chooses a backend,
binds the rank to its device *before* anything touches CUDA, and initialises
the process group with a short timeout so that a mistake fails in seconds
instead of the default 30 minutes (gloo's; nccl's is 10).

Run without torchrun (``python scripts/x.py``), :func:`setup` makes a world of
one process: the same script can be stepped through in a debugger.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_tutorial import settings
from ddp_tutorial.settings import env_int
from ddp_tutorial.stores import exchange, job_store


class BackendError(RuntimeError):
    """The requested backend cannot run here; the message says what to use."""


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the job, and where it computes."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device
    reason: str  # why this backend was chosen, in words

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(
    requested: str, local_world_size: int, gpus: int | None = None
) -> tuple[str, str]:
    """Pick ``(backend, reason)``.

    ``auto``: nccl when CUDA works and every local rank can have a GPU of its
    own; otherwise gloo on the CPU (a 1-GPU laptop still runs the 2-rank
    lessons, and says so). An explicit ``nccl`` that cannot work raises
    :class:`BackendError` now rather than a hang or a cryptic NCCL error later.
    ``gpus`` (visible GPU count) lets a caller that must not touch CUDA, such
    as the notebook kernel, pass the NVML count instead.
    """
    requested = requested.lower()
    if requested not in {"auto", "gloo", "nccl"}:
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


def setup(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment.

    ``backend``: "auto" (default, or ``$DDP_TUTORIAL_BACKEND``), "gloo" or
    "nccl". ``timeout_s`` (default ``$DDP_TUTORIAL_TIMEOUT``, 60 s) bounds how
    long a collective may wait: a rank that never arrives fails the job in
    seconds, not in the default 30 minutes (gloo; 10 on nccl). Joining gets longer
    (``$DDP_TUTORIAL_INIT_TIMEOUT``, 600 s): a slow ``import torch`` on a busy
    shared filesystem is not a bug. On GPUs the rank is bound to
    ``cuda:LOCAL_RANK`` twice over: ``set_device`` (where ``.cuda()`` and
    new tensors go) and ``device_id`` (the communicator is created for that
    device now, so an NCCL problem shows at init, not at the first collective).
    """
    if "RANK" not in os.environ:
        # Not under torchrun: a world of one, so the script runs in a debugger.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    timeout_s = settings.timeout_s() if timeout_s is None else timeout_s
    init_timeout_s = max(settings.init_timeout_s(), timeout_s)
    store = None
    if not dist.is_initialized():
        store, _ = job_store(rank, world_size, init_timeout_s)
    name, reason = job_backend(backend, rank, world_size, local_world_size, init_timeout_s, store)
    device = torch.device("cuda", local_rank) if name == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        # Bind first: otherwise every rank's first CUDA call lands on cuda:0.
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _import_before_init()
        dist.init_process_group(
            **init_options(name, device, init_timeout_s),
            rank=rank,
            world_size=world_size,
            store=store,  # this attempt's own keys (see ddp_tutorial.stores)
        )
        set_collective_timeout(timeout_s)
    return DistInfo(rank, local_rank, world_size, local_world_size, name, device, reason)


def job_backend(
    requested: str | None,
    rank: int,
    world_size: int,
    local_world_size: int,
    timeout_s: float | None = None,
    store: dist.Store | None = None,
) -> tuple[str, str]:
    """``(backend, reason)`` for this job: :func:`choose_backend`, agreed across nodes.

    ``requested`` None means ``$DDP_TUTORIAL_BACKEND`` or "auto". Every node
    of an "auto" multi-node job must end up with the same backend (else
    ``init_process_group`` hangs): the ranks exchange their choices through
    ``store`` (this attempt's, :func:`ddp_tutorial.stores.job_store`; made
    here when None). A machine whose GPUs go unused says so loudly, once per node.
    """
    requested = requested or settings.backend()
    name, reason = choose_backend(requested, local_world_size)
    if requested == "auto" and world_size > local_world_size:
        timeout_s = settings.init_timeout_s() if timeout_s is None else timeout_s
        store = store if store is not None else job_store(rank, world_size, timeout_s)[0]
        agreed, why = agree_backends(exchange(store, rank, world_size, name))
        if agreed != name and rank == 0:
            print(f"WARNING: {why}", file=sys.stderr, flush=True)
        name, reason = agreed, reason if agreed == name else why
    warning = fallback_warning(requested, name, reason)
    if warning and rank % max(local_world_size, 1) == 0:
        print(warning, file=sys.stderr, flush=True)
    return name, reason


def init_options(backend: str, device: torch.device, init_timeout_s: float) -> dict[str, Any]:
    """What :func:`setup` passes to ``init_process_group`` (a pure function, for tests).

    ``device_id`` only for a GPU: it binds the group to that device (and
    creates the NCCL communicator eagerly); it does *not* call ``set_device``.
    """
    options: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=init_timeout_s)}
    if device.type == "cuda":
        options["device_id"] = device
    return options


def set_collective_timeout(timeout_s: float) -> None:
    """The collectives' timeout, once everyone has joined (``dist.set_timeout``, torch 2.8+).

    Joining may take long (a slow ``import torch`` on a shared filesystem is
    not a bug); a collective that waits that long is one: a missing rank
    should fail the job in ``timeout_s``, not in the joining allowance.
    """
    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:  # older torch: the same call under its private name
        from torch.distributed.distributed_c10d import _set_pg_timeout as set_timeout
    set_timeout(timedelta(seconds=timeout_s))


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


def agree_backends(choices: list[str]) -> tuple[str, str]:
    """One backend for every rank, from each rank's own choice (a pure function).

    Each node decides "auto" from its own GPUs; two nodes that decide
    differently would hang in ``init_process_group``. Agreed: that backend.
    Not agreed: gloo everywhere (every node can run it), and the reason says
    which ranks could not use nccl.
    """
    if len(set(choices)) == 1:
        return choices[0], f"every rank chose {choices[0]}"
    without = [r for r, c in enumerate(choices) if c != "nccl"]
    return "gloo", (
        f"the nodes disagree: ranks {without} cannot use nccl (no GPU of their own), so "
        f"every rank uses gloo on the CPU. Give every rank a GPU, or set "
        f"{settings.BACKEND_ENV} to the same value on every node."
    )


def _import_before_init() -> None:
    """Import ``torch.distributed.nn`` while no process group exists yet.

    Its functions declare ``group=group.WORLD`` as a default argument, which
    Python evaluates once, at import. DDP's constructor imports the module
    (through ``torch._dynamo``), so in a normal script it is imported *after*
    ``init_process_group`` and its defaults hold the default group for the
    rest of the process: ``destroy_process_group`` can then never free it.
    gloo's worker threads stay alive into interpreter shutdown, and a worker
    that drops the last reference to a finished collective's tensor then
    needs the GIL; Python kills such a thread inside a C++ destructor and the
    rank dies with "terminate called without an active exception" (SIGABRT),
    after training succeeded. Imported first, the defaults are ``None``, and
    destroying the group really joins its threads while Python is alive.
    """
    try:
        import torch.distributed.nn  # noqa: F401
    except ImportError:  # a build without torch.distributed: nothing to pin either
        pass


def group_held_by_defaults() -> bool:
    """True when ``torch.distributed.nn``'s default arguments hold a process group.

    That is the leak :func:`_import_before_init` prevents. It looks without
    importing: importing the module after ``init_process_group`` is itself
    what would pin the group.
    """
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return False
    return any(isinstance(d, dist.ProcessGroup) for d in functional.all_reduce.__defaults__ or ())


def cleanup(barrier: bool = False) -> None:
    """Leave the process group (safe to call twice, or when setup failed).

    ``barrier``: first wait until every rank is done, so that no rank tears
    down its connections while a peer is still talking to it. Only on a
    normal exit: after an error the peers may never arrive.
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


@contextmanager
def process_group(backend: str | None = None, timeout_s: float | None = None) -> Iterator[DistInfo]:
    """``with process_group() as info:`` — :func:`cleanup` runs on every exit path."""
    info = setup(backend, timeout_s)
    try:
        yield info
    except BaseException:
        cleanup()
        raise
    cleanup(barrier=True)


BACKEND_THREAD_PREFIXES = ("gloo", "pt_gloo", "pt_nccl")
"""Names PyTorch gives a process group's own threads (gloo's I/O loop and workers, nccl's)."""


def backend_threads(settle_s: float = 0.0) -> list[str] | None:
    """Names of this process's process-group threads; ``None`` off Linux.

    After :func:`cleanup` the list should be empty: a group that outlives
    ``destroy_process_group`` keeps its threads into interpreter shutdown
    (see :func:`_import_before_init`). Read from ``/proc/self/task``.
    ``settle_s``: wait up to that long for the list to empty, because a
    thread that has just been joined can stay listed for a moment while the
    kernel removes it (a group that was never freed stays listed).
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    deadline = time.monotonic() + settle_s
    while True:
        names: list[str] = []
        for task in tasks.iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except OSError:  # the thread ended while we looked
                continue
        found = sorted(n for n in names if n.startswith(BACKEND_THREAD_PREFIXES))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def wrap(model: nn.Module, device: torch.device, **options: Any) -> DistributedDataParallel:
    """The one correct way to wrap: move to this rank's device first, then ``DDP(...)``.

    A GPU module gets ``device_ids=[its device]`` and ``output_device`` (its one
    device); a CPU module takes no ``device_ids`` at all (DDP refuses them).
    ``options`` go to DDP (``bucket_cap_mb``, ``find_unused_parameters``, ...).
    """
    model = model.to(device)
    if device.type == "cuda":
        options = {"device_ids": [device.index], "output_device": device.index, **options}
    return DistributedDataParallel(model, **options)


NORM_STATISTICS = ("running_mean", "running_var")


def average_buffers(module: nn.Module) -> float:
    """Every rank's buffers made equal, in one collective: norm statistics averaged, rest rank 0's.

    BatchNorm's running statistics are updated by each rank's own forward
    passes, so with ``broadcast_buffers=False`` they follow each rank's shard
    (with ``True``, DDP copies rank 0's at the *start* of every forward, and
    after the last step they differ again). Evaluation and checkpoints must
    see one model: call this on every rank before evaluating or saving. Only
    ``running_mean``/``running_var`` of normalisation layers (``_NormBase``:
    BatchNorm, SyncBatchNorm, InstanceNorm with running stats) are averaged —
    the average has seen every rank's data. Every other buffer is taken from
    rank 0 exactly: averaging a constant (a rotary ``inv_freq``) changes it by
    a rounding step at 3 or 7 ranks, a counter must stay an integer, an
    observer's min/max is not a mean. Buffers named in DDP's
    ``_ddp_params_and_buffers_to_ignore`` are meant to differ per rank and are
    left alone. One flat float64 all_reduce carries everything (a copy from rank
    0 is the sum of its value and the others' zeros), and one ``.item()``
    returns how far this rank's buffers moved (0.0: they already agreed).
    """
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    ignored = set(getattr(inner, "_ddp_params_and_buffers_to_ignore", ()))
    buffers, averaged = [], []
    for prefix, sub in inner.named_modules():
        norm = isinstance(sub, nn.modules.batchnorm._NormBase)
        for name, buffer in sub.named_buffers(prefix=prefix, recurse=False):
            if buffer is not None and name not in ignored and not buffer.is_complex():
                buffers.append(buffer)
                averaged.append(norm and name.rsplit(".", 1)[-1] in NORM_STATISTICS)
    world = dist.get_world_size()
    if not buffers or world == 1:
        return 0.0
    first = dist.get_rank() == 0
    flat = torch.cat([b.detach().reshape(-1).double() if avg or first
                      else torch.zeros(b.numel(), dtype=torch.float64, device=b.device)
                      for b, avg in zip(buffers, averaged, strict=True)])  # fmt: skip
    dist.all_reduce(flat)  # SUM, then divide: any backend, any torch
    moved, offset = [], 0
    for buffer, avg in zip(buffers, averaged, strict=True):
        new = flat[offset : offset + buffer.numel()].view_as(buffer)
        new = new / world if avg else new
        offset += buffer.numel()
        moved.append((new - buffer.double()).abs().max() if buffer.numel() else flat.new_zeros(()))
        buffer.copy_(new)
    return torch.stack(moved).max().item()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous endpoint).

    Here because a world of one needs it (:func:`setup` without torchrun);
    the launcher uses the same function for multi-node rendezvous endpoints.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_rank() -> int:
    """Global rank: from the process group if initialised, else from the environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_int("RANK", 0)


def is_main_process() -> bool:
    """True on global rank 0 — the one process that writes files and prints."""
    return get_rank() == 0


def print0(*args: object, **kwargs: object) -> None:
    """``print`` on global rank 0 only (flushed, so it shows up live)."""
    if is_main_process():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)  # type: ignore[call-overload]
