"""The notebook runner itself: parameters, failure reporting, the table, stripping."""

from __future__ import annotations

import pytest

# The runner needs Jupyter; a GPU box for `make gpu-check` may have none: skip, never fail
# collection.
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from ddp_tutorial.harness.course import (  # noqa: E402
    inject_parameters,
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
def test_the_course_command_runs_lessons_into_the_output_dir_and_names_the_failing_cell(
    tmp_path, capfd
):
    """``ddp-tutorial course`` (make run) on two tiny lessons, one that fails."""
    from ddp_tutorial.harness.cli import main

    good = _notebook(
        tmp_path / "00_good.ipynb",
        ("md", "# 00 · Good\nIt runs.", []),
        ("code", "X = 1", ["parameters"]),
        ("code", "from ddp_tutorial.harness.launch import default_run_dir\n"
                 "default_run_dir('x.py').mkdir(parents=True)", []),
    )  # fmt: skip
    bad = _notebook(
        tmp_path / "01_bad.ipynb",
        ("md", "# 01 · Bad\nIt fails.", []),
        ("code", "SIZE = 3", ["parameters"]),
        ("code", "import os\nassert SIZE == 4, f'size is {SIZE}'", []),
    )
    out = tmp_path / "out"
    assert main(["course", str(good), str(bad), "--output-dir", str(out), "--timeout", "60"]) == 1
    printed, stderr = capfd.readouterr()  # the kernels' own stderr too
    assert "AssertionError" in printed and "size is 3" in printed, "the error, in the log"
    assert "without encryption" not in stderr, "kernels on Unix sockets: no TCP warning"
    table = printed.split("00_good.ipynb", 1)[-1]  # the table after the progress lines
    assert "FAILED (cell 2)" in table and "01_bad.ipynb" in table
    for name in ("00_good", "01_bad"):  # failed or not: executed copy and HTML to read
        assert (out / f"{name}.ipynb").exists() and (out / f"{name}.html").exists()
    assert "1/2 lessons ok" in (out / "index.html").read_text()
    made = list((out / "runs" / "00_good").iterdir())  # a lesson's runs: under the output dir
    assert [p.name.startswith("x-") for p in made] == [True]
    assert not (tmp_path / "runs").exists(), "nothing beside the notebooks"


def test_the_course_command_refuses_a_missing_notebook(tmp_path, capsys):
    from ddp_tutorial.harness.cli import main

    assert main(["course", str(tmp_path / "nope.ipynb"), "--output-dir", str(tmp_path)]) == 2
    assert "nope.ipynb: no such notebook" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [], "nothing ran, nothing written"


def test_strip_and_course_refuse_what_is_not_a_notebook(tmp_path, capsys):
    """Helper 132: strip of a missing file, and strip or course of an empty one or a .py file,
    ended in nbformat's traceback."""
    from ddp_tutorial.harness.cli import main

    empty, script = tmp_path / "empty.ipynb", tmp_path / "train.py"
    empty.write_text("")
    script.write_text("print(1)\n")
    for command, path, said in (("strip", tmp_path / "nope.ipynb", "no such notebook"),
                                ("strip", empty, "not a notebook (NotJSONError"),
                                ("strip", script, "not a notebook"),
                                ("course", empty, "not a notebook")):  # fmt: skip
        out = ["--output-dir", str(tmp_path / "out")] if command == "course" else []
        assert main([command, str(path), *out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ddp-tutorial {command}: {path}: {said}"), err
    assert script.read_text() == "print(1)\n" and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as ended:  # and a timeout that ends every cell at once
        main(["course", "--timeout", "0"])
    assert ended.value.code == 2 and "is not above 0" in capsys.readouterr().err


def test_the_strip_command_strips_a_copy(tmp_path, capsys):
    from ddp_tutorial.harness.cli import main

    path = _notebook(tmp_path / "n.ipynb", ("code", "print(1)", []), ("code", "x = 2", []))
    nb = nbformat.read(path, 4)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[0].execution_count = 1
    nbformat.write(nb, path)
    assert main(["strip", str(path)]) == 0
    assert capsys.readouterr().out == f"stripped {path}\n"
    cells = nbformat.read(path, 4).cells
    assert [c.outputs for c in cells] == [[], []] and cells[0].execution_count is None
    assert main(["strip", str(path)]) == 0 and capsys.readouterr().out == "", "already clean"


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


def test_the_index_page_lists_every_lesson_with_status_time_and_link(tmp_path):
    from ddp_tutorial.harness.course import NotebookResult, write_index

    good = _notebook(tmp_path / "00_a.ipynb", ("md", "# 00 · First\nWhat `torchrun` is.", []))
    bad = _notebook(tmp_path / "01_b.ipynb", ("md", "# 01 · Second\nMore.", []))
    results = [
        NotebookResult(good, 3.2, True, html_path=tmp_path / "00_a.html"),
        NotebookResult(
            bad, 7.9, False, "boom", failed_cell=4, executed_path=tmp_path / "01_b.ipynb"
        ),
    ]
    page = write_index(results, tmp_path / "site").read_text()
    assert '<a href="00_a.html">00 · First</a>' in page
    assert "What <code>torchrun</code> is." in page, "the summary's markdown, rendered"
    assert '<a href="01_b.ipynb">01 · Second</a>' in page and "FAILED (cell 4)" in page
    assert "3.2 s" in page and "7.9 s" in page and "1/2 lessons ok" in page


def test_the_html_leaves_out_the_setup_cell_and_lab_shows_it_collapsed(tmp_path):
    from ddp_tutorial.harness.course import notebook_html
    from ddp_tutorial.harness.hosted import SETUP_CELL, add_setup_cell, setup_cell_index

    path = _notebook(tmp_path / "00_a.ipynb", ("md", "# 00 · A\nB.", []),
                     ("code", "LESSON_CODE = 1", []))  # fmt: skip
    assert add_setup_cell(path) is True and add_setup_cell(path) is False
    nb = nbformat.read(path, 4)
    setup = nb.cells[setup_cell_index(nb)]
    assert setup.metadata["jupyter"]["source_hidden"] is True, "collapsed in JupyterLab"
    page = notebook_html(nb)
    assert "LESSON_CODE" in page
    assert SETUP_CELL.splitlines()[0][2:] not in page, "the setup cell is not in the HTML"


def test_kernels_use_unix_sockets_unless_the_path_is_too_long_for_one(tmp_path):
    """A deep TMPDIR (HPC, CI sandboxes) would make zmq fail "File name too long" and nbclient
    hang in its cleanup (seen in a review): such a kernel stays on TCP."""
    from pathlib import Path

    from ddp_tutorial.harness.course import local_kernel

    assert local_kernel(Path("/tmp/k")).transport == "ipc"  # nothing is created
    assert local_kernel(tmp_path / ("x" * 80)).transport == "tcp"
