"""The notebook runner itself: parameters, failure reporting, the table, stripping."""

from __future__ import annotations

import pytest

# The runner needs Jupyter; a GPU box for `make gpu-check` may have none: skip, never fail
# collection.
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from ddp_tutorial.harness.course import (  # noqa: E402
    inject_parameters,
    results_table,
    run_notebook,
    strip_outputs,
)


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook()
    for kind, source, tags in cells:
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(source, metadata={"tags": tags} if tags else {}))
    nbformat.write(nb, path)
    return path


@pytest.mark.notebook
def test_runner_reports_failing_cell_and_error(tmp_path):
    path = _notebook(
        tmp_path / "bad.ipynb",
        ("md", "# A notebook that fails", []),
        ("code", "SIZE = 3", ["parameters"]),
        ("code", "import os\nassert SIZE == 4, f'size is {SIZE}'", []),
    )
    result = run_notebook(path, output_dir=tmp_path / "out", timeout=60)
    assert not result.ok and result.failed_cell == 2
    assert "AssertionError" in result.error and "size is 3" in result.error
    assert (tmp_path / "out" / "bad.ipynb").exists() and (tmp_path / "out" / "bad.html").exists()
    assert "bad.ipynb" in results_table([result]) and "FAILED (cell 2)" in results_table([result])


@pytest.mark.notebook
def test_parameters_are_injected_and_cwd_is_the_notebook_folder(tmp_path):
    (tmp_path / "marker.txt").write_text("here")
    path = _notebook(
        tmp_path / "ok.ipynb",
        ("code", "SIZE = 3", ["parameters"]),
        ("code", "assert SIZE == 4\nassert open('marker.txt').read() == 'here'", []),
    )
    result = run_notebook(path, timeout=60, parameters={"SIZE": 4}, html=False)
    assert result.ok, result.error


def test_inject_without_parameters_cell_is_an_error():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="parameters"):
        inject_parameters(nb, {"x": 2})


def test_strip_outputs(tmp_path):
    path = _notebook(tmp_path / "n.ipynb", ("code", "print(1)", []))
    nb = nbformat.read(path, 4)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[0].execution_count = 1
    nbformat.write(nb, path)
    assert strip_outputs(path) is True
    assert strip_outputs(path) is False
    assert nbformat.read(path, 4).cells[0].outputs == []


@pytest.mark.notebook
def test_a_lessons_runs_go_under_the_output_dir_not_the_notebook_folder(tmp_path):
    path = _notebook(
        tmp_path / "lesson.ipynb",
        ("code", "X = 1", ["parameters"]),
        ("code", "from ddp_tutorial.harness.launch import default_run_dir\n"
                 "default_run_dir('x.py').mkdir(parents=True)", []),
    )  # fmt: skip
    result = run_notebook(path, output_dir=tmp_path / "out", timeout=60, html=False)
    assert result.ok, result.error
    made = list((tmp_path / "out" / "runs" / "lesson").iterdir())
    assert [p.name.startswith("x-") for p in made] == [True]
    assert not (tmp_path / "runs").exists(), "nothing beside the notebook"


def test_the_index_page_lists_every_lesson_with_status_time_and_link(tmp_path):
    from ddp_tutorial.harness.course import NotebookResult, write_index

    good = _notebook(tmp_path / "00_a.ipynb", ("md", "# 00 · First\nWhat it is.", []))
    bad = _notebook(tmp_path / "01_b.ipynb", ("md", "# 01 · Second\nMore.", []))
    results = [
        NotebookResult(good, 3.2, True, html_path=tmp_path / "00_a.html"),
        NotebookResult(
            bad, 7.9, False, "boom", failed_cell=4, executed_path=tmp_path / "01_b.ipynb"
        ),
    ]
    page = write_index(results, tmp_path / "site").read_text()
    assert '<a href="00_a.html">00 · First</a>' in page and "What it is." in page
    assert '<a href="01_b.ipynb">01 · Second</a>' in page and "FAILED (cell 4)" in page
    assert "3.2 s" in page and "7.9 s" in page and "1/2 lessons ok" in page
