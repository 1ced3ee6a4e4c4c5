"""Every lesson's setup cell: a no-op here, an install in a hosted notebook, a clear stop elsewhere.

The install branch runs for real in a fresh virtual environment that lacks the package
(as a Kaggle or Colab kernel does), with pip's two calls recorded instead of run: no
network, and what they would install is checked.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv

import pytest

from conftest import REPO
from ddp_tutorial.harness.hosted import RUNTIME_DEPENDENCIES, SETUP_CELL

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RECORD_PIP = """
import json, subprocess
calls = []
subprocess.check_call = lambda cmd, **kw: calls.append([str(c) for c in cmd]) or 0
"""
REPORT = """
import ddp_tutorial
print(json.dumps({"calls": calls, "package": ddp_tutorial.__file__}))
"""


def test_the_runtime_list_is_pyprojects_minus_torch_and_the_notebook_stack():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=;\s]", d)[0] for d in deps]
    jupyter = {"jupyterlab", "nbclient", "nbformat", "nbconvert", "ipykernel"}
    assert tuple(n for n in names if n not in jupyter | {"torch", "torchvision"}) == (
        RUNTIME_DEPENDENCIES
    )
    assert str(list(RUNTIME_DEPENDENCIES)).replace("'", '"') in SETUP_CELL


@pytest.mark.torchrun  # new interpreters
def test_with_the_package_installed_the_cell_does_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-c", RECORD_PIP + SETUP_CELL + REPORT],
                          cwd=REPO / "notebooks", capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["calls"] == []


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A fresh virtual environment: no ddp_tutorial, no torch (a hosted kernel lacks the first)."""
    where = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False).create(where)
    return str(where / "bin" / "python")


def fake_distributions(where, versions: dict[str, str]) -> str:
    """Importable packages with installed metadata, as a hosted kernel's torch is to the cell."""
    for name, version in versions.items():
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text("")
        info = where / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(where)


@pytest.mark.torchrun
@pytest.mark.parametrize("hosted_torch", [{"torch": "2.9.1+cu126", "torchvision": "0.24.1+cu126"},
                                          {}], ids=["a hosted torch", "no torch"])  # fmt: skip
def test_in_a_clone_without_the_package_it_installs_and_imports_it(bare_python, tmp_path,
                                                                   hosted_torch):  # fmt: skip
    clone = tmp_path / "ddp-tutorial"
    shutil.copytree(REPO / "ddp_tutorial", clone / "ddp_tutorial",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (clone / "notebooks").mkdir()
    env = {**os.environ, "PYTHONPATH": fake_distributions(tmp_path / "site", hosted_torch)}
    done = subprocess.run([bare_python, "-c", RECORD_PIP + SETUP_CELL + REPORT],
                          cwd=clone / "notebooks", capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    runtime, package = report["calls"]
    assert runtime[1:4] == ["-m", "pip", "install"] and runtime[-6:] == list(RUNTIME_DEPENDENCIES)
    assert package[-3:] == ["--no-deps", "-e", str(clone)], "the course, without its Jupyter stack"
    # both installs are constrained by one file that pins the torch already there
    pins = runtime[runtime.index("-c") + 1]
    assert package[package.index("-c") + 1] == pins
    pinned = pathlib.Path(pins).read_text().split()
    assert pinned == [f"{name}=={version}" for name, version in hosted_torch.items()]
    assert report["package"] == str(clone / "ddp_tutorial" / "__init__.py"), "and importable now"
    keeping = str(pinned) if pinned else "no torch"
    assert f"installed the course from {clone}, keeping {keeping}" in done.stdout


@pytest.mark.torchrun
def test_outside_a_clone_it_says_what_to_run_first(bare_python, tmp_path):
    (tmp_path / "notebooks").mkdir()
    done = subprocess.run([bare_python, "-c", RECORD_PIP + SETUP_CELL],
                          cwd=tmp_path / "notebooks", capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "git clone <the repository's URL> ddp-tutorial" in done.stderr
    assert "open ddp-tutorial/notebooks/" in done.stderr
    assert "%cd ddp-tutorial/notebooks, then run this cell again" in done.stderr
