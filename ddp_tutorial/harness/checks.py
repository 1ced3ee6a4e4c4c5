"""The static checks of ``ddp-tutorial doctor``: versions, devices, network, CPU and memory.

Each returns a :class:`Finding` — ``ok``, ``warn`` (training runs, but slower or fragile),
``fail`` (training will not start, or will hang) or ``skip`` (not applicable here) — with what
was found and, when it is not ok, the fix. None initialises CUDA: GPUs are counted by NVML.
:mod:`ddp_tutorial.harness.doctor` adds the real launches and the report.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_tutorial import settings
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV

STATUSES = ("ok", "warn", "fail", "skip")
SHM_MIN_GIB = 1.0  # below this DataLoader workers run out of shared memory with real batches


@dataclass
class Finding:
    """One check's result: what was found and, if it is not fine, how to fix it."""

    check: str
    status: str  # one of STATUSES
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


# --------------------------------------------------------------------------- versions


def check_python() -> Finding:
    v = sys.version_info
    found = f"Python {platform.python_version()} ({sys.executable})"
    if v < (3, 10):
        return Finding("python", "fail", found, "the course needs Python 3.10 or newer")
    if tuple(v[:3]) == (3, 13, 0):  # CPython gh-125115: `-m pdb script.py --case x` refused
        return Finding("python", "warn", found, "3.13.1+: 3.13.0's pdb refuses --options (09)")
    return Finding("python", "ok", found)


def check_torch() -> Finding:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return Finding("torch", "fail", f"cannot import torch: {exc}", "pip install torch")
    from ddp_tutorial.harness.advice import course_torch_floor, release

    found = f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"
    if release(torch.__version__) < (2, 0):
        return Finding("torch", "fail", found, "torch >= 2.0 is needed (torchrun, LOCAL_RANK)")
    if not dist.is_available():
        return Finding("torch", "fail", found + " without torch.distributed", "a full build")
    if (floor := course_torch_floor()) and release(torch.__version__) < floor:
        return Finding("torch", "warn", f"{found}, older than the course's {floor[0]}.{floor[1]}: "
                       "the lessons assert what that release prints and does", "a newer torch for "
                       "the lessons (the template: train.py + ddp_kit.py, 2.10+)")  # fmt: skip
    return Finding("torch", "ok", found)


def check_backends(gpus: int) -> Finding:
    import torch.distributed as dist

    have = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    found = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())
    if not have["gloo"] and not (have["nccl"] and gpus):
        return Finding("backends", "fail", found, "no usable backend: install a build with gloo")
    if gpus and not have["nccl"]:
        return Finding(
            "backends",
            "warn",
            found + f"; {gpus} GPU(s) but no NCCL",
            "GPUs will talk through gloo (slow): install a CUDA build of torch with NCCL",
        )
    if have["nccl"]:
        found += f" (NCCL {nccl_version()})"
    return Finding("backends", "ok", found)


def nccl_version() -> str:
    """The NCCL bundled with this torch, as "2.21.5" (read without initialising CUDA)."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "unknown"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def check_cuda_build(env: Mapping[str, str]) -> Finding:
    """Can this torch use the GPUs NVML sees? The driver's CUDA against torch's CUDA build.

    A CPU-only wheel, or a wheel built for a newer CUDA than the driver
    supports, sees no GPU: the job then runs on the CPU (gloo), slowly, with
    no error. NVML still lists the cards, so the doctor can tell.
    """
    import torch

    from ddp_tutorial.devices import driver_cuda_version
    from ddp_tutorial.harness.advice import compiled_arch_list, release

    driver = driver_cuda_version()
    if driver is None:
        return Finding("cuda build", "skip", "no NVIDIA driver: nothing for CUDA to use")
    built = torch.version.cuda
    fix = (
        "in a fresh .venv: make run TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ with "
        "XYZ at most {}{} (or use the torch your container ships)".format(*driver)
    )
    drv = "{}.{}".format(*driver)
    if built is None:
        cpu_only = f"GPUs present (driver: CUDA {drv}) but this torch is a CPU-only build"
        return Finding("cuda build", "fail", cpu_only + ": training would run on the CPU", fix)
    major, minor = release(built)
    found = f"driver supports CUDA {drv}; torch built for CUDA {built}"
    if major > driver[0]:
        return Finding("cuda build", "fail", found + ": torch will see no GPU",
                       "update the driver, or " + fix)  # fmt: skip
    seen = torch_gpu_count(env)
    if not seen:
        return Finding("cuda build", "fail", found + ", yet torch sees no GPU",
                       "check the driver (nvidia-smi) and the container's GPU access")  # fmt: skip
    if unsupported := gpus_without_kernels(env, arch := compiled_arch_list()):
        return Finding("cuda build", "fail", f"{found}, for {' '.join(arch)}"
                       f"; no code for {unsupported}: every kernel would fail with 'no kernel "
                       "image is available'", "a torch build for this GPU (an older release "
                       "or a container that lists its capability)")  # fmt: skip
    if (major, minor) > driver:
        return Finding("cuda build", "warn", found + ": runs by minor-version compatibility; "
                       "kernels that need the newer driver (PTX JIT) fail", fix)  # fmt: skip
    return Finding("cuda build", "ok", f"{found}; torch sees {seen} GPU(s)")


def torch_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs torch sees, asked in a process of its own: ``is_available()`` here poisons forks."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0


def gpus_without_kernels(env: Mapping[str, str], arch_list: list[str]) -> str:
    """The visible GPUs this torch has no code for, as "cuda:0 Tesla V100 (7.0)", or ""."""
    from ddp_tutorial.devices import DeviceError, visible_gpus
    from ddp_tutorial.harness.advice import has_kernels_for

    try:
        gpus = visible_gpus(env)
    except DeviceError:
        return ""  # reported by the gpus check
    return ", ".join(
        f"cuda:{i} {g.name} ({g.capability[0]}.{g.capability[1]})"
        for i, g in enumerate(gpus)
        if g.capability and arch_list and not has_kernels_for(g.capability, arch_list)
    )


# --------------------------------------------------------------------------- GPUs


def check_visible_devices(env: Mapping[str, str]) -> Finding:
    from ddp_tutorial.devices import DeviceError, parse_visible_devices

    value = env.get(VISIBLE_DEVICES_ENV)
    try:
        entries = parse_visible_devices(value)
    except DeviceError as exc:
        return Finding(VISIBLE_DEVICES_ENV, "fail", str(exc), "set it in the launcher's "
                       "environment to a comma list of distinct GPU ids, e.g. "
                       "CUDA_VISIBLE_DEVICES=0,1 torchrun ...")  # fmt: skip
    if entries is None:
        return Finding(VISIBLE_DEVICES_ENV, "ok", "unset: every GPU is visible")
    if entries == []:
        return Finding(VISIBLE_DEVICES_ENV, "ok", f"{value!r}: every GPU hidden (CPU on purpose)")
    return Finding(VISIBLE_DEVICES_ENV, "ok", f"{value!r}: cuda:0.. are GPUs {','.join(entries)}")


def check_gpus(env: Mapping[str, str]) -> tuple[Finding, int]:
    """GPUs through NVML (no CUDA context); returns the finding and the visible count."""
    import torch

    from ddp_tutorial.devices import (
        DeviceError,
        gpu_inventory,
        order_matches_nvidia_smi,
        visible_gpus,
    )

    problems: list[str] = []
    inventory = gpu_inventory(problems)
    if not inventory and not problems:
        return Finding("gpus", "ok", "no NVIDIA GPU (NVML found none): gloo on the CPU"), 0
    try:
        gpus = visible_gpus(env, problems=[])
    except DeviceError as exc:
        return Finding("gpus", "fail", str(exc), "as the message says"), 0
    names = ", ".join(f"cuda:{i}={g.name} (physical {g.index})" for i, g in enumerate(gpus))
    detail = f"{len(gpus)} of {len(inventory)} visible: {names or 'none'}"
    if problems:
        return Finding("gpus", "warn", detail + "; " + "; ".join(problems),
                       "check the container's GPU access (nvidia-smi -L)"), len(gpus)  # fmt: skip
    exclusive = [f"cuda:{i}" for i, g in enumerate(gpus) if g.exclusive]
    if exclusive:
        found = f"{detail}; {', '.join(exclusive)} in compute mode EXCLUSIVE_PROCESS"
        fix = (
            "one process per GPU at a time: the lessons then run their launches one after "
            "another (slower); nvidia-smi -c DEFAULT, as root, allows them side by side"
        )
        return Finding("gpus", "warn", found, fix), len(gpus)
    if torch.version.cuda is None:
        return Finding(
            "gpus",
            "fail",
            detail + "; but this torch build has no CUDA",
            "install a CUDA build of torch (pip index https://download.pytorch.org/whl/cuXXX)",
        ), len(gpus)
    if not order_matches_nvidia_smi(env, inventory):
        return Finding(
            "gpus",
            "warn",
            detail + "; mixed models: CUDA numbers the fastest first, nvidia-smi by PCI bus",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID so cuda:N matches nvidia-smi's N",
        ), len(gpus)
    return Finding("gpus", "ok", detail), len(gpus)


def summarize_topology(matrix: str) -> dict[str, int]:
    """How each pair of GPUs is linked, from ``nvidia-smi topo -m``: ``{"NV12": 28, ...}``.

    ``NV#``: NVLink (# links); ``PIX``/``PXB``: PCIe switches; ``PHB``: the
    CPU's PCIe host bridge; ``NODE``/``SYS``: across NUMA nodes or sockets —
    the slow paths, where NCCL's peer-to-peer traffic goes through the CPU.
    """
    lines = [ln.split() for ln in matrix.splitlines() if ln.strip()]
    header = next((ln for ln in lines if ln and ln[0].startswith("GPU")), [])
    names = [h for h in header if re.fullmatch(r"GPU\d+", h)]  # not "GPU NUMA ID", not NICs
    links: dict[str, int] = {}
    for row in lines:
        if not row or row[0] not in names or row == header:
            continue
        i = names.index(row[0])
        for j, link in enumerate(row[1 : len(names) + 1]):
            if j > i:
                links[link] = links.get(link, 0) + 1
    return links


def check_topology(gpus: int) -> Finding:
    """``nvidia-smi topo -m`` in one line: NVLink, PCIe, or across sockets."""
    if gpus < 2:
        return Finding("topology", "skip", "fewer than 2 GPUs: no links between GPUs")
    if shutil.which("nvidia-smi") is None:
        return Finding("topology", "skip", "nvidia-smi not found: topology not read")
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("topology", "skip", f"nvidia-smi topo -m failed: {exc}")
    links = summarize_topology(out)
    found = "GPU pairs: " + (", ".join(f"{n} x {k}" for k, n in sorted(links.items())) or "none")
    slow = sum(n for k, n in links.items() if k in ("SYS", "NODE"))
    if slow:
        fix = (
            f"{slow} pair(s) cross NUMA nodes or sockets: keep a job's ranks on the GPUs of "
            "one socket where you can (CUDA_VISIBLE_DEVICES); NCCL_P2P_DISABLE=1 only if "
            "peer-to-peer is broken"
        )
        return Finding("topology", "warn", found, fix)
    return Finding("topology", "ok", found)


# --------------------------------------------------------------------------- network


def matching_interfaces(spec: str, names: list[str]) -> list[str]:
    """Interfaces selected by a GLOO/NCCL_SOCKET_IFNAME value (NCCL's ``^``/``=`` syntax)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def check_interfaces(env: Mapping[str, str]) -> Finding:
    import psutil

    names = sorted(psutil.net_if_addrs())
    found, bad = [], []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var)
        if not value:
            continue
        # gloo takes exact names (comma list); NCCL takes prefixes, ^ to exclude, = for exact.
        if var.startswith("GLOO"):
            chosen = [w for w in value.split(",") if w in names]
            missing = [w for w in value.split(",") if w not in names]
        else:
            chosen = matching_interfaces(value, names)
            missing = [] if chosen else [value]
        found.append(f"{var}={value!r} -> {chosen or 'nothing'}")
        if missing:
            bad.append(f"{var}={value!r} names no interface of this machine ({missing})")
    try:
        address = socket.gethostbyname(socket.gethostname())
        host = f"hostname {socket.gethostname()} -> {address}"
        if address.startswith("127."):
            host += " (loopback: fine on one machine; across nodes set GLOO_SOCKET_IFNAME)"
    except OSError as exc:
        address, host = "", f"hostname {socket.gethostname()} does not resolve ({exc})"
    detail = "; ".join([*found, host, f"interfaces: {', '.join(names)}"])
    if bad:
        return Finding(
            "network",
            "fail",
            "; ".join(bad) + f" (interfaces: {', '.join(names)})",
            "unset it, or name the interface that reaches the other nodes (see `ip addr`)",
        )
    if not address:
        return Finding(
            "network",
            "warn",
            detail,
            "gloo finds its address through the hostname: fix /etc/hosts or set GLOO_SOCKET_IFNAME",
        )
    return Finding("network", "ok", detail)


# --------------------------------------------------------------------------- CPU and memory


def check_threads(env: Mapping[str, str], nproc: int) -> Finding:
    cores = settings.usable_cores()
    raw = env.get("OMP_NUM_THREADS")
    advice = f"export OMP_NUM_THREADS={max(1, cores // nproc)} (cores / ranks per node)"
    if not raw:
        return Finding(
            "threads",
            "ok",
            f"{cores} cores, {nproc} ranks planned; OMP_NUM_THREADS unset "
            "(torchrun sets it to 1 per rank when it starts more than one)",
            advice if cores // nproc > 1 else "",
        )
    try:
        threads = int(raw)
    except ValueError:
        return Finding("threads", "fail", f"OMP_NUM_THREADS={raw!r} is not an integer", advice)
    total = threads * nproc
    detail = f"OMP_NUM_THREADS={threads} x {nproc} ranks = {total} threads on {cores} cores"
    if total > cores:
        return Finding(
            "threads", "warn", detail + ": oversubscribed (ranks slow each other)", advice
        )
    return Finding("threads", "ok", detail)


def check_shm(path: str = "/dev/shm") -> Finding:
    if not os.path.isdir(path):
        return Finding(
            "shm",
            "warn" if sys.platform.startswith("linux") else "skip",
            f"{path} does not exist",
            "DataLoader workers (num_workers > 0) need shared memory",
        )
    usage = shutil.disk_usage(path)
    total, free = usage.total / 2**30, usage.free / 2**30
    detail = f"{path}: {total:.2f} GiB, {free:.2f} GiB free"
    if total < SHM_MIN_GIB or free < SHM_MIN_GIB / 2:
        return Finding(
            "shm",
            "warn",
            detail + ": DataLoader workers pass every batch through it "
            "('bus error' / 'unable to write to file </torch_…>')",
            "in Docker: --shm-size=8g or --ipc=host; or num_workers=0",
        )
    return Finding("shm", "ok", detail)


def check_plan(env: Mapping[str, str]) -> Finding:
    """The command lines that fit this machine (:mod:`ddp_tutorial.harness.advice`)."""
    from ddp_tutorial.devices import DeviceError, peer_to_peer, visible_gpus
    from ddp_tutorial.harness.advice import hosted_notebook, plan_lines

    try:
        gpus = visible_gpus(env)
    except DeviceError:
        gpus = []
    p2p = peer_to_peer([g.index for g in gpus])
    summary, commands = plan_lines(gpus, settings.usable_cores(), p2p, hosted_notebook(env))
    return Finding("plan", "ok", "\n".join([summary, *commands]))
