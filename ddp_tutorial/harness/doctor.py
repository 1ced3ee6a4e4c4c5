"""``ddp-tutorial doctor``: check a machine before it burns GPU hours.

Each check (the static ones are in :mod:`ddp_tutorial.harness.checks`)
returns a :class:`~ddp_tutorial.harness.checks.Finding` with what was found
and, when it is not ok, the fix. The command exits non-zero when any check
fails.

The checker itself never initialises CUDA: GPUs are counted through NVML
(:mod:`ddp_tutorial.devices`), and the communication checks run in real
``torchrun`` launches (:mod:`ddp_tutorial.harness.launch`) of the rank-side
module :mod:`ddp_tutorial.probe`: a 2-rank gloo all_reduce on the CPU, and an nccl all_reduce
across the visible GPUs where there are any. A broken network setting
(``GLOO_SOCKET_IFNAME`` naming no interface, a firewall) shows up there as it
would in training — but in seconds, thanks to a short process-group timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddp_tutorial import settings
from ddp_tutorial.harness.checks import (
    Finding,
    check_backends,
    check_cuda_build,
    check_gpus,
    check_interfaces,
    check_plan,
    check_python,
    check_shm,
    check_threads,
    check_topology,
    check_torch,
    check_visible_devices,
)
from ddp_tutorial.harness.host_checks import check_host_memory, check_host_name, check_port
from ddp_tutorial.harness.interfaces import check_node_interfaces
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV

PROBE_TIMEOUT_S = 90.0  # the whole probe launch
PROBE_PG_TIMEOUT_S = 20.0  # a collective that waits longer than this fails the probe

# --------------------------------------------------------------------------- real launches


def _probe_launch(backend: str, nproc: int, env: Mapping[str, str], timeout: float) -> Finding:
    """A real ``torchrun -m ddp_tutorial.probe``: each rank all_reduces its rank."""
    from ddp_tutorial.harness.failures import LaunchError
    from ddp_tutorial.harness.launch import torchrun

    name = f"{backend} all_reduce"
    expected = float(sum(range(nproc)))
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-") as tmp:
        probe_env = {**env, settings.TIMEOUT_ENV: str(PROBE_PG_TIMEOUT_S)}
        try:
            result = torchrun(
                "ddp_tutorial.probe",
                "--backend",
                backend,
                nproc=nproc,
                env=probe_env,
                timeout=timeout,
                run_dir=tmp,
                echo=False,
                module=True,
            )
        except LaunchError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            cause = next(
                (ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1]
            )
            return Finding(
                name,
                "fail",
                f"{nproc} ranks could not all_reduce: {cause.strip()[:400]}",
                "read the message: a *_SOCKET_IFNAME naming the wrong interface, a firewall "
                "between ranks, or a broken driver",
            )
        sums = [r.get("sum") for r in result.records]
        if len(sums) != nproc or any(s != expected for s in sums):
            return Finding(name, "fail", f"wrong result: {sums}, expected {expected:g}", "")
        device = result.records[0].get("device")
        return Finding(
            name,
            "ok",
            f"{nproc} ranks on {device}: sum of ranks = {expected:g} on every rank "
            f"({result.seconds:.1f} s including start-up)",
        )


def check_gloo(env: Mapping[str, str], timeout: float = PROBE_TIMEOUT_S) -> Finding:
    # Hide GPUs from the CPU probe: it must not create CUDA contexts.
    return _probe_launch("gloo", 2, {**env, VISIBLE_DEVICES_ENV: ""}, timeout)


def check_nccl(env: Mapping[str, str], gpus: int, timeout: float = PROBE_TIMEOUT_S) -> Finding:
    import torch.distributed as dist

    if gpus == 0:
        return Finding("nccl all_reduce", "skip", "no GPU visible: nothing for nccl to do here")
    if not dist.is_nccl_available():
        return Finding("nccl all_reduce", "skip", "this torch build has no NCCL")
    return _probe_launch("nccl", gpus, env, timeout)


def check_compiler(env: Mapping[str, str]) -> Finding:
    """What ``torch.compile`` (inductor) needs to build kernels: compilers and Python's headers.

    On the CPU inductor compiles C++ with ``$CXX`` or g++ (clang++ on macOS); on
    a GPU Triton builds its launcher with ``$CC``, gcc or clang against Python.h.
    Without them the first compiled call fails (lesson 11), while training without
    compile still runs: a warning, not a failure.
    """
    cxx = env.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    cc = env.get("CC") or shutil.which("gcc") or shutil.which("clang")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = []
    if not shutil.which(cxx):
        missing.append(f"C++ compiler ({cxx}: inductor on the CPU)")
    if not (cc and shutil.which(cc)):
        missing.append("C compiler ($CC, gcc or clang: Triton on a GPU)")
    if not header.is_file():
        missing.append(f"Python headers ({header}: Triton's launcher)")
    if missing:
        return Finding("compiler", "warn", "torch.compile cannot build kernels: no "
                       + "; no ".join(missing),
                       "apt install build-essential python3-dev (or your system's compiler and "
                       "Python development package), or train without --compile")  # fmt: skip
    return Finding("compiler", "ok", f"{shutil.which(cxx)}, {shutil.which(cc)}, {header}")


# --------------------------------------------------------------------------- all of it


def run_checks(
    env: Mapping[str, str] | None = None,
    launch: bool = True,
    timeout: float = PROBE_TIMEOUT_S,
    progress: Callable[[Finding], None] | None = None,
    plan: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Every check, in order; ``launch=False`` skips the two torchrun probes.

    ``env`` replaces ``os.environ`` for the checks and the probes (a test can
    pass a broken setting without touching its own environment). ``plan``: the
    DataLoader ``workers`` per rank and the ``dataset_gib`` each rank holds, for the
    host-memory projection.
    """
    env = dict(os.environ if env is None else env)
    findings: list[Finding] = []

    def add(finding: Finding) -> None:
        findings.append(finding)
        if progress is not None:
            progress(finding)

    add(check_python())
    torch_finding = check_torch()
    add(torch_finding)
    if torch_finding.status == "fail":
        return findings
    add(check_visible_devices(env))
    gpu_finding, gpus = check_gpus(env)
    add(gpu_finding)
    add(check_cuda_build(env))
    add(check_topology(gpus))
    add(check_backends(gpus))
    add(check_port(env))
    add(check_interfaces(env))
    add(check_node_interfaces(env, gpus))
    add(check_threads(env, gpus or 2))
    add(check_shm())
    plan = {"workers": 4, "dataset_gib": None, **(plan or {})}
    add(check_host_memory(gpus or 2, plan["workers"], plan["dataset_gib"]))
    add(check_host_name())
    add(check_plan(env))
    add(check_compiler(env))
    if launch:
        add(check_gloo(env, timeout))
        add(check_nccl(env, gpus, timeout))
    else:
        for name in ("gloo all_reduce", "nccl all_reduce"):
            add(Finding(name, "skip", "not run (--no-launch)"))
    return findings


def fails_by_design() -> set[str]:
    """The checks that FAIL on this machine although the course runs here: GPUs it cannot train
    on (``gpus``: a MIG slice, torch sees one device; ``cuda``: a driver too old for this
    torch). They FAIL for GPU training; the lessons then plan CPU ranks over gloo."""
    from ddp_tutorial.harness.gpu_plan import mig_fallback, torch_sees_no_gpu

    why = {"gpus": mig_fallback()[0], "cuda": torch_sees_no_gpu()}
    return {name for name, reason in why.items() if reason}


def blocking(findings: list[Finding]) -> list[Finding]:
    """The findings that stop training (status ``fail``)."""
    return [f for f in findings if f.status == "fail"]


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing blocks training, 1 otherwise."""
    return 1 if blocking(findings) else 0


MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def format_finding(f: Finding, width: int = 20) -> str:
    indent = "\n" + " " * (len(MARKS[f.status]) + 3 + width + 1)
    text = f"[{MARKS[f.status]}] {f.check:<{width}} {f.detail.replace(chr(10), indent)}"
    if f.fix and f.status in ("warn", "fail"):
        text += f"\n       {'':<{width}} fix: {f.fix}"
    return text


def format_findings(findings: list[Finding]) -> str:
    """The report as a terminal shows it, with a verdict at the end."""
    lines = [format_finding(f) for f in findings]
    bad = blocking(findings)
    warns = sum(f.status == "warn" for f in findings)
    if bad:
        lines.append(f"\n{len(bad)} problem(s) block training: {', '.join(f.check for f in bad)}.")
    else:
        lines.append(f"\nready to train ({warns} warning(s)).")
    return "\n".join(lines)


def to_json(findings: list[Finding]) -> str:
    return json.dumps(
        {"ok": not blocking(findings), "findings": [asdict(f) for f in findings]}, indent=1
    )
