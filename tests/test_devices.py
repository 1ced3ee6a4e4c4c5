"""``ddp_tutorial.devices``: CUDA_VISIBLE_DEVICES parsing and mapping, NVML faked where needed.

The reference for "what CUDA does" is ``torch.cuda._parse_visible_devices``,
torch's own model of the driver's parser (it reads the environment only and
never initialises CUDA): every value our strict parser accepts must mean the
same there, and every value it refuses must be one CUDA would misread.
"""

from __future__ import annotations

import pytest
import torch

from conftest import fake_gpu
from ddp_tutorial import devices
from ddp_tutorial.devices import (
    DeviceError,
    GpuInfo,
    cuda_reading,
    device_for_local_rank,
    device_order,
    logical_to_physical,
    mapping_table,
    order_matches_nvidia_smi,
    parse_visible_devices,
    physical_to_logical,
)

EIGHT = 8  # a hypothetical 8-GPU box: the mapping is a pure function of the count

GOOD = {
    None: None,
    "": [],
    "  ": [],
    "-1": [],
    "0": ["0"],
    "5,6,7": ["5", "6", "7"],
    "7,5": ["7", "5"],
    " 5, 6 ": ["5", "6"],  # CUDA skips the spaces too (seed 000 writes "0, 1, 2")
    "0, 1, 2": ["0", "1", "2"],
    "01,+2": ["1", "2"],
    "GPU-8c1b": ["GPU-8c1b"],
    "GPU-aa,GPU-bb": ["GPU-aa", "GPU-bb"],
    "MIG-1234": ["MIG-1234"],
}

BAD = {
    "0,0": ("appears twice", "no GPU at all"),
    "1, 1": ("appears twice", "no GPU at all"),
    "0,-1,1": ("negative", "only '0'"),
    "-1,0": ("negative", "no GPU at all"),
    "0,,1": ("empty entry at position 1", "only '0'"),
    "0,": ("stray comma", "only '0'"),
    ",0": ("empty entry at position 0", "no GPU at all"),
    "1gpu": ("neither a GPU index nor a UUID", "only '1'"),
    "cuda:1": ("neither a GPU index nor a UUID", "no GPU at all"),
    "0,GPU-aa": ("mixes GPU indices and UUIDs", "only '0'"),
    "GPU-aa,1": ("mixes GPU indices and UUIDs", "only 'GPU-aa'"),
    "GPU-aa,MIG-bb": ("mixes", "only 'GPU-aa'"),
    "gpu-aa": ("upper case", "no GPU at all"),
    "GPU-": ("nothing after it", None),
    "GPU-aa,GPU-aa": ("appears twice", "no GPU at all"),
    " GPU-aa": ("not around UUIDs", "no GPU at all"),
    "GPU-aa, GPU-bb": ("not around UUIDs", "only 'GPU-aa'"),
}


def torch_reading(monkeypatch: pytest.MonkeyPatch, value: str | None) -> list[str] | None:
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        return None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    return [str(x) for x in torch.cuda._parse_visible_devices()]


@pytest.mark.parametrize("value", list(GOOD), ids=repr)
def test_good_values(value, monkeypatch):
    parsed = parse_visible_devices(value)
    assert parsed == GOOD[value]
    # accepted means: CUDA reads it exactly as written
    assert parsed == cuda_reading(value) == torch_reading(monkeypatch, value)


@pytest.mark.parametrize("value", list(BAD), ids=repr)
def test_bad_values_are_refused_with_what_cuda_would_do(value, monkeypatch):
    problem, consequence = BAD[value]
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES=") as info:
        parse_visible_devices(value)
    message = str(info.value)
    assert problem in message
    if consequence is not None:
        assert f"CUDA would silently see {consequence}" in message
        # our model of the driver agrees with torch's
        assert cuda_reading(value) == torch_reading(monkeypatch, value)


def test_device_error_is_a_value_error():
    assert issubclass(DeviceError, ValueError)


@pytest.mark.parametrize(
    "value",
    ["0", "3,1", "1, 2", "0,-1,1", "1gpu2,2", "0,0", "", "-1", "GPU-a,GPU-b,x", "a,0", "+1"],
)
def test_cuda_reading_matches_torch(value, monkeypatch):
    assert cuda_reading(value) == torch_reading(monkeypatch, value)


# -- physical <-> logical ------------------------------------------------------


def test_seed_002_five_six_seven_are_cuda_zero_one_two():
    assert logical_to_physical("5,6,7", EIGHT) == [5, 6, 7]
    assert physical_to_logical("5,6,7", EIGHT) == {5: 0, 6: 1, 7: 2}


def test_order_is_the_order_written():
    assert logical_to_physical("7,5", EIGHT) == [7, 5]  # cuda:0 is physical 7
    assert physical_to_logical("7,5", EIGHT) == {7: 0, 5: 1}


def test_unset_is_identity_and_empty_is_nothing():
    assert logical_to_physical(None, 4) == [0, 1, 2, 3]
    assert logical_to_physical("", 4) == [] == logical_to_physical("-1", 4)
    assert physical_to_logical("", 4) == {}


def test_out_of_range_names_the_machine():
    with pytest.raises(DeviceError, match=r"GPU 8 does not exist; this machine has 8 GPU\(s\)"):
        logical_to_physical("7,8", EIGHT)
    with pytest.raises(DeviceError, match="GPU 0 does not exist; this machine has 0 GPU"):
        logical_to_physical("0", 0)


def _gpu(index: int, uuid: str, name: str = "H100") -> GpuInfo:
    return GpuInfo(index, name, uuid, 80_000.0, 1.0)


INVENTORY = [_gpu(0, "GPU-aaaa-0000"), _gpu(1, "GPU-bbbb-1111"), _gpu(2, "GPU-abcd-2222")]


def test_uuids_resolve_by_unique_prefix():
    assert logical_to_physical("GPU-bbbb-1111,GPU-aaaa", INVENTORY) == [1, 0]
    assert logical_to_physical("GPU-abc", INVENTORY) == [2]


def test_uuid_errors():
    with pytest.raises(DeviceError, match="matches GPUs"):
        logical_to_physical("GPU-a", INVENTORY)  # GPU-aaaa and GPU-abcd
    with pytest.raises(DeviceError, match="no GPU on this machine has UUID"):
        logical_to_physical("GPU-ffff", INVENTORY)
    with pytest.raises(DeviceError, match="without the NVML inventory"):
        logical_to_physical("GPU-aaaa", 3)
    with pytest.raises(DeviceError, match="MIG instance"):
        logical_to_physical("MIG-aaaa", INVENTORY)


def test_mapping_table_rows():
    rows = mapping_table("7,5", EIGHT)
    assert [(r["device"], r["physical (nvidia-smi)"]) for r in rows] == [
        ("cuda:0", 7),
        ("cuda:1", 5),
    ]


# -- device for a rank -----------------------------------------------------------


def test_device_for_local_rank():
    assert device_for_local_rank(0, 2) == "cuda:0"
    assert device_for_local_rank(1, 2) == "cuda:1"
    assert device_for_local_rank(3, 0) == "cpu"


def test_device_for_local_rank_errors():
    with pytest.raises(DeviceError, match="only 2 are visible"):
        device_for_local_rank(2, 2)  # what seed 000's global rank 2 would ask for
    with pytest.raises(DeviceError, match=">= 0"):
        device_for_local_rank(-1, 2)


# -- CUDA_DEVICE_ORDER -----------------------------------------------------------


def test_device_order():
    assert device_order({}) == "FASTEST_FIRST"
    assert device_order({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == "PCI_BUS_ID"
    with pytest.raises(DeviceError, match="FASTEST_FIRST' or 'PCI_BUS_ID"):
        device_order({"CUDA_DEVICE_ORDER": "pci"})


def test_order_matches_nvidia_smi():
    mixed = [_gpu(0, "GPU-a", "T400"), _gpu(1, "GPU-b", "A100")]
    assert order_matches_nvidia_smi({}, INVENTORY)  # identical cards
    assert not order_matches_nvidia_smi({}, mixed)  # the A100 would be cuda:0
    assert order_matches_nvidia_smi({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, mixed)


# -- NVML (faked: this machine has no driver) ------------------------------------


def test_inventory_without_driver(nvml):
    nvml(None)
    assert devices.gpu_inventory() == []
    assert devices.visible_gpu_count({}) == 0
    assert devices.gpu_memory_report() == []


def test_inventory_and_visible_gpus(nvml):
    gpus = [_gpu(i, f"GPU-{i}{i}{i}{i}") for i in range(8)]
    mod = nvml(gpus)
    inventory = devices.gpu_inventory()
    assert [g.index for g in inventory] == list(range(8))
    assert inventory[0].name == "H100" and inventory[0].memory_total_mib == 80_000.0
    assert mod.state["inits"] == 0, "every nvmlInit is paired with a shutdown"
    assert [g.index for g in devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "5,6,7"})] == [5, 6, 7]
    assert [g.index for g in devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-7777"})] == [7]
    assert devices.visible_gpu_count({}) == 8
    assert devices.visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    with pytest.raises(DeviceError, match="appears twice"):
        devices.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,1"})


def test_one_gpu_nvml_refuses_is_left_out_and_said_the_others_are_used(nvml):
    """A GPU outside the container's cgroup: "Insufficient Permissions" for that one only."""
    nvml([fake_gpu(i) for i in range(4)], refused={2: "Insufficient Permissions"})
    problems: list[str] = []
    inventory = devices.gpu_inventory(problems)
    assert [g.index for g in inventory] == [0, 1, 3]
    assert problems == ["GPU 2: NVML refused to describe it (Insufficient Permissions); left out"]
    assert devices.visible_gpu_count({}) == 3
    assert [g.index for g in devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "3"})] == [3]


def test_the_inventory_knows_capability_and_compute_mode(nvml):
    nvml([fake_gpu(0, name="Tesla T4", capability=(7, 5), exclusive=True), fake_gpu(1)])
    t4, h100 = devices.gpu_inventory()
    assert (t4.capability, t4.exclusive) == ((7, 5), True)
    assert (h100.capability, h100.exclusive) == ((9, 0), False)


def test_mig_refusal_says_how_to_run_on_the_cpu_instead(nvml):
    nvml([fake_gpu(i, mig=True) for i in range(2)])
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES= make run"):
        devices.visible_gpu_count({})
    assert devices.visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0  # the CPU route works


def test_the_environment_report_survives_mig_and_plans_the_cpu(nvml):
    from ddp_tutorial.harness.environment import environment_report, format_report

    nvml([fake_gpu(i, mig=True) for i in range(2)])
    report = environment_report()
    assert "MIG mode is on" in report["gpu_error"]
    assert report["plan"]["backend"] == "gloo" and report["plan"]["nproc"] == 2
    assert "MIG mode is on" in format_report(report)


def test_gpu_memory_report_lists_processes_per_gpu(nvml):
    nvml([_gpu(0, "GPU-a"), _gpu(1, "GPU-b")], pids={0: [30, 10], 1: [20]})
    report = devices.gpu_memory_report()
    assert [r["pids"] for r in report] == [[10, 30], [20]]
    assert report[0]["memory_used_mib"] == 1024.0  # the fake: (index + 1) GiB


def test_gpu_memory_report_survives_an_nvml_that_refuses(nvml):
    """A cgroup-restricted NVML: one device refused, or memory readings refused outright."""
    nvml([fake_gpu(0), fake_gpu(1), fake_gpu(2)], refused={1: "Insufficient Permissions"})
    assert [r["physical"] for r in devices.gpu_memory_report()] == [0, 2]
    problems: list[str] = []
    report = devices.gpu_memory_report(problems)
    assert [r["physical"] for r in report] == [0, 2]
    assert problems == ["GPU 1: NVML refused its memory (Insufficient Permissions); left out"]
    nvml([fake_gpu(0), fake_gpu(1)], failing={"nvmlDeviceGetMemoryInfo"})
    problems = []
    assert devices.gpu_memory_report(problems) == []
    assert len(problems) == 2 and "Not Supported" in problems[0]
    assert devices.gpu_memory_report() == []  # no list given: still no exception


NO_CUDA_INIT = """
import json, torch
calls = []
real = torch.cuda._lazy_init  # every path that starts CUDA goes through it
torch.cuda._lazy_init = lambda: calls.append("_lazy_init") or (torch.cuda.is_available() and real())
from ddp_tutorial import devices
devices.parse_visible_devices("5,6,7")
devices.visible_gpu_count()
devices.gpu_memory_report()
print(json.dumps({"initialised": torch.cuda.is_initialized(), "calls": calls}))
"""


@pytest.mark.torchrun  # a fresh interpreter: in this one CUDA may already be up (GPU tests)
def test_nothing_here_initialises_cuda():
    """The kernel may call these; CUDA started there would break every later fork.

    Without a GPU ``is_initialized()`` is always False: the recorded ``_lazy_init``
    calls are what can fail here; on a GPU machine both can.
    """
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NO_CUDA_INIT], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"initialised": False, "calls": []}


STARTED = """
import json, torch
from ddp_tutorial.harness.environment import environment_report, kernel_started_cuda
seen = [kernel_started_cuda()]
environment_report()  # lesson 00's first cell: it must start nothing either
seen.append(kernel_started_cuda())
torch.cuda.is_available()  # starts the driver on a CUDA build; is_initialized() stays False
print(json.dumps({"seen": seen + [kernel_started_cuda()], "flag": torch.cuda.is_initialized()}))
"""


@pytest.mark.torchrun  # a fresh interpreter, as for the test above
def test_kernel_started_cuda_sees_is_available_that_is_initialized_misses():
    """The lessons' "the kernel never touched CUDA" asserts use it (helper 135: with
    ``is_initialized()`` alone, an ``is_available()`` in the kernel passed them)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STARTED], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    # a CPU-only build has no CUDA runtime to ask: nothing starts
    assert got == {"seen": [False, False, bool(torch.version.cuda)], "flag": False}


def test_mig_is_refused_with_what_to_do_not_counted_as_gpus(nvml):
    """MIG on, no CUDA_VISIBLE_DEVICES: NVML lists 8 GPUs, CUDA would show one instance."""
    nvml([fake_gpu(i, mig=True) for i in range(8)])
    with pytest.raises(DeviceError, match="MIG mode is on for GPU.*whole GPUs"):
        devices.visible_gpu_count({})
    nvml([fake_gpu(0, mig=True), fake_gpu(1), fake_gpu(2)])
    assert devices.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,2"}) == 2  # MIG-free GPUs
    with pytest.raises(DeviceError, match="is a MIG instance, not a whole GPU"):
        devices.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "MIG-0a1b2c3d"})
    # a slice picked by its UUID (the usual way) is MIG too: the lessons run on the CPU
    # (helper 85: a plain DeviceError passed mig_fallback and failed every GPU lesson's launch)
    from ddp_tutorial.harness.gpu_plan import launch_gpu_count, mig_fallback

    slice_ = {"CUDA_VISIBLE_DEVICES": "MIG-0a1b2c3d"}
    assert launch_gpu_count(slice_) == 0 and "MIG instance" in mig_fallback(slice_)[1]


def test_collection_survives_a_mig_machine(nvml):
    import conftest

    nvml([fake_gpu(i, mig=True) for i in range(2)])
    count, why = conftest.gpu_view()
    assert count == 0 and "MIG" in why


def test_setup_calls_bind_then_join_outside_any_job(monkeypatch):
    """Lesson 03 records ``setup()``'s torch calls in a kernel that is in no job:
    no MASTER_ADDR, no store to reach. (CI caught it needing one once.)"""
    from ddp_tutorial.lessons.device_mapping import setup_calls

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    calls = setup_calls(local_rank=1)
    assert [name for name, _ in calls] == ["set_device", "init_process_group"]
    assert calls[0][1] == calls[1][1]["device_id"] == torch.device("cuda", 1)
    assert calls[1][1]["rank"] == 1 and calls[1][1]["world_size"] == 2


def test_a_mig_parent_whose_memory_nvml_refuses_is_still_seen_as_mig(nvml):
    """Helper 85: the memory query of a MIG-mode parent needs privileges (NVML's docs); it
    was read first, and the refused GPU was left out of the inventory, MIG mode and all: the
    refusal that puts the lessons on the CPU never fired. Now it stays, NaN MiB, said."""
    import math

    nvml([fake_gpu(0, mig=True)], failing={"nvmlDeviceGetMemoryInfo"})
    problems: list[str] = []
    (gpu,) = devices.gpu_inventory(problems)
    assert gpu.mig and math.isnan(gpu.memory_total_mib) and "no memory figures" in problems[0]
    with pytest.raises(devices.MigError):
        devices.visible_gpu_count({})


def test_a_gpu_without_memory_figures_is_reported_not_a_crash(nvml):
    """Helper 86: with the GPU kept at NaN MiB, ``ddp-tutorial env`` (and lesson 00) rounded
    NaN: ValueError. It prints "?" now, the note under "gpu problem" (the GPU is not left out)."""
    from ddp_tutorial.harness.environment import environment_report, format_report

    nvml([fake_gpu(0)], failing={"nvmlDeviceGetMemoryInfo"})
    text = format_report(report := environment_report())
    assert report["gpus"][0]["memory_total_mib"] is None and "?/? MiB used" in text
    assert "gpu problem" in text and "no memory figures" in text
