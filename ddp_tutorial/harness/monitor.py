"""Sample utilization beside a launch: per-GPU (NVML) or, without GPUs, per-rank CPU (psutil).

This is the picture seed 000 describes ("nvidia-smi shows every card evenly
busy"), recorded so a notebook can plot it and assert on it.

* **GPU mode** — for each GPU the ranks can see (``CUDA_VISIBLE_DEVICES`` of
  the launch mapped to the logical ids the ranks use): NVML utilization % and
  memory used. NVML's "utilization" is the fraction of the sample window in
  which *a kernel was running*, not how busy the SMs were: a rank spinning in
  an all_reduce kernel looks 100 % busy.
* **CPU mode** — for each rank (a process under the torchrun launcher whose
  environment carries ``RANK``, together with its DataLoader workers): CPU %
  (100 = one core) and resident memory.

Samples go to memory and, with :meth:`Monitor.write_csv`, to a CSV in the run
directory. The sampler runs in a thread of the parent; its own CPU time is
measured (:attr:`Monitor.overhead`) so the lesson can state it.
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

from ddp_tutorial import settings

FIELDS = ("t", "wall", "kind", "id", "util", "mem_mib")
NAN = float("nan")


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class Monitor:
    """Background sampler; use as a context manager or ``start()``/``stop()``.

    ``root_pid``: the launcher whose descendants are the ranks (default: this
    process). ``env``: the environment the ranks were started with (for
    ``CUDA_VISIBLE_DEVICES``). ``nproc``: ranks per node; only their GPUs
    (``cuda:0`` … ``cuda:nproc-1``) are sampled. ``nvml``: the NVML module
    (``pynvml``) — a fake can be passed in tests; ``None`` loads the real one;
    with no usable GPU the monitor falls back to CPU mode (``note`` says why,
    e.g. MIG). A reading NVML refuses is recorded as NaN.
    """

    def __init__(
        self,
        root_pid: int | None = None,
        env: Mapping[str, str] | None = None,
        interval: float = 0.5,
        nvml: ModuleType | Any | None = None,
        mode: str = "auto",
        nproc: int | None = None,
    ):
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval}")
        if mode not in {"auto", "gpu", "cpu"}:
            raise ValueError(f"mode must be 'auto', 'gpu' or 'cpu', got {mode!r}")
        self.root_pid = root_pid if root_pid is not None else os.getpid()
        self.env = dict(os.environ if env is None else env)
        self.interval = interval
        self._nvml = nvml
        self._requested_mode = mode
        self.nproc = nproc
        self.note = ""  # why GPU sampling is off, when NVML sees GPUs the ranks cannot use
        self.mode = "cpu"
        self._handles: list[tuple[int, Any]] = []  # (logical id, NVML handle)
        self._procs: dict[int, tuple[psutil.Process, int]] = {}  # pid -> (process, rank)
        self._rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._cpu_seconds = 0.0
        self._samples_taken = 0
        self._wall_seconds = 0.0

    # -- set-up -------------------------------------------------------------
    def _init_gpu(self) -> bool:
        nvml = self._nvml if self._nvml is not None else _load_nvml()
        if nvml is None:
            return False
        try:
            nvml.nvmlInit()
        except Exception:  # NVMLError: no driver, no library
            return False
        from ddp_tutorial.devices import DeviceError, cuda_visible, read_inventory

        try:
            inventory = read_inventory(nvml)  # a device NVML refuses is left out
            handles = {g.index: nvml.nvmlDeviceGetHandleByIndex(g.index) for g in inventory}
            visible = cuda_visible(self.env, inventory) if inventory else []
        except (DeviceError, nvml.NVMLError) as exc:  # e.g. MIG: say why, sample the CPU
            self.note = f"GPU sampling off: {exc}"
            visible = []
        visible = self._ranks_gpus(visible)
        if not visible:
            nvml.nvmlShutdown()
            return False
        self._nvml = nvml
        self._handles = [(logical, handles[gpu.index]) for logical, gpu in enumerate(visible)]
        return True

    def _ranks_gpus(self, visible: list[Any]) -> list[Any]:
        """The GPUs the ranks compute on: ``cuda:0`` … ``cuda:nproc-1``, or none on gloo.

        Rank r uses cuda:LOCAL_RANK, the r-th visible GPU; an idle card beside
        them is not part of this job. With fewer GPUs than ranks, or gloo asked
        for, the ranks compute on the CPU: then their processes are what to
        sample, not the GPUs.
        """
        from ddp_tutorial.distributed import BackendError, choose_backend
        from ddp_tutorial.harness.gpu_plan import torch_sees_no_gpu

        if not visible:
            return []
        if why := torch_sees_no_gpu():
            self.note = f"GPU sampling off: the ranks run on the CPU ({why})"
            return []
        nproc = self.nproc if self.nproc is not None else len(visible)
        try:
            backend, why = choose_backend(settings.backend(self.env), nproc, gpus=len(visible))
        except BackendError as exc:
            backend, why = "gloo", str(exc)
        if backend != "nccl":
            self.note = f"GPU sampling off: the ranks run {backend} on the CPU ({why})"
            return []
        return visible[:nproc]

    def start(self) -> Monitor:
        """Begin sampling in a daemon thread."""
        if self._requested_mode in {"auto", "gpu"} and self._init_gpu():
            self.mode = "gpu"
        elif self._requested_mode == "gpu":
            raise RuntimeError("Monitor(mode='gpu'): NVML found no GPU visible to the ranks")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ddp-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (idempotent); takes one last sample first."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 5)
        self._thread = None
        if self.mode == "gpu" and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sampling -----------------------------------------------------------
    def _run(self) -> None:
        cpu0, wall0 = time.thread_time(), time.monotonic()
        while True:
            self.sample_once()
            if self._stop.wait(self.interval):
                break
        self.sample_once()
        self._cpu_seconds = time.thread_time() - cpu0
        self._wall_seconds = time.monotonic() - wall0

    def sample_once(self) -> list[dict[str, Any]]:
        """Take one sample now; returns (and stores) its rows."""
        t = round(time.monotonic() - self._t0, 3)
        rows = self._sample_gpu(t) if self.mode == "gpu" else self._sample_cpu(t)
        wall = round(time.time(), 3)  # to line samples up with times the ranks report
        for row in rows:
            row["wall"] = wall
        self._rows.extend(rows)
        return rows

    def _sample_gpu(self, t: float) -> list[dict[str, Any]]:
        rows = []
        for logical, handle in self._handles:
            row = {"t": t, "kind": "gpu", "id": logical, "util": NAN, "mem_mib": NAN}
            try:  # one failed reading is a gap in the data, not the end of sampling
                row["util"] = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self._nvml.NVMLError:  # "Not Supported" on MIG and many vGPUs
                pass
            try:
                row["mem_mib"] = self._nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            except self._nvml.NVMLError:
                pass
            rows.append(row)
        return rows

    def _discover(self) -> None:
        """Find rank processes (and their workers) under the launcher."""
        try:
            root = psutil.Process(self.root_pid)
            descendants = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in descendants:
            if proc.pid in self._procs:
                continue
            try:
                rank = proc.environ().get("RANK")
                if rank is None:
                    continue
                proc.cpu_percent(None)  # first call primes the counter
                self._procs[proc.pid] = (proc, int(rank))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue

    def _sample_cpu(self, t: float) -> list[dict[str, Any]]:
        # Walking the process tree is the expensive part: do it every few samples
        # (ranks restart, workers come and go), not every time.
        self._samples_taken += 1
        if not self._procs or self._samples_taken % 4 == 1:
            self._discover()
        per_rank: dict[int, list[float]] = {}
        for pid, (proc, rank) in list(self._procs.items()):
            try:
                with proc.oneshot():
                    cpu = proc.cpu_percent(None)
                    rss = proc.memory_info().rss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                del self._procs[pid]
                continue
            total = per_rank.setdefault(rank, [0.0, 0.0])
            total[0] += cpu
            total[1] += rss
        return [
            {"t": t, "kind": "cpu", "id": rank, "util": cpu, "mem_mib": rss}
            for rank, (cpu, rss) in sorted(per_rank.items())
        ]

    # -- results ------------------------------------------------------------
    def samples(self) -> list[dict[str, Any]]:
        """All rows so far.

        Columns: ``t`` (s since start), ``wall`` (epoch s), ``kind`` ("gpu"/"cpu"),
        ``id`` (logical GPU or rank), ``util`` (%), ``mem_mib``.
        """
        return list(self._rows)

    @property
    def overhead(self) -> float:
        """The sampler's own CPU time as a fraction of one core over its lifetime."""
        return self._cpu_seconds / self._wall_seconds if self._wall_seconds else 0.0

    def write_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write the samples as CSV (columns: t, kind, id, util, mem_mib)."""
        return write_samples_csv(path, self._rows)


def write_samples_csv(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in FIELDS})
    return path


def read_samples_csv(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a CSV written by :meth:`Monitor.write_csv` back into rows."""
    with Path(path).open() as fh:
        return [
            {
                "t": float(r["t"]),
                "wall": float(r["wall"]),
                "kind": r["kind"],
                "id": int(r["id"]),
                "util": float(r["util"]),
                "mem_mib": float(r["mem_mib"]),
            }
            for r in csv.DictReader(fh)
        ]


def _max(current: float, value: float) -> float:
    return value if math.isnan(current) else max(current, value)


def summarize(
    rows: list[dict[str, Any]], window: tuple[float, float] | None = None
) -> dict[int, dict[str, float]]:
    """Mean/max utilization and peak memory per device or rank, optionally in a time window.

    The window (e.g. the training phase reported by the ranks) keeps start-up
    and shutdown, when nobody computes, out of the balance check. A reading
    NVML refused (NaN) is left out; a device with no reading at all has NaN
    statistics and ``samples`` 0.
    """
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if window and not (window[0] <= row["t"] <= window[1]):
            continue
        s = out.setdefault(row["id"], {"n": 0, "util_sum": 0.0, "util_max": NAN, "mem_max": NAN})
        if not math.isnan(row["util"]):
            s["n"] += 1
            s["util_sum"] += row["util"]
            s["util_max"] = _max(s["util_max"], row["util"])
        if not math.isnan(row["mem_mib"]):
            s["mem_max"] = _max(s["mem_max"], row["mem_mib"])
    return {
        k: {
            "samples": v["n"],
            "util_mean": v["util_sum"] / v["n"] if v["n"] else NAN,
            "util_max": v["util_max"],
            "mem_max_mib": v["mem_max"],
        }
        for k, v in sorted(out.items())
    }
