"""Which GPUs a process can see, without touching CUDA.

Everything here is either a pure function of strings and integers or a read of
NVML (the library behind ``nvidia-smi``). Nothing initialises CUDA, so the
notebook kernel and the launcher can call these freely: a CUDA context created
in the parent would pin memory on GPU 0 and make ``CUDA_VISIBLE_DEVICES`` set
later useless (seed 002's "2 MB on every card").

Physical ids are the ones ``nvidia-smi`` prints. Logical ids are what a process
sees after ``CUDA_VISIBLE_DEVICES``: ``"5,6,7"`` makes physical 5 appear as
``cuda:0``, 6 as ``cuda:1`` and 7 as ``cuda:2``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_VAR = "CUDA_VISIBLE_DEVICES"


class DeviceError(ValueError):
    """A device specification that CUDA would misread or that names no GPU."""


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML reports it."""

    index: int  # physical id, as nvidia-smi numbers it
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split a ``CUDA_VISIBLE_DEVICES`` value into its entries.

    Returns ``None`` when the variable is unset (every GPU is visible) and
    ``[]`` for the empty string (no GPU is visible: a deliberate way to force
    CPU). Entries are integer ids (``"5"``) or UUIDs (``"GPU-…"``, ``"MIG-…"``).

    CUDA is silent about mistakes: it stops reading at the first invalid entry,
    so ``"0,-1,1"`` quietly means ``"0"``. We refuse such values with a message
    that says what CUDA would have done instead.
    """
    if value is None:
        return None
    if value.strip() == "":
        return []
    entries = value.split(",")
    seen: set[str] = set()
    out: list[str] = []
    for position, raw in enumerate(entries):
        entry = raw.strip()
        if entry != raw:
            raise DeviceError(
                f"{ENV_VAR}={value!r}: entry {raw!r} has spaces around it. "
                f"Write the ids without spaces, e.g. {','.join(e.strip() for e in entries)!r}."
            )
        if entry == "":
            raise DeviceError(
                f"{ENV_VAR}={value!r}: empty entry at position {position}. "
                "CUDA stops reading there; remove the stray comma."
            )
        if entry.upper().startswith(("GPU-", "MIG-")):
            key = entry.upper()
        else:
            try:
                number = int(entry)
            except ValueError:
                raise DeviceError(
                    f"{ENV_VAR}={value!r}: {entry!r} is neither a GPU index nor a UUID "
                    "(GPU-… / MIG-…). CUDA would ignore it and every entry after it."
                ) from None
            if number < 0:
                raise DeviceError(
                    f"{ENV_VAR}={value!r}: {entry!r} is negative. CUDA reads a negative id as "
                    "'stop here', so the GPUs after it would be hidden. To hide every GPU "
                    f"set {ENV_VAR}='' (empty)."
                )
            key = str(number)
            entry = key
        if key in seen:
            raise DeviceError(
                f"{ENV_VAR}={value!r}: {entry!r} appears twice. A GPU can be listed once; "
                "CUDA would fail to enumerate the devices."
            )
        seen.add(key)
        out.append(entry)
    return out


def _resolve(entry: str, inventory: Sequence[GpuInfo] | int) -> int:
    """Physical index of one parsed entry, checked against what exists."""
    count = inventory if isinstance(inventory, int) else len(inventory)
    if entry.upper().startswith(("GPU-", "MIG-")):
        if isinstance(inventory, int):
            raise DeviceError(f"cannot resolve UUID {entry!r} without the NVML inventory")
        for gpu in inventory:
            if gpu.uuid.upper().startswith(entry.upper()):
                return gpu.index
        raise DeviceError(f"{ENV_VAR}: no GPU on this machine has UUID {entry!r}")
    index = int(entry)
    if index >= count:
        raise DeviceError(
            f"{ENV_VAR}: GPU {index} does not exist; this machine has {count} GPU(s) "
            f"(physical ids 0..{count - 1})."
        )
    return index


def logical_to_physical(value: str | None, inventory: Sequence[GpuInfo] | int) -> list[int]:
    """Physical ids in logical order: element ``i`` is what ``cuda:i`` really is.

    ``inventory`` is the machine's GPU list (or just its count). With the
    variable unset the mapping is the identity.
    """
    entries = parse_visible_devices(value)
    count = inventory if isinstance(inventory, int) else len(inventory)
    if entries is None:
        return list(range(count))
    return [_resolve(entry, inventory) for entry in entries]


def physical_to_logical(value: str | None, inventory: Sequence[GpuInfo] | int) -> dict[int, int]:
    """``{physical id: logical id}`` for the GPUs this process can see."""
    return {phys: logical for logical, phys in enumerate(logical_to_physical(value, inventory))}


def device_for_local_rank(local_rank: int, visible_count: int) -> str:
    """The device a rank should use: ``cuda:LOCAL_RANK``, never the global rank.

    The global rank (``dist.get_rank()``, seed 000's choice) counts across
    nodes: rank 2 on a second 2-GPU node would ask for ``cuda:2``, which does
    not exist there. Returns ``"cpu"`` when no GPU is visible.
    """
    if local_rank < 0:
        raise DeviceError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    if visible_count == 0:
        return "cpu"
    if local_rank >= visible_count:
        raise DeviceError(
            f"local rank {local_rank} needs a GPU of its own but only {visible_count} "
            f"are visible: start at most {visible_count} processes per node "
            f"(torchrun --nproc-per-node {visible_count}) or widen {ENV_VAR}."
        )
    return f"cuda:{local_rank}"


def gpu_inventory() -> list[GpuInfo]:
    """All physical GPUs via NVML; ``[]`` where there is no driver.

    NVML does not create a CUDA context, so this is safe in the notebook
    kernel and in the launcher.
    """
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but be forgiving
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else name,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    memory_total_mib=mem.total / 2**20,
                    memory_used_mib=mem.used / 2**20,
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def visible_gpus(env: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """The GPUs a process started with ``env`` would see, in logical order."""
    env = os.environ if env is None else env
    inventory = gpu_inventory()
    if not inventory:
        return []
    return [inventory[i] for i in logical_to_physical(env.get(ENV_VAR), inventory)]


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """How many GPUs a process started with ``env`` would see (0 without a driver)."""
    return len(visible_gpus(env))
