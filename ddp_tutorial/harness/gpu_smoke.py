"""make gpu-smoke: what the first GPU this course meets should tell us, in 8 minutes.

``make gpu-check`` runs every GPU branch and takes much longer; this is the short list that
answers the open questions, on one GPU, with only the torch already there (no pip, no
Jupyter). Each step runs in its own process with its own time limit (they add up to
:data:`BUDGET_S`), a failing or hanging step is one row and the next step runs. Everything
goes to one folder, ``$OUT`` if set, else ``build/gpu-smoke``: ``smoke.json`` (every row and
every measurement), ``smoke.txt`` (the table), and each step's log and files.

1. inventory: python, torch, CUDA build, NCCL, driver, each GPU's name, memory, MIG mode
   and compute mode (NVML);
2. the ``gpu`` tests that one GPU can run (``pytest -m gpu``; those needing two skip);
3. lesson 11's script (autocast, ``torch.compile``, comm hooks, overlap) on one rank: its
   time, and the size of what it wrote (a 2048-wide model's weights in JSON were gigabytes);
4. lesson 06's utilization: the template with resnet18 (the CNN where torchvision is missing)
   while NVML samples the GPU;
5. lesson 12's memory: the allocator's peak beside the process's memory in NVML (the CUDA
   context, the cache, NCCL's buffers are not in ``max_memory_allocated``);
6. two ``--deterministic`` template runs: the same ``final.pt``, bit for bit.

Without a GPU every step is still a row: "not run: no GPU", but the inventory; with
``--cpu`` the steps that can run on a CPU run there (lesson 11's script, the utilization
probe, the bitwise runs): a rehearsal of the smoke itself, within the same 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from ddp_tutorial import settings
from ddp_tutorial.harness.gpu_check import Step, missing_packages, run_step_command

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 480.0  # 8 minutes: the steps' limits add up to this


def smoke_plan(out: Path, python: str = sys.executable) -> list[Step]:
    """The steps, in order; their limits sum to :data:`BUDGET_S`."""
    probe = [python, "-m", "ddp_tutorial.harness.gpu_probes"]
    # -v: a line per test as it ends, so a step stopped at its limit (one GPU: about 9
    # launches and 9 processes, estimated near the 150 s) still shows which tests ran
    pytest = [python, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-o",
              "addopts=", f"--junitxml={out / 'gpu-tests.xml'}", "tests"]  # fmt: skip
    speed = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "scripts/demos/speed_tools.py", "--out", str(out / "speed_tools")]  # fmt: skip
    cpu = {"runs_on_cpu": True}  # --cpu: these also run on a machine without a GPU
    return [
        # a cold torch import and CUDA's start on 8 GPUs without persistence mode: tens of s
        Step("inventory", [*probe, "inventory", str(out)], 60, measures="inventory", **cpu),
        Step("gpu tests (one GPU)", pytest, 150),
        Step("lesson 11: amp, compile, overlap", speed, 120, **cpu),
        Step(
            "lesson 06: utilization",
            [*probe, "utilization", str(out)],
            50,
            measures="utilization",
            **cpu,
        ),
        Step("lesson 12: memory", [*probe, "memory", str(out)], 40, measures="memory"),
        Step(
            "template twice, bitwise", [*probe, "bitwise", str(out)], 60, measures="bitwise", **cpu
        ),
    ]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_smoke_step(step: Step, out: Path, index: int) -> dict[str, object]:
    """Run one step; its row (never raises: a failed step is a row)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, settings.RUNS_ENV: str(out / "runs"), **dict(step.env)}
    done = run_step_command(step.command, timeout=step.timeout_s, env=env, cwd=str(REPO))
    (out / f"step{index}.log").write_text(done.output)
    if done.timed_out:
        status = f"TIMEOUT ({step.timeout_s:.0f} s)"
    else:
        status = "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
    row: dict[str, object] = {"step": step.name, "seconds": round(done.seconds, 1),
                              "status": status, "log": f"step{index}.log"}  # fmt: skip
    measured = out / f"{step.measures}.json"
    if step.measures and measured.is_file():
        row["measured"] = json.loads(measured.read_text())
    if "speed_tools" in " ".join(step.command):
        row["measured"] = {"bytes_written": folder_bytes(out / "speed_tools")}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--cpu", action="store_true", help="without a GPU: run the steps that "
                        "can run on the CPU (a rehearsal of the smoke itself)")  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT") or REPO / "build" / "gpu-smoke").resolve()
    steps = smoke_plan(out)
    if args.dry_run:
        for step in steps:
            print(f"{step.timeout_s:5.0f} s  {step.name}: {' '.join(step.command)}")
        print(f"{sum(s.timeout_s for s in steps):5.0f} s  in all, at most; into {out}")
        return 0
    if missing_packages("gpu-smoke"):
        return 2
    from ddp_tutorial.devices import DeviceError, visible_gpus
    from ddp_tutorial.harness.gpu_plan import torch_blind
    from ddp_tutorial.records import format_table

    try:
        listed = visible_gpus()
        why = torch_blind(len(listed)) if listed else "no GPU visible (NVML, CUDA_VISIBLE_DEVICES)"
    except DeviceError as exc:  # MIG: the course runs on the CPU there (devices.MigError)
        listed, why = [], str(exc)
    gpus = 0 if why else len(listed)
    if gpus < 1:  # every row still: the inventory (and with --cpu what runs on a CPU)
        print(f"gpu-smoke: {why}: the GPU steps are rows 'not run: no GPU'"
              + ("; the others run on the CPU" if args.cpu else ""), file=sys.stderr)  # fmt: skip
    else:  # the gpu tests on one GPU, as the step says: with 8 each would launch 8 ranks
        one = ((settings.VISIBLE_DEVICES_ENV, listed[0].uuid),)
        steps = [replace(s, env=one) if s.name.startswith("gpu tests") else s for s in steps]
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, step in enumerate(steps):
        if gpus < 1 and not (step.runs_on_cpu and (args.cpu or step.name == "inventory")):
            rows.append({"step": step.name, "seconds": 0.0, "status": "not run: no GPU", "log": ""})
            continue
        print(f"gpu-smoke: {step.name} ...", flush=True)
        rows.append(run_smoke_step(step, out, i))
        if gpus < 1 and rows[-1]["status"] == "ok":
            rows[-1]["status"] = "ok (on the CPU)"
        (out / "smoke.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "smoke.json").write_text(json.dumps(rows, indent=1, default=str))
    table = format_table(rows, ["step", "seconds", "status", "log"])
    (out / "smoke.txt").write_text(table + "\n")
    print(f"\n{table}\n\neverything measured: {out / 'smoke.json'}")
    ran = [r for r in rows if not str(r["status"]).startswith("not run")]
    if not all(str(r["status"]).startswith("ok") for r in ran):
        return 1
    return 0 if gpus or args.cpu else 2  # no GPU and no --cpu: nothing was checked


if __name__ == "__main__":
    sys.exit(main())
