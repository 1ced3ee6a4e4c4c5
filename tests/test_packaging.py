"""The install story: pyproject is the one source of dependencies."""

from __future__ import annotations

import pytest

from conftest import REPO

# A GPU box for `make gpu-check` may lack the dev extras: skip, never fail collection.
yaml = pytest.importorskip("yaml")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def test_environment_yml_installs_pyproject():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    deps = env["dependencies"]
    pip_entries = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert pip_entries == ["-e .[dev]"], "conda users get exactly pyproject's dependencies"
    python = next(d for d in deps if isinstance(d, str) and d.startswith("python"))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert python.replace(" ", "") == "python>=3.10"
    assert "pip" in deps


def test_torch_is_a_range_not_a_pin():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch and not any("==" in d for d in torch), "users need their own CUDA builds"


def test_cli_env_prints_report(capsys):
    from ddp_tutorial.harness.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "course plan" in out and "backends" in out


def test_ci_calls_make_test():
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / "README.md").read_text()
