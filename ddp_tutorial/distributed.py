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
import random
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
from ddp_tutorial._kit import kit
from ddp_tutorial.settings import env_int
from ddp_tutorial.stores import exchange, job_store

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
BackendError = kit.BackendError
choose_backend = kit.choose_backend
set_collective_timeout = kit.set_collective_timeout
fallback_warning = kit.fallback_warning
agree_backends = kit.agree_backends
average_buffers = kit.average_buffers
NORM_STATISTICS = kit.NORM_STATISTICS


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous endpoint).

    Here because a world of one needs it (:func:`setup` without torchrun);
    the launcher uses the same function for multi-node rendezvous endpoints.
    The port is bound seconds later, by torchrun: one the kernel hands out for ``bind(0)``
    or an outgoing connection (its ephemeral range) could be taken by then by any socket of
    any process (every gloo group and TCPStore binds port 0), so on Linux it is picked below
    that range, where only a port asked for by number lands.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's pick
        low = 1024
    for port in random.Random().sample(
        range(max(1024, low - 12000), low), max(0, min(200, low - 1024))
    ):
        if port in (29400, 29500):  # the defaults of torchrun's rendezvous and MASTER_PORT
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
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
