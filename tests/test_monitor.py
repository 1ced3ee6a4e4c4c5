"""The utilization monitor: real per-rank CPU sampling, and the GPU path on a fake NVML.

Lesson 06 (notebooks/06_training_and_utilization.ipynb) asserts on a real
training run that every rank was sampled, busy and balanced, and that the
monitor costs under 1 % of a core.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import gpu_count
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.harness.monitor import Monitor, read_samples_csv, summarize

# No torch in the ranks: the launch costs only torchrun's start-up and the spin.
SPIN = """
import json, os, sys, time
start = time.time()
x = 0
while time.time() - start < 2.5:   # busy on one core for 2.5 s
    x += 1
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "start": start, "end": time.time()}, f)
"""


class FakeNVML:
    """Just enough of pynvml: 4 GPUs whose utilization is 10 * physical id."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 4):
        self.count = count
        self.initialised = 0

    def nvmlInit(self):
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle:08d}-aaaa"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10 * handle, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30, free=0)


@pytest.mark.torchrun
def test_cpu_mode_sees_both_ranks_busy(tmp_path, write_script):
    script = write_script("spin.py", SPIN)
    result = torchrun(
        script,
        nproc=2,
        run_dir=tmp_path,
        echo=False,
        monitor=True,
        monitor_interval=0.25,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    rows = result.utilization
    assert rows and {r["kind"] for r in rows} == {"cpu"}
    assert {r["id"] for r in rows} == {0, 1}
    window = (min(r["start"] for r in result.records), max(r["end"] for r in result.records))
    # rows carry wall time; summarize in the window when both ranks spun
    shifted = [{**r, "t": r["wall"]} for r in rows]
    stats = summarize(shifted, window=(window[0] + 0.5, window[1] - 0.25))
    for rank in (0, 1):
        assert stats[rank]["util_max"] > 30, stats  # a spinning rank keeps a core busy
        assert stats[rank]["mem_max_mib"] > 10
    assert read_samples_csv(tmp_path / "utilization.csv") == rows


def test_gpu_mode_maps_physical_to_logical_ids():
    nvml = FakeNVML()
    mon = Monitor(env={"CUDA_VISIBLE_DEVICES": "3,1"}, nvml=nvml, interval=0.05)
    with mon:
        pass
    rows = mon.samples()
    assert mon.mode == "gpu" and rows
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {0, 1}
    assert by_id[0]["util"] == 30.0 and by_id[1]["util"] == 10.0  # cuda:0 is physical 3
    assert by_id[0]["mem_mib"] == 4 * 1024.0
    assert nvml.initialised == 0, "NVML shut down after stop()"


def test_gpu_mode_accepts_uuids():
    mon = Monitor(env={"CUDA_VISIBLE_DEVICES": "GPU-00000002"}, nvml=FakeNVML(), interval=0.05)
    with mon:
        pass
    assert {r["util"] for r in mon.samples()} == {20.0}


def test_no_visible_gpu_falls_back_to_cpu():
    mon = Monitor(env={"CUDA_VISIBLE_DEVICES": ""}, nvml=FakeNVML(), interval=0.05)
    with mon:
        pass
    assert mon.mode == "cpu"


def test_overhead_is_small():
    mon = Monitor(interval=0.1)
    with mon:
        import time

        time.sleep(1.0)
    assert mon.overhead < 0.05  # under 5 % of one core even at 10 samples/s


def test_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        Monitor(interval=0)


@pytest.mark.gpu
def test_real_nvml_samples_every_visible_gpu():
    mon = Monitor(interval=0.1)
    with mon:
        import time

        time.sleep(0.5)
    assert mon.mode == "gpu"
    assert {r["id"] for r in mon.samples()} == set(range(gpu_count()))
