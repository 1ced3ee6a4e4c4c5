"""``make gpu-check``: the one prepared command a GPU owner runs, and the table it prints.

On a machine with GPUs and only what :data:`NEEDS` lists — torch, pytest, psutil,
nvidia-ml-py, matplotlib, numpy, pillow, tqdm, and torchvision if it is there (without it,
lessons 04 and 06, whose resnet18 needs it, are rows "not run"); no pip, no Jupyter — it
runs, each with a time limit:

1. the ``gpu``-marked tests (``pytest -m gpu``);
2. ``scripts/demos/hello.py`` with nccl across *every* visible GPU — with two or
   more, that is real communication between GPUs;
3. the GPU branches of lessons 03, 04, 05, 06, 08 (``--deterministic``), 09,
   10 (``NCCL_DEBUG`` lines), 11 (cuda autocast, inductor, the CUDA
   profiler) and 12 (peak memory per rank: DDP, FSDP2, FSDP2 with bf16),
   their code cells run by
   :mod:`ddp_tutorial.harness.plain_notebook` (no Jupyter needed);

then prints one row per step and exits non-zero if any failed. A lesson whose GPU branch
needs more GPUs than the machine has (:data:`LESSON_RANKS`: two ranks, one GPU) runs on
the CPU with gloo: its row says "GPU branch not run: needs N GPUs", never "ok". Every step
has a limit that grows with the GPUs and the launches it starts
(:func:`lesson_limit_s`: the lessons take 13-68 s each on a quiet 2-core CPU, measured;
each launch's start-up, the runs that wait for each other on EXCLUSIVE_PROCESS GPUs and
inductor's cold compile are estimated, not measured: no GPU has run this yet; torchrun's
grace after each nccl crash is torch's own default). A MIG machine is refused with the
reason: its lessons run on the CPU (the course needs whole GPUs), nothing is left to check.
:func:`plan` is what it would do on a machine, a pure function of the GPU
count, so that this machine (no GPU) can check it for 1, 2 and 8 GPUs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_tutorial import settings
from ddp_tutorial.lessons.utilization import GPU_SECONDS

REPO = Path(__file__).resolve().parents[2]
# Each GPU lesson with the launches (torchrun / mp.spawn / python subprocesses) its code
# cells start on a GPU machine, counted from the notebooks (a test keeps this a bound).
LESSONS = {"03_device_mapping": 8, "04_ddp_wrapping": 4, "05_checkpointing": 6,
           "06_training_and_utilization": 4, "08_fault_tolerance": 6, "09_debugging": 14,
           "10_multinode": 10, "11_speed_tools": 3, "12_beyond_ddp": 4}  # fmt: skip
# What the check imports, by module: the pip name where it differs. A test keeps this the
# union of the package's and the scripts' third-party imports (less the Jupyter stack).
NEEDS = {"torch": "torch", "torchvision": "torchvision", "pytest": "pytest", "psutil": "psutil",
         "pynvml": "nvidia-ml-py", "matplotlib": "matplotlib", "numpy": "numpy",
         "PIL": "pillow", "tqdm": "tqdm"}  # fmt: skip
# What a GPU box may lack and still check the rest: the lessons that need it (resnet18) are
# rows "not run"; its gpu tests skip themselves (pytest.importorskip).
OPTIONAL = {"torchvision": ("04_ddp_wrapping", "06_training_and_utilization")}
# The ranks a lesson's GPU branch needs (its NPROC; a test reads them from the notebooks):
# with fewer GPUs its launches run on the CPU, and the row says so instead of "ok".
LESSON_RANKS = {"04_ddp_wrapping": 2, "06_training_and_utilization": 2, "08_fault_tolerance": 2,
                "11_speed_tools": 2, "12_beyond_ddp": 2}  # fmt: skip
GPU_TEST_LAUNCHES = 23  # torchrun launches of `pytest -m gpu`, most with every GPU
COLD_COMPILE_S = {"11_speed_tools": 90.0}  # inductor's first compile on a fresh machine
# A rank that dies on purpose (--fail-at-step) leaves its peers in an nccl collective, which
# notices no dead peer: torchrun SIGTERMs them, and the template's handler only sets a flag
# that a rank stuck in C++ never reads, so torchrun waits its grace period, then SIGKILLs.
# Gloo sees the closed socket at once: on the CPU these cost nothing. (A test keeps the counts
# a bound of the --fail-at-step launches in each notebook.)
NCCL_CRASHES = {"08_fault_tolerance": 1, "10_multinode": 1}
# Launches a lesson starts side by side that wait for one another on EXCLUSIVE_PROCESS GPUs
# (`launch.start`); each then adds its own run, estimated at SERIAL_RUN_S past its start-up.
SIDE_BY_SIDE = {"08_fault_tolerance": 4}
SERIAL_RUN_S = 20.0  # estimated: the template's 2 short epochs take ~10 s on this 2-core CPU


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's --shutdown-timeout default
# The lessons' runs on a GPU that last seconds by design: lesson 06's demo, twice
# (lessons.utilization.GPU_SECONDS each; its step count is fixed from its own first steps).
GPU_RUNS = {"06_training_and_utilization": 2}


def crash_grace_s() -> float:
    """torchrun's wait between SIGTERM and SIGKILL for the workers it stops (30 s in torch 2.x).

    torch 2.12+: ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` where set (torchrun's
    ``--shutdown-timeout`` default, ``LaunchConfig``), else the default of the agent's
    ``_shutdown``; before, the default of the ``close`` it calls without one (the variable is
    not read there). Read from torch: the time plan follows torch, not a copy of its number.
    """
    import inspect

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    if (
        timeout := inspect.signature(SimpleElasticAgent._shutdown).parameters.get("timeout")
    ) is None:
        return float(inspect.signature(PContext.close).parameters["timeout"].default)
    return float(os.environ.get(SHUTDOWN_TIMEOUT_ENV) or timeout.default)


def launch_s(gpus: int) -> float:
    """An upper bound on one launch's cost with ``gpus`` ranks: start-up, nccl init, a few steps.

    An estimate, not a measurement (no GPU was lent when it was written): a CPU
    launch here costs 5-7 s, and nccl's communicator set-up grows with the ranks.
    """
    return 10.0 + 1.5 * gpus


def lesson_limit_s(lesson: str, gpus: int, exclusive: bool = False) -> float:
    """A lesson's limit: its CPU budget (60 s) plus its launches, a cold compile, torchrun's
    grace for each nccl crash and, on ``exclusive`` GPUs, the runs that wait for each other."""
    limit = 60.0 + LESSONS[lesson] * launch_s(gpus) + COLD_COMPILE_S.get(lesson, 0.0)
    limit += GPU_RUNS.get(lesson, 0) * GPU_SECONDS
    limit += NCCL_CRASHES.get(lesson, 0) * crash_grace_s()
    if exclusive:
        limit += SIDE_BY_SIDE.get(lesson, 0) * (launch_s(gpus) + SERIAL_RUN_S)
    return limit


@dataclass(frozen=True)
class Step:
    """One command of the check, with its limit and what it shows."""

    name: str
    command: list[str]
    timeout_s: float
    note: str = ""
    measures: str = ""  # gpu-smoke: the probe's JSON (OUT/<measures>.json) read into the row
    cpu_only: str = ""  # the status of a run that passed on the CPU, not on GPUs (too few)
    skip: str = ""  # the status of a step not run at all (a package it needs is missing)
    env: tuple[tuple[str, str], ...] = ()  # variables of its own (gpu-smoke: one GPU)
    runs_on_cpu: bool = False  # gpu-smoke --cpu: the step also runs without a GPU (rehearsal)


def plan(gpus: int, python: str = sys.executable, exclusive: bool = False,
         missing: tuple[str, ...] = ()) -> list[Step]:  # fmt: skip
    """The steps for a machine whose ranks would see ``gpus`` GPUs (``exclusive``: in compute
    mode EXCLUSIVE_PROCESS, one process per GPU; ``missing``: optional packages it lacks)."""
    if gpus < 1:
        raise SystemExit(
            "gpu-check: no GPU visible to CUDA here (NVML count and CUDA_VISIBLE_DEVICES): "
            "nothing to check. Run `make test` on a machine without GPUs."
        )
    torchrun = [python, "-m", "torch.distributed.run", "--standalone"]
    hello_note = (
        f"nccl all_reduce across {gpus} GPUs"
        if gpus > 1
        else "one GPU: nccl starts, but no communication between GPUs is tested"
    )
    pytest = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    hello = [*torchrun, "--nproc-per-node", str(gpus), "scripts/demos/hello.py"]
    hello += ["--backend", "nccl"]
    steps = [
        Step("gpu tests", [*pytest, "tests"], 60.0 + GPU_TEST_LAUNCHES * launch_s(gpus + 1)),
        Step(f"hello, nccl, {gpus} rank(s)", hello, 30.0 + launch_s(gpus), hello_note),
    ]
    runner = [python, "-m", "ddp_tutorial.harness.plain_notebook"]
    for lesson in LESSONS:
        command = [*runner, f"notebooks/{lesson}.ipynb"]
        ranks = LESSON_RANKS.get(lesson, 1)
        cpu_only = f"GPU branch not run: needs {ranks} GPUs" if gpus < ranks else ""
        limit = lesson_limit_s(lesson, gpus, exclusive)
        lacks = [name for name in missing if lesson in OPTIONAL.get(name, ())]
        skip = f"not run: no {', '.join(lacks)} (resnet18)" if lacks else ""
        steps.append(Step(f"lesson {lesson[:2]}", command, limit, cpu_only=cpu_only, skip=skip))
    return steps


def run_step(step: Step) -> dict[str, object]:
    """Run one step from the repository root (its whole tree killed on a timeout); a table row."""
    if step.skip:
        return {"step": step.name, "seconds": 0.0, "status": step.skip, "note": step.note}
    # The package from this source tree, for every process below (notebooks run from
    # notebooks/, their ranks from wherever torchrun starts them): an absolute path.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    runs = str(REPO / "build" / "gpu-check-runs")  # the lessons' runs: not into notebooks/
    env = {"PYTHONPATH": path, settings.RUNS_ENV: runs}
    done = run_step_command(step.command, timeout=step.timeout_s, env=env, cwd=str(REPO))
    if done.timed_out:
        status = f"TIMEOUT ({step.timeout_s:.0f} s)"
    else:
        status = (
            (step.cpu_only or "ok") if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        )
    if status != "ok":
        print(f"--- {step.name}: {status}\n{done.output[-4000:]}", flush=True)
    return {"step": step.name, "seconds": round(done.seconds, 1), "status": status,
            "note": step.note}  # fmt: skip


def run_step_command(*args: object, **kwargs: object) -> object:
    """processes.run_command, imported when a step runs: it needs psutil, one of NEEDS, and a
    box without it must hear that from :func:`missing_packages`, not from an ImportError."""
    from ddp_tutorial.harness.processes import run_command as run

    return run(*args, **kwargs)  # type: ignore[arg-type]


def missing_packages(tool: str) -> list[str]:
    """The pip names of what this box lacks from NEEDS (less OPTIONAL), said on stderr first:
    a GPU box has no pip access for us, its owner installs them by the line this prints."""
    missing = [pip for module, pip in NEEDS.items()
               if module not in OPTIONAL and importlib.util.find_spec(module) is None]  # fmt: skip
    if missing:  # pynvml: how the course counts GPUs without a CUDA context
        print(f"{tool}: missing {', '.join(missing)}: pip install {' '.join(missing)} "
              "(nvidia-ml-py: NVML)", file=sys.stderr)  # fmt: skip
    return missing


def main() -> int:
    if missing_packages("gpu-check"):
        return 2
    from ddp_tutorial.devices import DeviceError, MigError, visible_gpus
    from ddp_tutorial.records import format_table

    optional = tuple(module for module in OPTIONAL if importlib.util.find_spec(module) is None)
    for module in optional:  # a torch-only box: check the rest, and say what was not
        print(f"gpu-check: no {module} here: lessons {', '.join(OPTIONAL[module])} are not "
              f"run (resnet18), their gpu tests skip; pip install {NEEDS[module]} to check "
              "them too", file=sys.stderr)  # fmt: skip
    try:
        gpus = visible_gpus()
    except MigError as exc:  # the lessons run on the CPU there: no GPU branch to check
        print(f"gpu-check: {exc}\nOn this machine every lesson's launches run on the CPU with "
              "gloo (`make run`, `make test`): no GPU branch can run, so there is nothing for "
              "gpu-check to check. `make gpu-smoke` still records the inventory (MIG, compute "
              "mode) for a report.", file=sys.stderr)  # fmt: skip
        return 2
    except DeviceError as exc:  # a CUDA_VISIBLE_DEVICES that names no GPU: say what to do
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    rows = []
    from ddp_tutorial.harness.gpu_plan import torch_blind

    if gpus and (why := torch_blind(len(gpus))):  # every lesson would run on the CPU: say so
        print(f"gpu-check: {why}: no GPU branch can run, nothing to check on the GPUs",
              file=sys.stderr)  # fmt: skip
        return 2
    exclusive = any(gpu.exclusive for gpu in gpus)
    for step in plan(len(gpus), exclusive=exclusive, missing=optional):
        print(f"gpu-check: {step.name} ...", flush=True)
        rows.append(run_step(step))
    print()
    print(format_table(rows, ["step", "seconds", "status", "note"]))
    return 0 if all(passed(r) for r in rows) else 1


def passed(row: dict[str, object]) -> bool:
    """A row that ran to the end: "ok", or a lesson that passed on the CPU for want of GPUs."""
    return row["status"] == "ok" or str(row["status"]).startswith("GPU branch not run")


if __name__ == "__main__":
    sys.exit(main())
