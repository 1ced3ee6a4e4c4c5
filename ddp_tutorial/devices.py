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
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ddp_tutorial.settings import DEVICE_ORDER_ENV, VISIBLE_DEVICES_ENV


class DeviceError(ValueError):
    """A device specification that CUDA would misread or that names no GPU."""


class MigError(DeviceError):
    """MIG is on for a GPU a launch would use: the machine, not a typo; the CPU plan applies."""


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML reports it."""

    index: int  # physical id, as nvidia-smi numbers it
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float
    mig: bool = False  # MIG mode on: CUDA shows its instances, never the whole GPU
    capability: tuple[int, int] | None = None  # CUDA compute capability, (8, 0) for an A100
    exclusive: bool = False  # compute mode EXCLUSIVE_PROCESS: one process (context) per GPU


UUID_PREFIXES = ("GPU-", "MIG-")


def cuda_reading(value: str | None) -> list[str] | None:
    """What CUDA itself makes of a ``CUDA_VISIBLE_DEVICES`` value — mistakes included.

    A model of the driver's parser (the same one ``torch.cuda`` uses to count
    devices without initialising CUDA): ``None`` when unset (every GPU);
    whitespace around an entry is skipped; an index is read like ``strtoul``,
    so ``"1gpu"`` is GPU 1; the first invalid or negative entry ends the list
    (``"0,-1,1"`` is just GPU 0); a repeated entry hides *every* GPU; a UUID
    list stops at the first entry without the prefix it started with.
    """
    if value is None:
        return None
    if value.startswith(UUID_PREFIXES):
        prefix = value[:4]
        uuids: list[str] = []
        for elem in value.split(","):
            if elem in uuids:
                return []
            if not elem.startswith(prefix):
                break
            uuids.append(elem)
        return uuids
    ids: list[str] = []
    for elem in value.split(","):
        match = re.match(r"[+-]?\d+", elem.strip())
        number = int(match.group()) if match else -1
        if str(number) in ids:
            return []
        if number < 0:
            break
        ids.append(str(number))
    return ids


def _refuse(value: str, problem: str) -> DeviceError:
    seen = cuda_reading(value)
    what = "no GPU at all" if not seen else f"only {','.join(seen)!r}"
    return DeviceError(
        f"{VISIBLE_DEVICES_ENV}={value!r}: {problem} CUDA would silently see {what}."
    )


def parse_visible_devices(value: str | None) -> list[str] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, or a clear error.

    Returns ``None`` when the variable is unset (every GPU is visible) and
    ``[]`` for ``""`` or ``"-1"`` (no GPU: the deliberate way to force the CPU).
    Entries are integer ids (``"5"``) or UUIDs (``"GPU-…"``, ``"MIG-…"``);
    spaces around entries are accepted and removed because CUDA skips them too
    (seed 000 writes ``"0, 1, 2"``, and that works).

    CUDA never complains about a mistake: it stops reading at the first bad
    entry and hides every GPU when one is repeated (see :func:`cuda_reading`).
    Every value that CUDA would read differently from what it says is refused
    here, with a message that names the entry and what CUDA would have done.
    """
    if value is None:
        return None
    if value.strip() in ("", "-1"):
        return []
    entries = [raw.strip() for raw in value.split(",")]
    kinds = {e[:4] if e.startswith(UUID_PREFIXES) else "index" for e in entries if e}
    if len(kinds) > 1:
        raise _refuse(
            value,
            "mixes GPU indices and UUIDs (or GPU- and MIG- UUIDs); use one kind per list.",
        )
    out: list[str] = []
    for position, entry in enumerate(entries):
        if entry == "":
            raise _refuse(value, f"empty entry at position {position} (a stray comma).")
        if entry.startswith(UUID_PREFIXES):
            if len(entry) == 4:
                raise _refuse(value, f"{entry!r} is a UUID prefix with nothing after it.")
        elif entry.upper().startswith(UUID_PREFIXES):
            raise _refuse(value, f"{entry!r}: UUIDs start with 'GPU-' or 'MIG-' in upper case.")
        elif re.fullmatch(r"[+-]?\d+", entry) is None:
            raise _refuse(value, f"{entry!r} is neither a GPU index nor a UUID (GPU-… / MIG-…).")
        elif int(entry) < 0:
            raise _refuse(
                value,
                f"{entry!r} is negative, and CUDA stops reading at a negative id. "
                f"To hide every GPU set {VISIBLE_DEVICES_ENV}='' (or '-1' on its own).",
            )
        else:
            entry = str(int(entry))
        if entry in out:
            raise _refuse(value, f"{entry!r} appears twice; list each GPU once.")
        out.append(entry)
    if out != cuda_reading(value):  # e.g. spaces before a UUID, which CUDA does not skip
        raise _refuse(
            value,
            "CUDA reads this value differently from how it is written "
            "(it skips spaces around numeric ids, not around UUIDs).",
        )
    return out


def _resolve(entry: str, inventory: Sequence[GpuInfo] | int) -> int:
    """Physical index of one parsed entry, checked against what exists."""
    count = inventory if isinstance(inventory, int) else len(inventory)
    if entry.startswith(UUID_PREFIXES):
        if isinstance(inventory, int):
            raise DeviceError(f"cannot resolve UUID {entry!r} without the NVML inventory")
        if entry.startswith("MIG-"):  # a MigError: the lessons then run on the CPU
            raise MigError(
                f"{VISIBLE_DEVICES_ENV}: {entry!r} is a MIG instance, not a whole GPU. CUDA "
                "shows a process one MIG instance at most, so one node cannot run several "
                "ranks on them; the course runs one rank per whole GPU. List whole GPUs "
                "(indices or GPU- UUIDs), or run one single-rank job per instance."
            )
        # CUDA accepts any unique prefix of a UUID.
        found = [gpu.index for gpu in inventory if gpu.uuid.startswith(entry)]
        if len(found) > 1:
            raise DeviceError(f"{VISIBLE_DEVICES_ENV}: UUID prefix {entry!r} matches GPUs {found}")
        if not found:
            raise DeviceError(f"{VISIBLE_DEVICES_ENV}: no GPU on this machine has UUID {entry!r}")
        return found[0]
    index = int(entry)
    ids = list(range(count)) if isinstance(inventory, int) else [g.index for g in inventory]
    if index not in ids:
        listed = f"0..{count - 1}" if ids == list(range(count)) else ", ".join(map(str, ids))
        raise DeviceError(
            f"{VISIBLE_DEVICES_ENV}: GPU {index} does not exist; this machine has {count} GPU(s)"
            + (f" (physical ids {listed})." if count else ".")
        )
    return index


def logical_to_physical(value: str | None, inventory: Sequence[GpuInfo] | int) -> list[int]:
    """Physical ids in logical order: element ``i`` is what ``cuda:i`` really is.

    ``inventory`` is the machine's GPU list (or just its count). With the
    variable unset the mapping is the identity. Physical ids are nvidia-smi's,
    which CUDA follows only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical
    GPUs (see :func:`order_matches_nvidia_smi`).
    """
    entries = parse_visible_devices(value)
    if entries is None:
        return (
            list(range(inventory)) if isinstance(inventory, int) else [g.index for g in inventory]
        )
    return [_resolve(entry, inventory) for entry in entries]


def physical_to_logical(value: str | None, inventory: Sequence[GpuInfo] | int) -> dict[int, int]:
    """``{physical id: logical id}`` for the GPUs this process can see."""
    return {phys: logical for logical, phys in enumerate(logical_to_physical(value, inventory))}


def mapping_table(value: str | None, inventory: Sequence[GpuInfo] | int) -> list[dict[str, object]]:
    """One row per visible GPU: the device name a process uses and the card it really is."""
    return [
        {VISIBLE_DEVICES_ENV: value, "device": f"cuda:{logical}", "physical (nvidia-smi)": phys}
        for logical, phys in enumerate(logical_to_physical(value, inventory))
    ]


def device_order(env: Mapping[str, str] | None = None) -> str:
    """``CUDA_DEVICE_ORDER`` as CUDA applies it: ``FASTEST_FIRST`` unless set."""
    env = os.environ if env is None else env
    order = env.get(DEVICE_ORDER_ENV, "FASTEST_FIRST") or "FASTEST_FIRST"
    if order not in ("FASTEST_FIRST", "PCI_BUS_ID"):
        raise DeviceError(f"{DEVICE_ORDER_ENV}={order!r}: must be 'FASTEST_FIRST' or 'PCI_BUS_ID'")
    return order


def order_matches_nvidia_smi(env: Mapping[str, str] | None, inventory: Sequence[GpuInfo]) -> bool:
    """Whether CUDA's ids are nvidia-smi's ids on this machine.

    nvidia-smi numbers GPUs by PCI bus; CUDA by default puts the fastest
    first. They agree with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or when every
    GPU is the same model (ties keep PCI order). On a mixed box without it,
    ``CUDA_VISIBLE_DEVICES=1`` may not be the card nvidia-smi calls 1.
    """
    if device_order(env) == "PCI_BUS_ID":
        return True
    return len({gpu.name for gpu in inventory}) <= 1


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
            f"(torchrun --nproc-per-node {visible_count}) or widen {VISIBLE_DEVICES_ENV}."
        )
    return f"cuda:{local_rank}"


@contextmanager
def _nvml() -> Iterator[Any]:
    """The initialised ``pynvml`` module, or ``None`` where there is no driver."""
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but be forgiving
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def nvml_text(value: str | bytes) -> str:
    """NVML strings as str: older nvidia-ml-py bindings return bytes, newer ones str."""
    return value.decode() if isinstance(value, bytes) else value


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # "Not Supported": a GPU without MIG (anything before A100)
        return False
    return bool(current)


def _optional(nvml: Any, call: str, handle: Any) -> Any:
    """An NVML reading some devices refuse ("Not Supported"), or that old bindings lack."""
    try:
        return getattr(nvml, call)(handle)
    except (nvml.NVMLError, AttributeError):
        return None


def read_inventory(nvml: Any, problems: list[str] | None = None) -> list[GpuInfo]:
    """Every physical GPU from an initialised ``pynvml`` module (a fake in tests).

    A device NVML will not describe ("Insufficient Permissions" for a GPU outside the
    container's cgroup, "GPU is lost") is left out and said in ``problems``: one bad
    device must not stop the course from using the others."""
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml_text(nvml.nvmlDeviceGetName(handle))
            uuid = nvml_text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as exc:
            if problems is not None:
                problems.append(f"GPU {i}: NVML refused to describe it ({exc}); left out")
            continue
        # a MIG parent's memory needs privileges: kept (NaN MiB), its MIG mode must be seen
        if (mem := _optional(nvml, "nvmlDeviceGetMemoryInfo", handle)) is None:
            (problems if problems is not None else []).append(f"GPU {i}: no memory figures")
        capability = _optional(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
        mode = _optional(nvml, "nvmlDeviceGetComputeMode", handle)
        gpus.append(
            GpuInfo(
                index=i,
                name=name,
                uuid=uuid,
                memory_total_mib=mem.total / 2**20 if mem else float("nan"),
                memory_used_mib=mem.used / 2**20 if mem else float("nan"),
                mig=_mig_enabled(nvml, handle),
                capability=tuple(capability) if capability else None,
                exclusive=mode == getattr(nvml, "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3),
            )
        )
    return gpus


def gpu_inventory(problems: list[str] | None = None) -> list[GpuInfo]:
    """All physical GPUs via NVML; ``[]`` where there is no driver.

    NVML does not create a CUDA context, so this is safe in the notebook
    kernel and in the launcher. Devices NVML refuses are listed in ``problems``.
    """
    with _nvml() as nvml:
        return read_inventory(nvml, problems) if nvml is not None else []


def cuda_visible(env: Mapping[str, str], inventory: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs CUDA will show a process started with ``env``, in logical order.

    The one answer to "what will CUDA see" for the launcher (how many ranks),
    the monitor (which GPUs to sample), the test suite (are there GPUs) and the
    doctor. NVML and CUDA disagree where MIG is on: NVML lists the physical
    GPUs, CUDA shows a process one MIG instance at most. The course runs one
    rank per whole GPU, so such a setup is refused here, with what to do,
    rather than discovered as eight ranks on one device.
    """
    by_index = {gpu.index: gpu for gpu in inventory}
    visible = [by_index[i] for i in logical_to_physical(env.get(VISIBLE_DEVICES_ENV), inventory)]
    mig = [gpu.index for gpu in visible if gpu.mig]
    if mig:
        raise MigError(
            f"MIG mode is on for GPU(s) {mig}: CUDA would show each process a single MIG "
            f"instance, not {len(visible)} GPU(s), so the ranks of a node could not each have "
            f"a GPU. The course needs whole GPUs: set {VISIBLE_DEVICES_ENV} to GPUs without MIG, "
            "or turn MIG off (nvidia-smi -i ID -mig 0, as root, then reset the GPU). Or run "
            f"the course on the CPU, with gloo: {VISIBLE_DEVICES_ENV}= make run (an empty value)."
        )
    return visible


def visible_gpus(
    env: Mapping[str, str] | None = None, problems: list[str] | None = None
) -> list[GpuInfo]:
    """The GPUs a process started with ``env`` would see (:func:`cuda_visible` on NVML's list)."""
    inventory = gpu_inventory(problems)
    return cuda_visible(os.environ if env is None else env, inventory) if inventory else []


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """How many GPUs a process started with ``env`` would see (0 without a driver)."""
    return len(visible_gpus(env))


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA the installed driver supports, ``(12, 4)``; ``None`` without a driver.

    A torch wheel built for a newer CUDA than this sees no GPU at all (NVML
    still lists them): the commonest reason a GPU machine trains on the CPU.
    """
    with _nvml() as nvml:
        if nvml is None:
            return None
        version = int(nvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12040
        return version // 1000, (version % 1000) // 10


def peer_to_peer(indices: Sequence[int]) -> bool | None:
    """Whether every pair of these physical GPUs can read each other's memory directly.

    NVML's P2P status (``nvmlDeviceGetP2PStatus``, read capability): NVLink or a
    PCIe switch that allows it. Without it NCCL moves data through host memory,
    which is what two T4s in a hosted notebook usually do. ``None`` where NVML
    cannot tell (no driver, old bindings, fewer than two GPUs).
    """
    if len(indices) < 2:
        return None
    with _nvml() as nvml:
        if nvml is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
            return None
        caps = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        try:
            return all(
                nvml.nvmlDeviceGetP2PStatus(a, b, caps) == getattr(nvml, "NVML_P2P_STATUS_OK", 0)
                for i, a in enumerate(handles)
                for b in handles[i + 1 :]
            )
        except nvml.NVMLError:
            return None


def gpu_memory_report(problems: list[str] | None = None) -> list[dict[str, object]]:
    """Per physical GPU: memory used and the pids holding a CUDA context on it (NVML).

    This is how seed 002's "2 MB on every card" becomes visible: a process
    that touched a GPU it should not have is listed on that GPU. ``[]`` where
    there is no driver. Inside a container NVML may report host pids, so
    callers should not rely on the pids alone. A device NVML refuses (cgroup-restricted:
    "Insufficient Permissions") is left out and said in ``problems``, never raised.
    """
    with _nvml() as nvml:
        if nvml is None:
            return []
        rows = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            if problems is not None:
                problems.append(f"NVML refused to count the GPUs ({exc})")
            return []
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                if problems is not None:
                    problems.append(f"GPU {i}: NVML refused its memory ({exc}); left out")
                continue
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError:
                procs = []
            rows.append(
                {
                    "physical": i,
                    "memory_used_mib": round(mem.used / 2**20, 1),
                    "pids": sorted(p.pid for p in procs),
                }
            )
        return rows
