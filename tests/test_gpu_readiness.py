"""What a GPU machine will do, proven here without one: scripts, Makefile, gpu-check.

Each test pins a GPU-side behaviour that this CPU-only machine can still check:
the scripts' device discipline (read from their source), the Makefile's
commands (``make -n``), and that ``make gpu-check`` collects and starts on a
machine with only torch, pytest, psutil, nvidia-ml-py, matplotlib and tqdm (torchvision
optional: lessons 04 and 06 are then rows "not run").
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, fake_gpu

ALL_SCRIPTS = sorted(SCRIPTS.rglob("*.py"))
# Scripts that join a process group (the others, e.g. single_process.py, have no rank device)
GROUP_SCRIPTS = [p for p in ALL_SCRIPTS if re.search(r"process_group\(|setup\(", p.read_text())]
# ... and of those, the ones not pinned to gloo (their docstring says why: mp.spawn, teardown)
PINS_GLOO = r"process_group\(\s*(?:backend=)?\"gloo\""
UNPINNED = [p for p in GROUP_SCRIPTS if not re.search(PINS_GLOO, p.read_text())]


def _script_id(path: pathlib.Path) -> str:
    return str(path.relative_to(SCRIPTS))


def test_the_script_selections_hold_what_they_are_for():
    names = {_script_id(p) for p in GROUP_SCRIPTS}
    assert {"train.py", "minimal_ddp.py", "demos/hello.py"} <= names
    assert "single_process.py" not in names, "it joins no group"
    assert {"train.py", "demos/hello.py"} <= {_script_id(p) for p in UNPINNED}


@pytest.mark.parametrize("path", GROUP_SCRIPTS, ids=_script_id)
def test_every_script_keeps_what_it_communicates_on_the_ranks_device(path):
    """With nccl every tensor a collective sees, and every DDP module, must be on the GPU.

    "auto" picks nccl on a GPU machine; a script that keeps its model or its
    tensors on the CPU then stops with "No backend type associated with device
    type cpu". So a script that joins a group either uses ``info.device`` or
    pins gloo and says why.
    """
    text = path.read_text()
    pinned = 'backend="gloo"' in text or 'default="gloo"' in text
    pinned = pinned or bool(re.search(PINS_GLOO, text))  # init_process_group("gloo", ...)
    pinned = pinned or '"nccl", device_id=device' in text  # a GPU-only demo: nccl, bound
    # The template joins by itself: its device follows the backend it chose.
    own = 'torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")' in text
    follows = 'cuda = backend == "nccl"' in text  # scripts/compare/loops.py's bare loop
    own = own or (follows and 'torch.device("cuda", local_rank) if cuda' in text)
    # scripts/minimal_ddp.py: nccl only in the branch that made device a GPU
    branch = 'dist.init_process_group("nccl", device_id=device)' in text
    own = own or (branch and 'device = torch.device("cpu")' in text)
    assert "info.device" in text or pinned or own, f"{path.name}: no rank device, no pinned gloo"


COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor", "send", "recv", "all_to_all_single"}  # fmt: skip
MAKERS = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "bincount"}


def _cpu_tensors_into_collectives(tree: ast.AST) -> list[str]:
    """``x = torch.tensor(...)`` (no ``device=``, no ``.to(...)``) later passed to ``dist.*``.

    On nccl such a call stops with "No backend type associated with device
    type cpu" — on the GPU machine, never here: so it is read from the source.
    """
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        on_cpu: dict[str, int] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                call = node.value
                made = isinstance(call.func, ast.Attribute) and call.func.attr in MAKERS
                placed = any(k.arg == "device" for k in call.keywords)
                for target in node.targets:
                    if isinstance(target, ast.Name) and made and not placed:
                        on_cpu[target.id] = node.lineno
                    elif isinstance(target, ast.Name):
                        on_cpu.pop(target.id, None)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            first = node.args[0] if node.args else None
            if node.func.attr in COLLECTIVES and isinstance(first, ast.Name) and first.id in on_cpu:
                found.append(f"{func.name}: {first.id} (line {on_cpu[first.id]})")
    return found


@pytest.mark.parametrize("path", UNPINNED, ids=_script_id)
def test_no_script_hands_a_cpu_tensor_to_a_collective(path):
    assert _cpu_tensors_into_collectives(ast.parse(path.read_text())) == []


def test_the_source_check_finds_the_bug_it_is_for():
    buggy = "def f(info):\n    c = torch.tensor([1.0])\n    dist.all_reduce(c)\n"
    fixed = (
        "def f(info):\n    c = torch.tensor([1.0], device=info.device)\n    dist.all_reduce(c)\n"
    )
    assert _cpu_tensors_into_collectives(ast.parse(buggy)) == ["f: c (line 2)"]
    assert _cpu_tensors_into_collectives(ast.parse(fixed)) == []


# -- make gpu-check ----------------------------------------------------------------------

GPU_BOX_LACKS = ("nbformat", "nbclient", "jupyter_client", "jupyter_core", "ipykernel",
                 "yaml", "IPython", "nbconvert")  # fmt: skip


def _without(modules, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which ``modules`` cannot be imported."""
    block = f"import sys; sys.modules.update(dict.fromkeys({modules!r}))\n"
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)  # fmt: skip


@pytest.mark.torchrun
def test_gpu_tests_collect_on_a_machine_without_jupyter_or_yaml():
    done = _without(GPU_BOX_LACKS, (
        "import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu',"
        " '-p', 'no:cacheprovider', '-o', 'addopts=', 'tests']))"
    ))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.lower().split("collected")[-1]
    assert re.search(r"\d+/\d+ tests collected", done.stdout), done.stdout[-500:]


@pytest.mark.torchrun
def test_gpu_check_and_the_plain_runner_start_without_jupyter():
    done = _without(GPU_BOX_LACKS, (
        "import ddp_tutorial.harness.gpu_check, ddp_tutorial.harness.plain_notebook\n"
        "print('imported')"
    ))  # fmt: skip
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]


def _third_party_imports(paths) -> set[str]:
    """Top-level modules the files import that are neither the standard library nor the course."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"ddp_tutorial", "ddp_kit", "__future__"}


def test_gpu_check_needs_what_the_package_and_scripts_import():
    """A torch-only GPU box lacks torchvision (lessons 04 and 06: resnet18): gpu-check names it."""
    from ddp_tutorial.harness.gpu_check import NEEDS

    jupyter_only = {"course.py", "hosted.py"}  # `make run`'s executor: never on a GPU box
    paths = [p for p in (REPO / "ddp_tutorial").rglob("*.py") if p.name not in jupyter_only]
    paths += [p for p in (REPO / "scripts").rglob("*.py") if "compare" not in p.parts]
    assert _third_party_imports(paths) - set(GPU_BOX_LACKS) <= set(NEEDS)
    assert {"torchvision", "PIL", "numpy"} <= set(NEEDS)


def test_gpu_check_stops_at_once_naming_what_is_missing(monkeypatch, capsys):
    from ddp_tutorial.harness import gpu_check

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: the GPUs cannot be counted
    assert gpu_check.main() == 2
    assert "missing nvidia-ml-py: pip install nvidia-ml-py" in capsys.readouterr().err


def test_a_torch_only_box_checks_all_but_the_lessons_that_need_torchvision(
    nvml, monkeypatch, capsys
):
    """Helper 100: the device machines have torch but no torchvision, and gpu-check stopped
    there before any step; now only lessons 04 and 06 (resnet18) are rows "not run"."""
    from ddp_tutorial.harness import gpu_check

    monkeypatch.setitem(sys.modules, "torchvision", None)
    nvml([fake_gpu(0)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("ddp_tutorial.harness.gpu_plan.torch_blind", lambda gpus: "")
    ran = []
    monkeypatch.setattr(gpu_check, "run_step_command", lambda command, **_: ran.append(command)
                        or Done())  # fmt: skip
    assert gpu_check.main() == 1  # two lessons unchecked: not a pass
    out = capsys.readouterr()
    assert "no torchvision here: lessons 04_ddp_wrapping, 06_training_and_utilization" in out.err
    assert "not run: no torchvision (resnet18)" in out.out
    lessons = [c[-1] for c in ran if c[-1].startswith("notebooks/")]
    assert lessons == [f"notebooks/{n}.ipynb" for n in gpu_check.LESSONS
                       if n not in gpu_check.OPTIONAL["torchvision"]]  # fmt: skip
    assert any("gpu" in c for c in ran), "the gpu tests still run (theirs skip themselves)"


class Done:
    timed_out, returncode, seconds, output = False, 0, 1.0, ""


def test_gpu_check_plan_covers_every_gpu_and_the_gpu_lessons():
    from ddp_tutorial.harness.gpu_check import LESSONS, plan

    steps = plan(8, python="py")
    hello = next(s for s in steps if s.name.startswith("hello"))
    assert hello.command[hello.command.index("--nproc-per-node") + 1] == "8"
    assert "--backend" in hello.command and "nccl" in hello.command
    assert [s.command[-1] for s in steps if s.name.startswith("lesson")] == [
        f"notebooks/{lesson}.ipynb" for lesson in LESSONS
    ]
    assert all((REPO / f"notebooks/{lesson}.ipynb").is_file() for lesson in LESSONS)
    assert "no communication between GPUs" in plan(1, python="py")[1].note
    with pytest.raises(SystemExit, match="no GPU visible"):
        plan(0)


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_check_limits_grow_with_gpus_and_launches_and_stay_bounded(gpus):
    from ddp_tutorial.harness.gpu_check import LESSONS, plan

    steps = {s.name.split(",")[0]: s.timeout_s for s in plan(gpus, python="py")}
    fewer = {s.name.split(",")[0]: s.timeout_s for s in plan(max(1, gpus // 2), python="py")}
    assert all(steps[name] >= fewer[name] for name in steps), "more GPUs: never less time"
    lessons = {name: t for name, t in steps.items() if name.startswith("lesson")}
    assert min(lessons.values()) >= 75, "at least what a lesson needs on this 2-core CPU"
    busiest = max(LESSONS, key=LESSONS.get)
    assert lessons[f"lesson {busiest[:2]}"] == max(lessons.values()), "limits follow launches"
    assert sum(steps.values()) <= {1: 30, 2: 32, 8: 45}[gpus] * 60  # bounded at any size


def test_the_launch_counts_bound_what_each_gpu_lesson_starts():
    """A lesson that starts more launches than gpu-check allows for would time out there."""
    from ddp_tutorial.harness.gpu_check import LESSONS

    calls = re.compile(r"\b(torchrun|start|subprocess\.run|run_command)\(|\bmultinode\(")
    for lesson, allowed in LESSONS.items():
        cells = json.loads((REPO / f"notebooks/{lesson}.ipynb").read_text())["cells"]
        code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        found = sum(2 if m.group(0).startswith("multinode") else 1 for m in calls.finditer(code))
        assert found <= allowed, f"{lesson}: {found} launch calls, gpu-check allows {allowed}"


def test_gpu_check_counts_torchruns_grace_for_each_nccl_crash_and_exclusive_waits():
    """Issue 33 point 9: a rank that dies on purpose leaves its peers in an nccl collective:
    torchrun waits its grace (30 s) before SIGKILL; on EXCLUSIVE_PROCESS GPUs the launches a
    lesson starts side by side run one after another. The plan makes room for both."""
    from ddp_tutorial.harness import gpu_check

    assert gpu_check.crash_grace_s() == 30.0, "torch 2.x's SIGTERM-to-SIGKILL wait"
    from ddp_tutorial.lessons.utilization import GPU_SECONDS, imbalance_workload

    lesson_06 = gpu_check.GPU_RUNS["06_training_and_utilization"] * gpu_check.GPU_SECONDS
    assert lesson_06 == 2 * float(imbalance_workload("gpu")[-1]) == 2 * GPU_SECONDS, "both runs"
    plain = {s.name: s.timeout_s for s in gpu_check.plan(2, python="py")}
    exclusive = {s.name: s.timeout_s for s in gpu_check.plan(2, python="py", exclusive=True)}
    for lesson in gpu_check.LESSONS:
        name = f"lesson {lesson[:2]}"
        base = 60.0 + gpu_check.LESSONS[lesson] * gpu_check.launch_s(2)
        grace = gpu_check.NCCL_CRASHES.get(lesson, 0) * 30.0
        extra = gpu_check.COLD_COMPILE_S.get(lesson, 0.0)
        extra += gpu_check.GPU_RUNS.get(lesson, 0) * gpu_check.GPU_SECONDS
        assert plain[name] >= base + grace + extra
        assert (exclusive[name] > plain[name]) == (lesson in gpu_check.SIDE_BY_SIDE), name


def test_the_nccl_crash_counts_bound_the_failures_each_lesson_injects():
    """Every --fail-at-step launch of a gpu-check lesson is counted for torchrun's grace."""
    from ddp_tutorial.harness.gpu_check import LESSONS, NCCL_CRASHES

    for lesson in LESSONS:
        cells = json.loads((REPO / f"notebooks/{lesson}.ipynb").read_text())["cells"]
        code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        found = code.count('"--fail-at-step"')
        assert NCCL_CRASHES.get(lesson, 0) >= found, f"{lesson}: {found} injected crashes"


def test_gpu_check_on_mig_says_the_lessons_run_on_the_cpu_and_stops(nvml, monkeypatch, capsys):
    """Issue 33 point 1, gpu-check's part: a MIG machine gets the reason and what still works,
    not a traceback, and no step starts (every launch there runs on the CPU)."""
    from ddp_tutorial.harness import gpu_check

    nvml([fake_gpu(0, mig=True)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_check, "run_step", lambda step: pytest.fail(f"ran {step.name}"))
    assert gpu_check.main() == 2
    err = capsys.readouterr().err
    assert "MIG mode is on" in err and "run on the CPU with gloo" in err and "gpu-smoke" in err


def test_gpu_check_plans_for_exclusive_gpus_from_nvml(nvml, monkeypatch):
    from ddp_tutorial.harness import gpu_check

    nvml([fake_gpu(0, exclusive=True), fake_gpu(1, exclusive=True)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    planned = []
    monkeypatch.setattr("ddp_tutorial.harness.gpu_plan.torch_blind", lambda gpus: "")
    monkeypatch.setattr(
        gpu_check, "plan", lambda gpus, exclusive, missing: planned.append((gpus, exclusive)) or []
    )
    assert gpu_check.main() == 0 and planned == [(2, True)]


def _notebook(path, *sources, tags=None):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# t"}]
    for i, source in enumerate(sources):
        meta = {"tags": ["parameters"]} if i == 0 else {}
        cells.append({"cell_type": "code", "metadata": meta, "source": source,
                      "outputs": [], "execution_count": None})  # fmt: skip
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))  # fmt: skip
    return path


def test_the_plain_runner_runs_cells_in_order_from_the_notebooks_folder(tmp_path, monkeypatch):
    from ddp_tutorial.harness.plain_notebook import run

    (tmp_path / "data.txt").write_text("42")
    read = "import pathlib\nx = pathlib.Path('data.txt').read_text()"
    _notebook(tmp_path / "good.ipynb", "N = 1", read, "assert x == '42' and N == 2")
    monkeypatch.chdir(
        tmp_path.parent
    )  # a relative path, from elsewhere, as make gpu-check gives it
    assert run(pathlib.Path(tmp_path.name) / "good.ipynb", parameters={"N": 2}) == (None, "")
    bad = _notebook(tmp_path / "bad.ipynb", "N = 1", "assert N == 2, 'the claim'")
    cell, error = run(bad)
    assert cell == 1 and "AssertionError: the claim" in error


# -- the Makefile on a GPU machine ---------------------------------------------------------


def _make_n(*args: str, **env: str) -> str:
    # A clean make: not the sub-make of `make test` (its flags, its "Entering directory").
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=REPO, text=True,
                          capture_output=True, env={**clean, **env}, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_lab_runs_as_root_the_way_gpu_containers_do():
    line = _make_n("lab").strip().splitlines()[-1]
    assert line.endswith("--allow-root") == (os.getuid() == 0)


def test_a_torch_the_machine_already_has_is_kept(tmp_path):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.5.1+cu124'\n")  # no torchvision beside
    stamp = ".venv/.installed-stamp"
    # -S: no site-packages, so only what PYTHONPATH names; -I also ignores PYTHONPATH.
    has_torch = f"PYTHON={sys.executable} -S"
    no_torch = f"PYTHON={sys.executable} -S -I"
    with_torch = _make_n("-B", stamp, has_torch, PYTHONPATH=str(fake.parent))
    assert "-m venv --system-site-packages .venv" in with_torch
    # pinned: a missing torchvision is resolved against that torch, never by replacing it
    assert 'echo "torch==2.5.1" > .venv/constraints.txt' in with_torch
    assert "pip install -c .venv/constraints.txt -e" in with_torch
    assert "--system-site-packages" not in _make_n("-B", stamp, no_torch)
    assert "constraints" not in _make_n("-B", stamp, no_torch)
    index = _make_n("-B", stamp, no_torch, "TORCH_INDEX=https://download.pytorch.org/whl/cu124")
    assert (
        "pip install --index-url https://download.pytorch.org/whl/cu124 torch torchvision" in index
    )


@pytest.mark.torchrun
@pytest.mark.parametrize("tool", ["gpu_check", "gpu_smoke"])
def test_both_gpu_tools_name_a_missing_package_before_importing_it(tool):
    """psutil (the tools' process trees) was imported at the top of gpu_check: on a box
    without it both tools stopped with an ImportError, never the line saying what to install."""
    done = _without(GPU_BOX_LACKS + ("psutil",), (
        f"from ddp_tutorial.harness import {tool}; sys.exit({tool}.main([]) if '{tool}' == "
        f"'gpu_smoke' else {tool}.main())"
    ))  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "missing psutil: pip install psutil" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


# -- make rehearse: GPU world sizes on the CPU ---------------------------------------------


def _names_read(cells: list[dict]) -> set[str]:
    """Names the lesson's code reads outside its parameters cell."""
    found = set()
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or "parameters" in tags:
            continue
        lines = "".join(cell["source"]).splitlines()
        code = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)
        found |= {n.id for n in ast.walk(ast.parse(code))
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}  # fmt: skip
    return found


@pytest.mark.parametrize("ranks", [3, 8])
def test_the_rehearsal_sets_each_lessons_world_size_parameter(ranks):
    """Each parameter the rehearsal overrides is the lesson's, and its code reads it: a lesson
    that hard-codes its ranks again would pass a rehearsal at 2 ranks, silently."""
    from ddp_tutorial.harness.rehearse import rehearsal_plan as plan

    for lesson, parameters in plan(ranks):
        cells = json.loads((REPO / f"notebooks/{lesson}.ipynb").read_text())["cells"]
        tagged = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
        names = re.findall(r"^(\w+)\s*=", "".join(tagged["source"]), re.M)
        assert set(parameters) <= set(names), f"{lesson}: {sorted(parameters)} not in {names}"
        unread = set(parameters) - _names_read(cells)
        assert not unread, f"{lesson}: its code never reads {sorted(unread)}"
        ranks_in_all = parameters.get("NPROC") or 2 * next(iter(parameters.values()))
        assert ranks_in_all >= ranks, f"{lesson} would run fewer ranks than rehearsed"


@pytest.mark.notebook
def test_a_rehearsal_at_three_ranks_runs_a_lesson(tmp_path):
    """``make rehearse``'s own code path, on one lesson, so that the rehearsal cannot rot
    between the times someone runs it: lesson 03 (two "nodes" of 3 ranks; 62 s on a loaded
    2-core host, where lesson 02 at 3 ranks took 173 s) passes, its parameter injected, and
    its launches really start 3 ranks per node."""
    from ddp_tutorial.harness.rehearse import rehearse

    rows = rehearse(3, tmp_path, echo=False, lessons=["03_device_mapping"])
    assert [(r["lesson"], r["ranks"], r["status"]) for r in rows] == [("03", 3, "ok")], rows
    cells = json.loads((tmp_path / "03_device_mapping.ipynb").read_text())["cells"]
    injected = [c for c in cells if "injected-parameters" in c["metadata"].get("tags", [])]
    assert ["".join(c["source"]) for c in injected] == ["GPUS_PER_NODE = 3"]
    text = "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))
    assert "torchrun --nproc-per-node 3 --nnodes 2 --node-rank 1" in text, "the second node's"
    with pytest.raises(ValueError, match="not rehearsed"):
        rehearse(3, tmp_path, lessons=["05_checkpointing"])


def test_every_gpu_lesson_is_rehearsed_or_says_why_not():
    from ddp_tutorial.harness.gpu_check import LESSONS
    from ddp_tutorial.harness.rehearse import FIXED, WORLD_PARAMETERS, rehearsal_plan

    assert set(LESSONS) <= set(WORLD_PARAMETERS) | set(FIXED)
    assert {"01_process_groups", "02_data_sampling"} <= set(WORLD_PARAMETERS)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        rehearsal_plan(1)


def test_make_test_fast_starts_no_torchrun_no_kernel_and_no_gpu_test():
    """On a GPU box the gpu tests start torchrun: the edit loop leaves them out too."""
    assert '-m "not torchrun and not notebook and not gpu"' in _make_n("-B", "test-fast")


def test_make_rehearse_runs_three_and_eight_ranks():
    assert "ddp_tutorial.harness.rehearse --ranks 3 8" in _make_n("rehearse")


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_zero1_shares_lie_within_one_tensor_of_one_over_n(ranks):
    """Lesson 12's ZeRO-1 claim at any world size: whole tensors, greedily, so every rank's share
    of the optimizer state is within the largest tensor's share of 1/N (its MLP's two big layers
    make that 49 % on 8 ranks, a near-even split on 2)."""
    import random

    from ddp_tutorial.lessons import sharding
    from ddp_tutorial.lessons.anatomy import deep_mlp

    lesson = [p.numel() for p in deep_mlp(0, width=256, depth=2).parameters()]
    rng = random.Random(ranks)
    for numels in [lesson, *([rng.randint(1, 10**5) for _ in range(rng.randint(1, 40))]
                             for _ in range(50))]:  # fmt: skip
        owned = sharding.zero_partition(numels, ranks)
        shares = [sum(numels[i] for i in o) / sum(numels) for o in owned]
        largest = max(numels) / sum(numels)
        assert max(shares) - min(shares) <= largest + 1e-12, (numels, owned)
        assert all(abs(s - 1 / ranks) <= largest + 1e-12 for s in shares)


def test_one_gpu_runs_the_two_rank_lessons_on_the_cpu_and_the_table_says_so(nvml):
    """Point 5: a one-GPU machine ran lessons 04, 06, 08, 11, 12 (two ranks each) on gloo while
    gpu-check printed "ok". Their rows and their own output now say the GPU branch did not run."""
    from ddp_tutorial.harness.gpu_check import LESSON_RANKS, passed, plan
    from ddp_tutorial.harness.gpu_plan import gpu_branch_note

    one = {s.command[-1]: s.cpu_only for s in plan(1, python="py") if s.name.startswith("lesson")}
    assert {n for n, why in one.items() if why} == {f"notebooks/{n}.ipynb" for n in LESSON_RANKS}
    assert set(one.values()) == {"", "GPU branch not run: needs 2 GPUs"}
    assert not any(s.cpu_only for s in plan(2, python="py")), "two GPUs: every GPU branch runs"
    assert passed({"status": "GPU branch not run: needs 2 GPUs"}) and not passed(
        {"status": "FAILED (exit 1)"}
    )
    for gpus, said in ((0, ""), (1, "GPU branch not run: needs 2 GPUs, 1 visible"), (2, "")):
        nvml([fake_gpu(i) for i in range(gpus)])
        assert gpu_branch_note(2).startswith(said) and bool(gpu_branch_note(2)) == bool(said)


def test_the_lessons_say_when_their_gpu_branch_does_not_run():
    """Each lesson of LESSON_RANKS prints gpu_branch_note for the ranks it launches: its NPROC
    parameter (lesson 08: the nproc=2 of its launches)."""
    from ddp_tutorial.harness.gpu_check import LESSON_RANKS

    for lesson, ranks in LESSON_RANKS.items():
        cells = json.loads((REPO / f"notebooks/{lesson}.ipynb").read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        nproc = re.search(r"(?m)^NPROC = (\d+)", code)
        asked = nproc and int(nproc[1]) or int(re.search(r"\bnproc=(\d+)", code)[1])
        assert asked == ranks, f"{lesson}: launches {asked} ranks, gpu-check expects {ranks}"
        assert re.search(r"gpu_branch_note\((NPROC|\d+)\)", code), f"{lesson} does not say it"


def test_gpu_check_stops_where_torch_cannot_use_the_gpus_nvml_lists(nvml, monkeypatch, capsys):
    """Helper 100: NVML counts the GPUs without CUDA; with a torch that cannot use them every
    lesson ran on the CPU and its row said "ok". torch is asked first, in its own process."""
    from ddp_tutorial.harness import checks, gpu_check, gpu_plan

    nvml([fake_gpu(0), fake_gpu(1)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_plan, "torch_sees_no_gpu", lambda: "")
    monkeypatch.setattr(checks, "torch_gpu_count", lambda env: 0)  # error 802, say
    monkeypatch.setattr(gpu_check, "run_step_command", lambda *a, **k: pytest.fail("a step ran"))
    assert gpu_check.main() == 2
    assert "torch sees 0 of the 2 GPU(s) NVML lists" in capsys.readouterr().err
    monkeypatch.setattr(gpu_plan, "torch_sees_no_gpu", lambda: "this torch is a CPU-only build")
    assert gpu_plan.torch_blind(2) == "this torch is a CPU-only build"
    monkeypatch.setattr(gpu_plan, "torch_sees_no_gpu", lambda: "")
    monkeypatch.setattr(checks, "torch_gpu_count", lambda env: 2)
    assert gpu_plan.torch_blind(2) == ""
