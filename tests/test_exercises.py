"""The exercises' machinery: every stub and solution, the check command, the notebooks' cells.

Each lesson's wrong answers live in ``tests/test_exercises_NN.py``; here, for every exercise:
the reference solution passes, the untouched stub runs to the end and fails with a named
mistake (no traceback), and without a launch is recognised as "not started yet".
"""

from __future__ import annotations

import json

import pytest
from exercise_cases import Case, assert_verdict, register

from conftest import REPO
from ddp_tutorial.exercises.core import all_exercises, find, not_started, your_code_blocks
from ddp_tutorial.harness import exercise_check

EXERCISES = all_exercises()
CASES = register(
    [Case(ex.name, "solution", None) for ex in EXERCISES]
    + [Case(ex.name, "stub", "", stub=True) for ex in EXERCISES]
)


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_solutions_pass_and_stubs_run_and_fail_with_a_named_mistake(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
    if case.stub:  # it ran: a wrong answer, named, not a crash of the stub itself
        message = exercise_verdicts[str(case)].message
        assert " raised " not in message and "never reported" not in message, message


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_every_exercise_has_a_stub_to_edit_and_a_solution(ex):
    stub, solution = ex.stub.read_text(), ex.solution.read_text()
    assert your_code_blocks(stub), f"{ex.stub.name}: no `# YOUR CODE` ... `# END YOUR CODE` block"
    assert not_started(stub), f"{ex.stub.name}: its YOUR CODE blocks must hold no code yet"
    assert not not_started(solution), f"{ex.solution.name}: the answer must fill the blocks"
    assert f"ddp-tutorial check {ex.lesson}" in stub, "the stub says how to check it"


def _outside_the_blocks(text: str) -> str:
    """A file without its module docstring, each YOUR CODE block (markers included) one line."""
    import ast
    import re

    from ddp_tutorial.exercises.core import BEGIN, END

    tree = ast.parse(text)
    if ast.get_docstring(tree) is not None:
        text = "".join(text.splitlines(keepends=True)[tree.body[0].end_lineno :])
    block = re.compile(rf"^[ \t]*{re.escape(BEGIN)}\b.*?^[ \t]*{re.escape(END)}\b[^\n]*\n",
                       re.S | re.M)  # fmt: skip
    return block.sub("<your lines>\n", text)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_the_solution_changes_only_the_lines_the_stub_marks(ex):
    """A learner edits only inside the blocks: a solution that also needs a line changed outside
    them (a placeholder return, a division) would ask for an edit the stub never marks."""
    stub, solution = ex.stub.read_text(), ex.solution.read_text()
    assert _outside_the_blocks(stub) == _outside_the_blocks(solution), (
        f"{ex.name}: the stub and its solution differ outside the YOUR CODE blocks"
    )


def test_not_started_sees_only_code_as_a_start():
    block = "x = 1\n    # YOUR CODE: do it\n    {}\n    # END YOUR CODE\n"
    assert not_started(block.format("# a comment\n    pass\n    ..."))
    assert not not_started(block.format("y = x  # mine"))
    assert not not_started("x = 1\n"), "a file without the markers counts as started"


def test_an_untouched_stub_is_named_without_a_launch(capsys):
    assert exercise_check.main("01", []) == 1
    out = capsys.readouterr().out
    assert out.count("TODO") == len(find("01")) and "not started yet" in out
    assert "lesson 01" in out


@pytest.mark.torchrun  # a Python process (no launch: an untouched stub)
def test_python_dash_m_checks_as_the_command_does():
    """Two learners ran `python -m ddp_tutorial.harness.exercise_check 05 FILE`: it printed
    nothing and exited 0, which reads as a pass."""
    import subprocess
    import sys

    module = [sys.executable, "-m", "ddp_tutorial.harness.exercise_check", "01"]
    done = subprocess.run(module, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "not started yet" in done.stdout, done


def test_unknown_lessons_and_files_get_a_clear_error(capsys, tmp_path):
    assert exercise_check.main("99", []) == 2
    assert "lessons with exercises are" in capsys.readouterr().err
    other = tmp_path / "mine.py"
    other.write_text("x = 1\n")
    if len(find("01")) > 1:
        assert exercise_check.main("01", [str(other)]) == 2
        assert "which exercise?" in capsys.readouterr().err
        # helper 103: a mistyped path was asked "which exercise?", not told it is not there
        assert exercise_check.main("01", [str(tmp_path / "nosuch.py")]) == 2
        assert "nosuch.py: no such file" in capsys.readouterr().err


def test_what_check_refuses_or_tells_without_a_launch(capsys, tmp_path):
    """Helper 132: a folder was "no such file"; --solution with files checked the files; a file
    of another exercise was checked as this one; a syntax error was launched and reported at
    <frozen importlib._bootstrap>; the "not started" line asked for a check of the stub."""
    ring, gather = (next(ex for ex in find("01") if ex.name == name)
                    for name in ("01_ring_average", "01_gather_uneven"))  # fmt: skip
    assert exercise_check.main("01", [str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert exercise_check.main(ring.name, [str(ring.solution)], solution=True) == 2
    assert "give it no files" in capsys.readouterr().err
    assert exercise_check.main(ring.name, [str(gather.stub)]) == 2
    assert f"check {gather.name} {gather.stub}" in capsys.readouterr().err
    broken = tmp_path / f"{ring.name}.py"
    broken.write_text(ring.solution.read_text().replace("tensor.clone()", "tensor.clone(", 1))
    mine = tmp_path / "mine.py"
    mine.write_text(ring.stub.read_text())
    assert exercise_check.main("01", [str(broken), str(mine)]) == 1
    out = capsys.readouterr().out
    assert "SyntaxError: '(' was never closed - fix it" in out and "importlib" not in out, out
    assert f"ddp-tutorial check 01 {mine}`" in out, out


def test_a_renamed_copy_of_a_stub_is_known_by_its_first_line(capsys, tmp_path):
    """Two exercises in lesson 05: a copy named mine.py is still 05_exact_resume's."""
    (stub,) = (ex.stub for ex in find("05") if ex.name == "05_exact_resume")
    mine = tmp_path / "mine.py"
    mine.write_text(stub.read_text())  # untouched: named without a launch
    assert exercise_check.main("05", [str(mine)]) == 1
    out = capsys.readouterr().out
    assert "05_exact_resume" in out and "not started yet" in out, out


@pytest.mark.parametrize("lesson", sorted({ex.lesson for ex in EXERCISES}))
def test_each_lesson_with_exercises_has_a_your_turn_section_and_check_cell(lesson):
    (path,) = REPO.glob(f"notebooks/{lesson}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    turn = [i for i, t in enumerate(text) if t.startswith("## Your turn")]
    assert turn, f"{path.name}: no '## Your turn' section"
    after = "\n".join(text[turn[0] :])
    for ex in find(lesson):
        assert f"scripts/exercises/{ex.name}.py" in after, f"{path.name} does not name {ex.name}"
    assert f'show("{lesson}")' in after, f"{path.name}: no check cell (exercise_check.show)"


def _headings() -> set[str]:
    found = set()
    for path in REPO.glob("notebooks/[0-9][0-9]_*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                lines = "".join(cell["source"]).splitlines()
                found |= {line.lstrip("#").strip() for line in lines if line.startswith("#")}
    return found


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_every_hint_points_to_a_section_that_exists(ex):
    """A verdict ends with where the lesson teaches it: each quoted section must be a heading."""
    import re

    headings = _headings()
    quoted = re.findall(r'"([^"]+)"', ex.teaches)
    assert quoted, f"{ex.name}: teaches names no section in quotes"
    for section in quoted:
        assert any(h.startswith(section) for h in headings), f"{ex.name}: no section {section!r}"


def test_every_verdict_that_names_its_own_section_names_one_that_exists():
    """A verdict ending with ``(lesson NN, "section")`` replaces the exercise's pointers: each
    such section, read from the string literals of the exercises' modules, must be a heading."""
    import ast
    import re

    headings = _headings()
    pointer = re.compile(r'\(lesson (\d\d), "([^"]+)"\)')
    found = []
    for path in (REPO / "ddp_tutorial" / "exercises").glob("lesson*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(path.name, m.group(2)) for m in pointer.finditer(node.value)]
    assert len(found) >= 6, found
    for name, section in found:
        assert any(h.startswith(section) for h in headings), f"{name}: no section {section!r}"


def test_at_least_eighteen_exercises_and_one_in_every_lesson():
    lessons = {p.name[:2] for p in REPO.glob("notebooks/[0-9][0-9]_*.ipynb")}
    assert {ex.lesson for ex in EXERCISES} == lessons, "every lesson has an exercise"
    assert len(EXERCISES) >= 18


def test_a_hang_is_named_within_the_30_s_a_check_may_take():
    """A wrong answer that hangs costs the launch (~8 s here), the collective timeout and the
    teardown: at 20 s (00 and 05_exact_resume until the eighteenth session) such a check took
    29.4 s on a quiet machine and more beside other work; at 12 s, 21 s (24 s beside two CPU
    hogs). The runner imports torch._dynamo before the first candidate, so DDP's constructor
    no longer needs a long timeout to tell a slow import from a hang."""
    slow = {ex.name: ex.collective_timeout_s for ex in EXERCISES if ex.collective_timeout_s > 12}
    assert not slow, slow


def test_a_launch_that_died_outside_the_file_says_what_it_said(tmp_path):
    """No line of the learner's file in the output: the error the launch printed, and what to
    do next - for a file the check imports, not "torchrun it" (it defines functions only)."""
    output = 'Traceback (most recent call last):\n  File "x.py", line 3\nTypeError: bad kwarg\n'
    (functions,) = find("02_macro_f1")
    message = exercise_check.died(functions, tmp_path / "02_macro_f1.py", output)
    assert "(TypeError: bad kwarg)" in message and "ddp-tutorial doctor" in message, message
    assert "torchrun" not in message, message
    (script,) = find("09")
    message = exercise_check.died(script, tmp_path / "09_find_the_hang.py", output)
    assert "(TypeError: bad kwarg)" in message and "torchrun --standalone" in message, message


def test_a_launch_stopped_by_its_timeout_says_the_code_never_returned(tmp_path):
    """Helper 99: an endless loop in 07's time_steps was told "the launch failed before your
    code ran" (torchrun's SIGTERM, when the launch's timeout stopped it) - it had run, and hung."""
    from ddp_tutorial.harness.launch import RunResult

    (ex,) = find("07")
    path = tmp_path / f"{ex.name}.py"
    said = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15"
    stopped = RunResult(["torchrun"], -15, said, tmp_path, 97.0, timed_out=True)
    verdicts: dict[int, exercise_check.ExerciseVerdict] = {}
    assert exercise_check._read_batch([(ex, path)], [0], tmp_path, stopped, verdicts) == 1
    message = verdicts[0].message
    assert "never returned" in message and "97 s" in message and "before your code" not in message
    assert not verdicts[0].passed, "a hang is no pass (helper 179's mutant passed it)"
    died = RunResult(["torchrun"], 1, said, tmp_path, 9.0)  # the same output, not stopped
    exercise_check._read_batch([(ex, path)], [0], tmp_path, died, verdicts)
    assert "before your code ran" in verdicts[0].message


def test_a_collective_handed_a_copy_is_told_from_one_handed_a_view():
    """.detach() and .contiguous() share the tensor's memory: a collective into them reaches it;
    .clone() and a conversion make a new tensor nobody reads (the review of the change)."""
    found = exercise_check.COPY_REDUCED.search
    assert found("dist.all_reduce(sums.float())")["copy"] == "float"
    assert found("dist.broadcast(p.detach().clone(), src=0)")["copy"] == "clone"
    assert found("torch.distributed.all_reduce(counts.to(torch.float64))")["copy"] == "to"
    for view in (
        "dist.all_reduce(p.detach())",
        "dist.all_reduce(flat.contiguous())",
        "dist.all_reduce(p.grad)",
    ):
        assert found(view) is None, view
    # a tensor made in the call (helper 147): named as such, not by the .float() inside it
    made = found("dist.all_reduce(torch.tensor([x.float()]))")
    assert made["new"] == "torch.tensor" and made["copy"] is None
    assert found("dist.all_reduce(torch.stack([sums[0], sums[1]]))")["new"] == "torch.stack"


def test_a_candidate_stopped_past_its_own_limit_is_judged_hung_not_launched_again(tmp_path):
    """Helper 122: a hook that deadlocked in the middle of a batch was launched again, first,
    and cost the batch's limit twice (14 min for one CLI call). A candidate in which the
    launch was stopped after its own limit is judged there; one stopped sooner (the batch's
    limit over many slow candidates) runs again."""
    import os
    import time

    from ddp_tutorial.exercises.core import STARTED, find
    from ddp_tutorial.harness.exercise_check import _hung_in

    (ex,) = find("11_bf16_hook")
    folder = tmp_path / "c1"
    assert not _hung_in(ex, folder), "never started"
    folder.mkdir()
    (folder / STARTED).touch()
    assert not _hung_in(ex, folder), "started a moment ago: the batch's limit"
    past = time.time() - ex.launch_timeout_s - 1
    os.utime(folder / STARTED, (past, past))
    assert _hung_in(ex, folder)
