"""`make test`'s two workers keep what must run together together (tests/conftest.py)."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, group_order, suite_group


def test_exercises_share_a_worker_and_the_notebooks_run_in_two_ordered_halves():
    assert suite_group("tests/test_exercises.py::test_x[00_convert_loop-solution]") == "exercises"
    assert suite_group("tests/test_exercises_12.py::test_y[case]") == "exercises"
    early = suite_group("tests/test_notebooks.py::test_notebook_executes[06_training.ipynb]")
    late = suite_group("tests/test_notebooks.py::test_notebook_executes[07_scaling.ipynb]")
    assert (early, late) == ("notebooks 00-06", "notebooks 07-12")
    # the notebooks' static checks are a file like any other
    clean = "tests/test_notebooks.py::test_notebook_is_committed_clean[00_environment.ipynb]"
    assert suite_group(clean) == "tests/test_notebooks.py"
    assert suite_group("tests/test_training.py::test_a[x]") == "tests/test_training.py"


def test_make_test_runs_two_workers_and_test_fast_one_process():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"(?m)^TEST_WORKERS \?= 2$", makefile)
    test = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    fast = makefile.split("\ntest-fast:", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest -n $(TEST_WORKERS)" in test and "-n " not in fast


def test_the_long_groups_go_first_and_the_quick_files_last():
    files = {name: f"tests/test_{name}.py" for name in ("data", "samplers", "training", "launch")}
    groups = [files["data"], files["samplers"], files["training"], "notebooks 00-06",
              files["launch"], "exercises", "notebooks 07-12"]  # fmt: skip
    launches = {files["samplers"], files["training"], files["launch"]}
    ordered = sorted(groups, key=lambda g: group_order(g, g in launches))
    assert ordered == ["notebooks 07-12", "exercises", "notebooks 00-06", files["training"],
                       files["launch"], files["samplers"], files["data"]]  # fmt: skip


CRASHING = """
import os


def test_crash():
    os._exit(1)  # the worker's process dies with the test


def test_after():
    pass
"""


@pytest.mark.torchrun  # no torchrun, but a process of its own: not in test-fast
def test_a_test_that_kills_its_worker_fails_once_and_the_rest_of_its_group_runs(tmp_path):
    """The suite's scheduler under a real xdist worker that dies: one failure, one worker
    replaced, and the test after it in the same group still runs (xdist's own scope
    scheduler starts the dead test again on every replacement: "5 failed", and never runs
    the one after it)."""
    import subprocess
    import sys

    (tmp_path / "test_dies.py").write_text(CRASHING)
    suite = str(REPO / "tests" / "conftest.py")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\nimport pytest\n"
        f"spec = importlib.util.spec_from_file_location('suite', {suite!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n\n\n"
        "@pytest.hookimpl(optionalhook=True)\n"
        "def pytest_xdist_make_scheduler(config, log):\n"
        "    return suite.group_scheduling()(config, log)\n"
    )
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "test_dies.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert out.count("node down") == 1, out[-3000:]  # one worker died, not one per retry
