"""What a container's or a job's cgroup allows: the doctor's cores and memory (helper 96: a
pod's CPU quota and a SLURM job's --mem were invisible, so the doctor said "ok" to a setup the
OOM killer would end, and advised threads for cores the quota does not give)."""

from __future__ import annotations

from pathlib import Path

from ddp_tutorial import cgroups
from ddp_tutorial.harness.host_checks import check_host_memory

GIB = 2**30


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_cgroup_v2_quota_and_memory_of_this_process_s_own_group(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    root = tree(tmp_path / "fs", {
        "job/step/cpu.max": "250000 100000",  # 2.5 CPUs
        "job/step/memory.max": "max", "job/memory.max": str(8 * GIB),  # the job's --mem
        "job/step/memory.current": str(3 * GIB), "job/memory.current": str(3 * GIB),
    })  # fmt: skip
    assert cgroups.cpu_quota(root, proc) == 2.5
    assert cgroups.memory_left(root, proc) == 5 * GIB
    assert cgroups.cores_within_quota(16, root, proc) == 2, "whole cores: threads per rank"


def test_cgroup_v1_and_no_limit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:memory:/pod\n4:cpu,cpuacct:/pod\n")
    root = tree(tmp_path / "fs", {
        "cpu,cpuacct/pod/cpu.cfs_quota_us": "-1", "cpu,cpuacct/pod/cpu.cfs_period_us": "100000",
        "memory/pod/memory.limit_in_bytes": str(2**63 - 4096),  # v1's "unlimited"
        "memory/pod/memory.usage_in_bytes": str(GIB),
    })  # fmt: skip
    assert cgroups.cpu_quota(root, proc) is None
    assert cgroups.memory_left(root, proc) is None
    assert cgroups.cores_within_quota(16, root, proc) == 16
    (root / "memory/pod/memory.limit_in_bytes").write_text(str(4 * GIB))
    assert cgroups.memory_left(root, proc) == 3 * GIB
    assert cgroups.memory_left(tmp_path / "nowhere", proc) is None, "no cgroup files: no limit"


def test_the_doctor_counts_the_cgroups_limit_not_the_machines_memory(monkeypatch):
    import psutil

    machine = psutil.virtual_memory()._replace(available=64 * GIB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine)
    monkeypatch.setattr(cgroups, "memory_left", lambda *a: 3 * GIB)
    found = check_host_memory(4, 8, dataset_gib=1.0)  # arrays: 4 GiB, over what is left
    assert found.status == "fail" and "3.0 GiB available" in found.detail, found
    assert "limit" in found.detail


def test_helper_97s_cases_page_cache_comounted_v1_a_parents_limit_and_odd_lines(tmp_path):
    """Page cache is not used memory (a job that read its dataset is not near its limit);
    v1's "cpu,cpuacct" mount is read; a limit on a parent group (SLURM's job above its step)
    holds in v1 as in v2; a line that is not a group line is skipped."""
    proc = tmp_path / "cgroup"
    proc.write_text("garbage\n5:memory:/job/step\n4:cpu,cpuacct:/job/step\n")
    root = tree(tmp_path / "fs", {
        "cpu,cpuacct/job/step/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/job/step/cpu.cfs_period_us": "100000",
        "memory/job/memory.limit_in_bytes": str(64 * GIB),  # the job's --mem, on the parent
        "memory/job/memory.usage_in_bytes": str(60 * GIB),
        "memory/job/memory.stat": f"cache {55 * GIB}\ntotal_inactive_file {50 * GIB}",
        "memory/job/step/memory.limit_in_bytes": str(2**63 - 4096),
    })  # fmt: skip
    assert cgroups.cpu_quota(root, proc) == 1.5
    assert cgroups.cores_within_quota(16, root, proc) == 1
    assert cgroups.memory_left(root, proc) == 54 * GIB, "64 - 60 + 50 reclaimable"
