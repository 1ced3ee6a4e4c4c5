"""The package's shape, as rules that fail when broken (README.md "Layout": the rank side
never imports the two below it).

``ddp_tutorial/`` holds the rank side (what every torchrun worker imports),
``ddp_tutorial/harness/`` the host side (starts, watches and reports on ranks),
``ddp_tutorial/lessons/`` the helpers of single lessons. A worker must not pull
in subprocess supervision, psutil or Jupyter; modules and functions stay small
enough to read; each concern lives in one place.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "ddp_tutorial"
SIDECAR = REPO / "scripts" / "ddp_kit.py"  # the template's helpers, re-exported by the package
RANK_SIDE = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__") + sorted(
    f"exercises.{p.stem}"
    for p in (PACKAGE / "exercises").glob("*.py")  # runs in every rank
)
HOST_ONLY = (
    "ddp_tutorial.harness", "ddp_tutorial.lessons", "psutil", "nbclient", "nbformat",
    "jupyter_client", "jupyter_core", "ipykernel", "IPython", "zmq", "matplotlib",
)  # fmt: skip
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_folders_are_the_three_kinds():
    assert {"distributed", "devices", "data", "models", "checkpoint", "records"} <= set(RANK_SIDE)
    host = {p.stem for p in (PACKAGE / "harness").glob("*.py")}
    assert {"launch", "failures", "processes", "multinode", "monitor", "doctor", "cli"} <= host
    lessons = {p.stem for p in (PACKAGE / "lessons").glob("*.py")}
    assert {"anatomy", "collectives", "debugging", "perf"} <= lessons


@pytest.mark.torchrun
def test_rank_side_imports_no_host_side_code():
    # Imports only add modules, so one interpreter that imports every rank-side module
    # proves it for each of them: none can have loaded what the union lacks.
    code = (
        "import importlib, json, sys\n"
        f"for m in {RANK_SIDE!r}: importlib.import_module('ddp_tutorial.' + m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=True)  # fmt: skip
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "ddp_tutorial.distributed" in loaded
    leaked = [m for m in loaded if m.startswith(HOST_ONLY)]
    assert not leaked, f"a rank-side module pulls in host-side code: {leaked[:10]}"


def test_package_init_imports_nothing():
    tree = _tree(PACKAGE / "__init__.py")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not imports, "ddp_tutorial/__init__.py must not import (a rank imports it first)"


def test_rank_side_modules_never_import_harness_or_lessons():
    for name in RANK_SIDE:
        for node in ast.walk(_tree(PACKAGE / f"{name.replace('.', '/')}.py")):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(HOST_ONLY[:2]), f"{name}.py imports {node.module}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name}: {lines} lines > {MAX_MODULE_LINES}"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def _defined(path: Path) -> set[str]:
    return {
        n.name
        for n in _tree(path).body
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
    }


def test_each_concern_lives_in_one_module():
    owners = {
        "parse_failures": "harness/failures.py",
        "failure_message": "harness/failures.py",
        "RankFailure": "harness/failures.py",
        "run_together": "harness/launch.py",
        "rendezvous_args": "harness/multinode.py",
        "atomic_save": "../scripts/ddp_kit.py",
        "load_checkpoint": "../scripts/ddp_kit.py",
        "training_state": "../scripts/ddp_kit.py",
        "restore_training_state": "../scripts/ddp_kit.py",
        "latest_snapshot": "../scripts/ddp_kit.py",
        "free_port": "distributed.py",
        "kill_tree": "harness/processes.py",
        "run_command": "harness/processes.py",
        "alive": "harness/processes.py",
        "wrap": "distributed.py",
        "spawn": "harness/processes.py",
    }
    where: dict[str, list[str]] = {}
    for path in [*_sources(), SIDECAR]:
        for name in _defined(path):
            place = "../scripts/ddp_kit.py" if path == SIDECAR else str(path.relative_to(PACKAGE))
            where.setdefault(name, []).append(place)
    for name, owner in owners.items():
        assert where.get(name) == [owner], f"{name} is defined in {where.get(name)}, not {owner}"
    # A public name means one thing (private helpers and entry points' main() are local).
    twice = {
        name: files
        for name, files in where.items()
        if len(files) > 1 and not name.startswith("_") and name != "main"
    }
    assert not twice, f"one public name, several definitions: {twice}"


def test_launches_are_started_in_one_place():
    # Only harness/launch.py constructs a Launch; everyone else goes through
    # start()/torchrun()/run_together(), which kill everything on failure.
    for path in _sources():
        if path == PACKAGE / "harness" / "launch.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Launch":
                pytest.fail(f"{path.name}:{node.lineno} constructs Launch directly")


@pytest.mark.parametrize(
    "name",
    ["DDP_TUTORIAL_BACKEND", "DDP_TUTORIAL_TIMEOUT", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"],
)
def test_each_environment_variable_is_named_once(name):
    spelled = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in _sources()
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Constant) and node.value == name
    ]
    assert spelled == [f"settings.py:{_line_of(name)}"], f"{name} spelled in {spelled}"


def _line_of(name: str) -> int:
    for i, line in enumerate((PACKAGE / "settings.py").read_text().splitlines(), 1):
        if f'"{name}"' in line and "=" in line:
            return i
    raise AssertionError(f"{name} is not defined in settings.py")


def test_pyproject_lists_every_subpackage():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = sorted(".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py"))
    assert sorted(declared["packages"]) == found
