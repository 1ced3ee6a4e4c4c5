"""ddp-tutorial doctor: a healthy machine passes, a broken setting is reported (and exits 1).

Lesson 00 runs the doctor as a shell would, with ``--no-launch``; here the gloo probe's
real launch runs both ways: healthy (every rank gets the sum of ranks) and with a broken
GLOO_SOCKET_IFNAME (lesson 09 shows that setting's static check).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from ddp_tutorial.harness import advice, checks, doctor, host_checks
from ddp_tutorial.harness.checks import (
    Finding,
    check_interfaces,
    check_shm,
    check_threads,
    check_visible_devices,
)
from ddp_tutorial.harness.doctor import exit_code, format_findings, run_checks
from ddp_tutorial.harness.host_checks import check_port


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def test_finding_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status must be one of"):
        Finding("x", "bad", "")


@pytest.mark.parametrize(
    ("value", "status"),
    [(None, "ok"), ("", "ok"), ("-1", "ok"), ("0,1", "ok"), ("0,0", "fail"), ("0,,1", "fail")],
)
def test_visible_devices(value, status):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    finding = check_visible_devices(env)
    assert finding.status == status, finding
    if status == "fail":
        assert "CUDA would silently see" in finding.detail and finding.fix


def test_interfaces(monkeypatch):
    monkeypatch.setattr(checks.socket, "gethostbyname", lambda name: "10.0.0.5")
    assert check_interfaces({}).status == "ok"
    assert check_interfaces({"GLOO_SOCKET_IFNAME": "lo"}).status == "ok"
    bad = check_interfaces({"GLOO_SOCKET_IFNAME": "nope0"})
    assert bad.status == "fail" and "'nope0' names no interface" in bad.detail
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "^nope"}).status == "ok"  # exclusion
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "lo"}).status == "ok"  # prefix of "lo"
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "=nope"}).status == "fail"


def test_a_hostname_that_does_not_resolve_is_a_warning(monkeypatch):
    def broken(name):
        raise OSError("Name or service not known")

    monkeypatch.setattr(checks.socket, "gethostbyname", broken)
    finding = check_interfaces({})
    assert finding.status == "warn" and "does not resolve" in finding.detail
    assert "GLOO_SOCKET_IFNAME" in finding.fix


def test_port_taken_is_a_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = check_port({"MASTER_PORT": str(port)})
    assert taken.status == "fail" and "already in use" in taken.detail
    assert "--standalone" in taken.fix
    assert check_port({"MASTER_PORT": "http"}).status == "fail"


def test_the_default_port_free_or_taken(monkeypatch):
    monkeypatch.setattr(host_checks, "port_in_use", lambda port: False)
    assert check_port({}).status == "ok"
    monkeypatch.setattr(host_checks, "port_in_use", lambda port: port == 29500)
    taken = check_port({})
    # torch 2.14's run.py: one node with no port given picks a free one; 29500 is multi-node's
    assert taken.status == "warn" and "29500 is taken" in taken.detail
    assert "--nnodes" in taken.detail and "one node" in taken.detail
    assert "--master-port" in taken.fix


def test_the_port_torchrun_reads_is_checked_before_the_one_env_init_reads(monkeypatch):
    """torchrun takes --master-port from PET_MASTER_PORT and ignores MASTER_PORT (it sets that
    for its ranks); `python script.py` with env:// reads MASTER_PORT."""
    monkeypatch.setattr(host_checks, "port_in_use", lambda port: port == 29400)
    taken = check_port({"PET_MASTER_PORT": "29400", "MASTER_PORT": "29401"})
    assert taken.status == "fail" and taken.detail.startswith("PET_MASTER_PORT=29400")
    endpoint = check_port({"PET_RDZV_ENDPOINT": "node0:29400"})
    assert endpoint.status == "fail" and "PET_RDZV_ENDPOINT" in endpoint.detail
    assert check_port({"MASTER_PORT": "29401"}).status == "ok"
    # helper 102: torchrun's order and parser (run.py, rendezvous/utils.py): the endpoint wins
    # over --master-port, a c10d endpoint without a port is 29400, --standalone picks its own
    both = check_port({"PET_MASTER_PORT": "29401", "PET_RDZV_ENDPOINT": "node0:29400"})
    assert both.status == "fail" and both.detail.startswith("PET_RDZV_ENDPOINT=")
    c10d = {"PET_RDZV_BACKEND": "c10d"}  # an endpoint without a port: c10d's 29400
    for endpoint in ("node0", "[::1]", " node0:29400 ", "[::1]:29400"):
        found = check_port({**c10d, "PET_RDZV_ENDPOINT": endpoint})
        assert found.status == "fail" and "already in use" in found.detail, endpoint
    broken = check_port({**c10d, "PET_RDZV_ENDPOINT": "node0:"})
    assert broken.status == "fail" and "must be an integer" in broken.detail
    static = check_port({"PET_RDZV_ENDPOINT": "node0"})  # helper 104: torchrun's default
    assert static.status == "fail" and "the static rendezvous has no default" in static.detail
    # --standalone as torchrun reads a flag: bool(int(value)) ("true" makes torchrun fail)
    assert check_port({"PET_STANDALONE": "1", "PET_MASTER_PORT": "29400"}).status == "ok"
    assert check_port({"PET_STANDALONE": "2", "PET_MASTER_PORT": "29400"}).status == "ok"
    assert check_port({"PET_STANDALONE": "0", "PET_MASTER_PORT": "29400"}).status == "fail"
    assert "as a number" in check_port({"PET_STANDALONE": "true"}).detail
    assert "no port number" in check_port({"MASTER_PORT": "70000"}).detail


def test_a_port_this_user_may_not_listen_on_is_no_free_port(monkeypatch):
    """Helper 104: a port below 1024 without root failed to bind with EACCES, which the check
    took for 'no IPv6 here, try IPv4' and then called free."""

    real = socket.socket.bind

    def bind(self, address):
        if address[1] == 80:  # as for a user without root, whatever this test runs as
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    found = check_port({"MASTER_PORT": "80"})
    assert found.status == "fail" and "Permission denied" in found.detail and "root" in found.fix


def test_a_listener_on_ipv6_alone_takes_the_port_the_store_wants():
    """The store listens on every address, IPv6 too: a process on [::]:port only, IPv4 free,
    still refuses it (helper 102: the check bound IPv4 alone and called it free)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 address to listen on")
        s.listen()
        taken = check_port({"MASTER_PORT": str(s.getsockname()[1])})
    assert taken.status == "fail", taken.detail


def test_a_port_a_finished_job_left_in_time_wait_is_free_as_the_store_sees_it():
    """The c10d store binds with SO_REUSEADDR: a port whose last store closed its connections
    (TIME_WAIT for a minute) takes a new store at once, and the doctor must not call it taken."""
    from datetime import timedelta

    import torch.distributed as dist

    from ddp_tutorial.distributed import free_port

    port, wait = free_port(), timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=wait, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=wait)
    client.set("step", "1")
    del server  # the server closes first: its side of the connection waits in TIME_WAIT
    del client
    finding = check_port({"MASTER_PORT": str(port)})
    again = dist.TCPStore("127.0.0.1", port, 1, True, timeout=wait)  # the next job's store
    del again
    assert finding.status == "ok", finding.detail


def test_threads(monkeypatch):
    monkeypatch.setattr("ddp_tutorial.settings.usable_cores", lambda: 4)
    assert check_threads({}, 2).status == "ok"
    assert check_threads({"OMP_NUM_THREADS": "2"}, 2).status == "ok"
    over = check_threads({"OMP_NUM_THREADS": "8"}, 2)
    assert over.status == "warn" and "16 threads on 4 cores" in over.detail
    assert "OMP_NUM_THREADS=2" in over.fix
    assert check_threads({"OMP_NUM_THREADS": "many"}, 2).status == "fail"


def test_shm(monkeypatch, tmp_path):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: Usage(64 * 2**20, 0, 64 * 2**20))
    small = check_shm(str(tmp_path))
    assert small.status == "warn" and "--shm-size" in small.fix  # Docker's 64 MB default
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: Usage(8 * 2**30, 0, 8 * 2**30))
    assert check_shm(str(tmp_path)).status == "ok"
    assert check_shm(str(tmp_path / "missing")).status == "warn"  # Linux: workers need it


NAMES = ["python", "torch", "CUDA_VISIBLE_DEVICES", "gpus", "cuda build", "topology", "backends",
         "port", "network", "interfaces", "threads", "shm", "host memory", "host name", "plan",
         "compiler", "gloo all_reduce", "nccl all_reduce"]  # fmt: skip


def test_missing_compilers_and_headers_warn_what_torch_compile_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    monkeypatch.setattr(doctor.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    finding = doctor.check_compiler({})
    assert finding.status == "warn" and "torch.compile cannot build kernels" in finding.detail
    for need in ("C++ compiler (g++", "C compiler ($CC", f"Python headers ({tmp_path}"):
        assert need in finding.detail
    assert "build-essential python3-dev" in finding.fix
    assert exit_code([finding]) == 0, "a warning: training without compile still runs"
    monkeypatch.setattr(doctor.shutil, "which", lambda name: f"/usr/bin/{name}")
    (tmp_path / "Python.h").write_text("")
    assert doctor.check_compiler({"CC": "cc"}).status == "ok"


def test_static_checks_are_healthy_here():
    findings = run_checks(launch=False)
    assert exit_code(findings) == 0, format_findings(findings)
    assert [f.check for f in findings] == NAMES
    assert "ready to train" in format_findings(findings)


@pytest.mark.torchrun  # a fresh interpreter: in this one CUDA may already be up (GPU tests)
def test_the_checker_never_initialises_cuda():
    code = (
        "import torch\nfrom ddp_tutorial.harness.doctor import run_checks\n"
        "run_checks(launch=False)\nprint('initialised', torch.cuda.is_initialized())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "initialised False"


def test_python_torch_and_backend_failures_say_what_to_do(monkeypatch):
    monkeypatch.setattr(checks.sys, "version_info", (3, 9, 18))
    old = checks.check_python()
    assert old.status == "fail" and "3.10 or newer" in old.fix
    monkeypatch.setattr(checks.sys, "version_info", (3, 13, 0))  # pdb refuses a script's flags
    assert checks.check_python().status == "warn" and "3.13.1+" in checks.check_python().fix
    monkeypatch.setattr(checks.sys, "version_info", (3, 13, 1))
    assert checks.check_python().status == "ok"
    monkeypatch.setattr(torch, "__version__", "1.13.1")
    assert "torch >= 2.0" in checks.check_torch().fix
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")  # runs, but not the lessons' torch
    monkeypatch.setattr(advice, "course_torch_floor", lambda: (2, 14))
    older = checks.check_torch()
    assert older.status == "warn" and "older than the course's 2.14" in older.detail, older
    assert "train.py + ddp_kit.py, 2.10+" in older.fix
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    assert checks.check_torch().status == "ok"
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    none = checks.check_backends(0)
    assert none.status == "fail" and "no usable backend" in none.fix
    monkeypatch.setattr(dist, "is_gloo_available", lambda: True)
    slow = checks.check_backends(4)
    assert slow.status == "warn" and "4 GPU(s) but no NCCL" in slow.detail


def test_a_torch_that_cannot_be_imported_stops_the_doctor_early(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    finding = checks.check_torch()
    assert finding.status == "fail" and "cannot import torch" in finding.detail
    monkeypatch.setattr(doctor, "check_torch", lambda: finding)
    assert [f.check for f in run_checks(launch=False)] == ["python", "torch"]


def test_a_probe_with_the_wrong_sum_fails(monkeypatch):
    from types import SimpleNamespace

    from ddp_tutorial.harness import launch

    fake = SimpleNamespace(records=[{"sum": 1.0}, {"sum": 7.0}], seconds=1.0)
    monkeypatch.setattr(launch, "torchrun", lambda *a, **k: fake)
    finding = doctor._probe_launch("gloo", 2, {}, timeout=10)
    assert finding.status == "fail" and "wrong result: [1.0, 7.0], expected 1" in finding.detail


def test_broken_settings_block_training():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,0", "GLOO_SOCKET_IFNAME": "nope0"}
    findings = run_checks(env=env, launch=False)
    failed = [f.check for f in findings if f.status == "fail"]
    assert failed == ["CUDA_VISIBLE_DEVICES", "network"]
    assert exit_code(findings) == 1
    assert "2 problem(s) block training" in format_findings(findings)


@pytest.mark.torchrun
def test_the_real_gloo_probe_reports_a_healthy_machine():
    """What ``ddp-tutorial doctor`` (without --no-launch) runs: 2 ranks all_reduce their rank."""
    finding = doctor.check_gloo(dict(os.environ), timeout=180)
    assert finding.status == "ok", finding
    assert finding.detail.startswith("2 ranks on cpu: sum of ranks = 1 on every rank ("), finding


@pytest.mark.torchrun
def test_wrong_interface_fails_the_real_all_reduce():
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "nope0"}
    finding = doctor.check_gloo(env, timeout=120)
    assert finding.status == "fail"
    assert "Unable to find address for: nope0" in finding.detail


def test_cli_exit_status(capsys, monkeypatch):
    # In-process: the command's own code path, without a second interpreter's start-up.
    from ddp_tutorial.harness.cli import main

    assert main(["doctor", "--no-launch", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and [f["check"] for f in report["findings"]] == NAMES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,1")
    assert main(["doctor", "--no-launch"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] CUDA_VISIBLE_DEVICES" in out and "1 problem(s) block training" in out


def test_negative_plans_are_refused_by_the_parser(capsys):
    """Helper 103: --num-workers -1 divided by zero; -5 and --dataset-gib -3 printed negative
    processes and memory as "ok"."""
    from ddp_tutorial.harness.cli import main

    for flags in (["--num-workers", "-1"], ["--dataset-gib", "-3"], ["--num-workers", "x"],
                  ["--dataset-gib", "nan"], ["--dataset-gib", "inf"],
                  ["--timeout", "0"], ["--timeout", "-5"]):  # fmt: skip
        with pytest.raises(SystemExit) as ended:
            main(["doctor", "--no-launch", *flags])
        assert ended.value.code == 2
        err = capsys.readouterr().err  # argparse's usage line, then what the value is
        said = ("is below 0", "is not a number", "is not above 0")
        assert flags[0] in err and any(s in err for s in said), err
    # helper 132: --timeout 0 printed every check, then a traceback from the launcher


@pytest.mark.gpu
def test_nccl_probe_on_gpus():
    from conftest import gpu_count

    finding = doctor.check_nccl(dict(os.environ), gpu_count(), timeout=180)
    assert finding.status == "ok", finding
    assert "cuda" in finding.detail


# -- a GPU machine, faked: what the doctor says there ----------------------------------------


def _cuda_build(monkeypatch, built, available=True, count=8):
    def fork_trap():
        raise AssertionError("torch.cuda.is_available() in the doctor's process (the kernel)")

    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch.cuda, "is_available", fork_trap)
    monkeypatch.setattr(checks, "torch_gpu_count", lambda env: count if available else 0)
    return checks.check_cuda_build({})


def test_gpus_that_torch_cannot_use_fail_loudly(nvml, monkeypatch):
    from conftest import fake_gpu

    nvml([fake_gpu(i) for i in range(8)], driver_cuda=12040)  # a driver for CUDA 12.4
    cpu_only = _cuda_build(monkeypatch, None)
    assert cpu_only.status == "fail" and "CPU-only build" in cpu_only.detail
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ with XYZ at most 124" in cpu_only.fix
    too_new = _cuda_build(monkeypatch, "13.0", available=False)  # a CUDA 13 wheel, old driver
    assert too_new.status == "fail" and "torch will see no GPU" in too_new.detail
    assert _cuda_build(monkeypatch, "12.6").status == "warn"  # minor-version compatibility
    fine = _cuda_build(monkeypatch, "12.4")
    assert fine.status == "ok" and "torch sees 8 GPU(s)" in fine.detail
    assert _cuda_build(monkeypatch, "12.1", available=False).status == "fail"


def test_no_driver_skips_the_cuda_build_check(nvml):
    nvml(None)
    assert checks.check_cuda_build({}).status == "skip"


def test_mig_is_reported_with_what_to_do(nvml):
    from conftest import fake_gpu

    nvml([fake_gpu(i, mig=True) for i in range(8)])
    finding, count = checks.check_gpus({})
    assert finding.status == "fail" and "MIG mode is on" in finding.detail and count == 0


TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tNV12\tSYS\t0-31\t0
GPU1\tNV12\t X \tNV12\tSYS\t0-31\t0
GPU2\tNV12\tNV12\t X \tSYS\t0-31\t0
GPU3\tSYS\tSYS\tSYS\t X \t32-63\t1

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


def test_topology_counts_links_between_gpu_pairs():
    assert checks.summarize_topology(TOPO) == {"NV12": 3, "SYS": 3}
    assert checks.check_topology(1).status == "skip"


def test_backends_name_the_nccl_version(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert "NCCL 2.21.5" in checks.check_backends(8).detail


def test_host_memory_projects_python_objects_into_every_worker():
    """Lesson 12's rule: objects cost ranks x (1 + workers) copies, arrays one per rank."""
    from ddp_tutorial.harness.host_checks import check_host_memory, project_host_memory

    assert project_host_memory(4, 8, 100, python_objects=True) == 3600
    assert project_host_memory(4, 8, 100, python_objects=False) == 400
    gib = 2**30
    fits = check_host_memory(4, 8, dataset_gib=1.0, available=64 * gib)  # 36 and 4 GiB
    assert fits.status == "ok" and "36.0 GiB as Python objects, 4.0 GiB as arrays" in fits.detail
    objects = check_host_memory(4, 8, dataset_gib=2.0, available=64 * gib)  # 72 GiB
    assert objects.status == "warn" and "numpy arrays or tensors" in objects.fix
    assert check_host_memory(4, 8, dataset_gib=20.0, available=64 * gib).status == "fail"
    budget = check_host_memory(2, 3, available=8 * gib)  # no size: the largest that fits
    assert budget.status == "ok" and "fits up to 1.00 GiB" in budget.detail


def test_host_name_warns_when_other_nodes_could_not_reach_it(monkeypatch):
    """What this node would hand the others as MASTER_ADDR: unresolvable or loopback warns."""
    from ddp_tutorial.harness import host_checks

    assert host_checks.check_host_name("node-0.invalid").status == "warn"
    loop = host_checks.check_host_name("127.0.0.1")
    assert loop.status == "warn" and "loopback" in loop.detail and "--local-addr" in loop.fix
    routed = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 0))]
    monkeypatch.setattr(host_checks.socket, "getaddrinfo", lambda *a, **k: routed)
    reachable = host_checks.check_host_name("node-0.cluster")
    assert reachable.status == "ok" and "10.0.0.5" in reachable.detail


def test_the_checks_that_fail_by_design_are_those_of_gpus_the_course_cannot_train_on(monkeypatch):
    """Lesson 00 accepts exactly these FAILs: a MIG slice (gpus), a driver too old for this
    torch (cuda); on a machine whose GPUs train (or that has none), none."""
    from ddp_tutorial.harness import gpu_plan

    monkeypatch.setattr(gpu_plan, "mig_fallback", lambda env=None: ({}, ""))
    monkeypatch.setattr(gpu_plan, "torch_sees_no_gpu", lambda: "")
    assert doctor.fails_by_design() == set()
    monkeypatch.setattr(gpu_plan, "mig_fallback", lambda env=None: ({"X": "1"}, "MIG is on"))
    assert doctor.fails_by_design() == {"gpus"}
    monkeypatch.setattr(gpu_plan, "torch_sees_no_gpu", lambda: "built for CUDA 13.0, driver 12.4")
    assert doctor.fails_by_design() == {"gpus", "cuda"}
