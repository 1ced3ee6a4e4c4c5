"""``make gpu-smoke`` from this CPU machine: its plan fits 8 minutes, and it runs to the end.

The probes themselves need a GPU; what a CPU can prove is that every step's command names
something that exists, that the limits add up to the budget, and that a failing and a
hanging step each become a row while the steps after them still run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from ddp_tutorial.harness import gpu_probes, gpu_smoke
from ddp_tutorial.harness.gpu_check import Step


def test_the_plan_fits_eight_minutes_and_names_what_exists(tmp_path):
    steps = gpu_smoke.smoke_plan(tmp_path)
    assert sum(s.timeout_s for s in steps) == gpu_smoke.BUDGET_S <= 8 * 60
    for step in steps:
        if "gpu_probes" in step.command:
            assert step.command[step.command.index("gpu_probes") + 1] in gpu_probes.PROBES
        for word in step.command:
            if word.endswith(".py"):
                assert (REPO / word).is_file(), f"{step.name}: {word} does not exist"
    assert {s.measures for s in steps if s.measures} <= set(gpu_probes.PROBES)


@pytest.mark.torchrun  # it starts small Python processes (no torchrun)
def test_a_failing_and_a_hanging_step_are_rows_and_the_rest_still_runs(
    tmp_path, monkeypatch, capsys
):
    py = sys.executable
    fake = [
        Step("fails", [py, "-c", "raise SystemExit(3)"], 20),
        Step("hangs", [py, "-c", "import time; time.sleep(60)"], 1.5),
        Step(
            "measures",
            [py, "-m", "ddp_tutorial.harness.gpu_probes", "nope", str(tmp_path)],
            30,
            measures="nope",
        ),  # fmt: skip
        Step("works", [py, "-c", "print('fine')"], 20),
    ]
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_smoke, "smoke_plan", lambda out: fake)
    monkeypatch.setattr("ddp_tutorial.devices.visible_gpus", lambda: [OneGpu()])
    monkeypatch.setattr("ddp_tutorial.harness.gpu_plan.torch_blind", lambda gpus: "")
    assert gpu_smoke.main([]) == 1
    rows = json.loads((tmp_path / "smoke.json").read_text())
    assert [r["status"] for r in rows] == [
        "FAILED (exit 3)", "TIMEOUT (2 s)", "FAILED (exit 1)", "ok"]  # fmt: skip
    assert rows[2]["measured"]["ok"] is False, "a probe that fails still writes its JSON"
    assert "KeyError" in rows[2]["measured"]["error"]
    assert (tmp_path / "step3.log").read_text().strip() == "fine"
    assert "works" in (tmp_path / "smoke.txt").read_text()


@pytest.mark.torchrun  # it starts small Python processes (no torchrun)
def test_without_a_gpu_every_step_is_a_row_and_cpu_runs_what_can(tmp_path, monkeypatch, capsys):
    """Issue 33: on a CPU machine the smoke runs to the end: the GPU steps are rows "not run:
    no GPU", the inventory runs; with --cpu the steps that can run on a CPU run there."""
    py = sys.executable
    fake = [
        Step("inventory", [py, "-c", "print('versions')"], 20, runs_on_cpu=True),
        Step("needs a gpu", [py, "-c", "raise SystemExit(9)"], 20),
        Step("cpu too", [py, "-c", "print('rehearsed')"], 20, runs_on_cpu=True),
    ]
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_smoke, "smoke_plan", lambda out: fake)
    monkeypatch.setattr("ddp_tutorial.devices.visible_gpus", lambda: [])
    assert gpu_smoke.main([]) == 2, "nothing checked on a GPU: not a pass"
    assert "no GPU visible" in capsys.readouterr().err
    rows = json.loads((tmp_path / "smoke.json").read_text())
    assert [r["status"] for r in rows] == ["ok (on the CPU)", "not run: no GPU", "not run: no GPU"]
    assert gpu_smoke.main(["--cpu"]) == 0
    rows = json.loads((tmp_path / "smoke.json").read_text())
    assert [r["status"] for r in rows] == ["ok (on the CPU)", "not run: no GPU", "ok (on the CPU)"]
    assert (tmp_path / "step2.log").read_text().strip() == "rehearsed"
    assert "not run: no GPU" in (tmp_path / "smoke.txt").read_text()


def test_the_real_plan_rehearses_on_a_cpu_all_but_the_cuda_only_steps(tmp_path):
    steps = {s.name: s.runs_on_cpu for s in gpu_smoke.smoke_plan(tmp_path)}
    assert [name for name, cpu in steps.items() if not cpu] == [
        "gpu tests (one GPU)", "lesson 12: memory"]  # fmt: skip


@pytest.mark.gpu
def test_the_smoke_probes_run_on_a_gpu(tmp_path):
    """Each probe in a process of its own, as the smoke runs them: in this one, the memory
    probe's CUDA context (and its cache) would stay on GPU 0 for the rest of the session,
    and on GPUs in EXCLUSIVE_PROCESS mode every later test's context would be refused."""
    for name in ("inventory", "memory"):
        done = subprocess.run([sys.executable, "-m", "ddp_tutorial.harness.gpu_probes", name,
                               str(tmp_path)], capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["max_allocated_mib"] > 4 * 64 * 4  # the weights alone: 64 M floats


def test_the_inventory_keeps_every_gpu_row_when_nvml_refuses_one_fact(nvml):
    """Helper 83: only MIG and compute mode were guarded; a GPU outside this container's
    cgroup (its handle refused) or a memory query refused on a MIG parent failed the whole
    inventory, and with it the MIG facts the smoke exists to collect."""
    from conftest import fake_gpu as gpu

    nvml([gpu(0), gpu(1, mig=True), gpu(2)], refused={2: "Insufficient Permissions"},
         failing={"nvmlDeviceGetMemoryInfo"})  # fmt: skip
    facts = gpu_probes._nvml_facts()
    assert [g["index"] for g in facts["gpus"]] == [0, 1, 2]
    assert facts["gpus"][1]["mig"] == [1, 1] and "H100" in str(facts["gpus"][1]["name"])
    assert facts["gpus"][0]["memory_mib"].startswith("n/a (")
    assert facts["gpus"][2] == {"index": 2, "error": "n/a (Insufficient Permissions)"}


class OneGpu:
    uuid = "GPU-0a1b2c3d-0000-1111-2222-333344445555"


def test_the_gpu_tests_step_sees_one_gpu_of_eight(tmp_path, monkeypatch):
    """Helper 100: "gpu tests (one GPU)" ran every gpu test with every GPU (8 ranks each,
    inside its 150 s); the step gets the first GPU alone, by UUID."""
    seen = {}

    def run(command, timeout, env, cwd):
        seen[command[2] if command[1] == "-m" else command[1]] = env
        return type("Done", (), {"timed_out": False, "returncode": 0, "seconds": 0.1,
                                 "output": ""})()  # fmt: skip

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("ddp_tutorial.devices.visible_gpus", lambda: [OneGpu()] * 8)
    monkeypatch.setattr("ddp_tutorial.harness.gpu_plan.torch_blind", lambda gpus: "")
    monkeypatch.setattr(gpu_smoke, "run_step_command", run)
    assert gpu_smoke.main([]) == 0
    assert seen["pytest"]["CUDA_VISIBLE_DEVICES"] == OneGpu.uuid
    probes = seen["ddp_tutorial.harness.gpu_probes"]
    assert "CUDA_VISIBLE_DEVICES" not in probes, "the other steps: the machine as it is"


def test_the_utilization_probe_averages_the_training_not_the_launch(tmp_path, monkeypatch):
    """Helper 100: 60 steps of a 10-20 s launch were averaged with its start-up, when nobody
    computes: the probe reads the training's span from the ranks' records, as lesson 06 does
    (on this CPU: 83 % over the launch, 175 % over the training)."""
    from ddp_tutorial.harness import gpu_probes, launch

    samples = [{"t": t, "wall": 1000.0 + t, "kind": "gpu", "id": 0, "util": u, "mem_mib": 1.0}
               for t, u in ((1, 0.0), (5, 90.0), (6, 100.0), (9, 0.0))]  # fmt: skip
    ran = launch.RunResult(["torchrun"], 0, "", tmp_path, 10.0, timed_out=False,
                           records=[{"rank": 0, "train_start": 1004.0, "train_end": 1007.0}],
                           utilization=samples)  # fmt: skip
    monkeypatch.setattr(launch, "torchrun", lambda *a, **k: ran)
    got = gpu_probes.utilization(tmp_path)
    assert got["per_gpu"][0]["util_mean"] == 95.0 and got["window_s"] == 3.0
