"""The machinery around every exercise's verdict, in-process (no launch): what a learner's
`ddp-tutorial check` promises before and after the ranks run. Each test holds a promise that a
mutation audit (helper 179) broke with the whole suite still green."""

from __future__ import annotations

import pytest

from ddp_tutorial.exercises.core import BEGIN, END, all_exercises, find, not_started
from ddp_tutorial.harness import exercise_check
from ddp_tutorial.harness.exercise_check import ExerciseVerdict


def test_a_stub_with_one_block_written_is_started():
    """ "Not started yet" is for a stub whose every block is empty: one block written of two
    is a learner at work, and gets a launch."""
    stubs = [ex for ex in all_exercises() if ex.stub.read_text().count(BEGIN) >= 2]
    assert stubs, "no exercise with two blocks"
    for ex in stubs:
        text = ex.stub.read_text()
        begin = text.index(BEGIN)
        indent = text[text.rindex("\n", 0, begin) + 1 : begin]  # the marker's own
        end = text.rindex("\n", 0, text.index(END, begin)) + 1  # the first block's last line
        half = text[:end] + f"{indent}x = 1\n" + text[end:]
        assert not_started(text) and not not_started(half), ex.name


def test_the_exit_status_is_1_unless_every_exercise_passed(monkeypatch, capsys):
    (ex, other) = find("01")
    verdicts = [ExerciseVerdict(ex, ex.stub, True, "right"),
                ExerciseVerdict(other, other.stub, False, "wrong")]  # fmt: skip
    monkeypatch.setattr(exercise_check, "check", lambda *a, **k: verdicts)
    assert exercise_check.main("01", []) == 1
    verdicts[1] = ExerciseVerdict(other, other.stub, True, "right")
    assert exercise_check.main("01", []) == 0
    assert "FAIL" in capsys.readouterr().out


def test_solution_checks_the_reference_answers_and_no_flag_the_stubs(monkeypatch):
    handed: list[list[tuple]] = []
    monkeypatch.setattr(exercise_check, "check_files",
                        lambda pairs, **kw: handed.append(list(pairs)) or [])  # fmt: skip
    exercise_check.check("01", solution=True)
    exercise_check.check("01")
    exercises = find("01")
    assert handed == [[(ex, ex.solution) for ex in exercises], [(ex, ex.stub) for ex in exercises]]


def test_force_launches_an_untouched_stub(monkeypatch):
    """The tests prove every stub runs (``force``): a stub must reach the launch, not come
    back "not started yet" (whose TODO line the stub cases would accept)."""

    class Launched(Exception):
        pass

    def start(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(exercise_check, "_start", start)
    (ex,) = find("09")
    (told,) = exercise_check.check_files([(ex, ex.stub)])
    assert not told.started and not told.passed
    with pytest.raises(Launched):
        exercise_check.check_files([(ex, ex.stub)], force=True)


def test_a_verdict_names_its_lesson_section_once():
    (ex,) = find("09")
    _, message = exercise_check.judge(ex, [{"rank": 0, "status": "error", "error": "X"},
                                           {"rank": 1, "status": "ok", "result": {}}])  # fmt: skip
    assert message.endswith(f"({ex.teaches})") and message.count(ex.teaches) == 1, message
    own = 'a mistake (lesson 01, "The collectives")'
    assert ex.hint(own) == own


def test_hidden_patterns_read_the_learners_own_code_lines_only(tmp_path):
    """A pattern the check's runs hide is tried on the learner's lines: never the stub's own,
    never a comment."""
    for ex in all_exercises():
        assert exercise_check._your_lines(ex, ex.stub.read_text()).strip() == "", ex.name
    (ex, _) = find("12")  # 12_my_ddp_hooks: a division by 2 is named on a pass
    assert ex.name == "12_my_ddp_hooks" and ex.hidden
    solution = ex.solution.read_text()
    commented = tmp_path / "commented" / f"{ex.name}.py"
    commented.parent.mkdir()
    commented.write_text(solution + "\n# not: p.grad /= 2\n")
    assert exercise_check.by_luck(ex, commented) is None
    coded = tmp_path / "coded" / f"{ex.name}.py"
    coded.parent.mkdir()
    coded.write_text(solution + "\nHALF = 1 / 2\n")
    assert "right in this check's run only" in (exercise_check.by_luck(ex, coded) or "")


def test_the_first_real_error_is_named_before_a_peers_timeout():
    (ex,) = find("09")
    records = [{"rank": 0, "status": "error", "error": "RuntimeError: Timed out waiting"},
               {"rank": 1, "status": "error", "error": "ValueError: boom"}]  # fmt: skip
    assert "rank 1 raised ValueError: boom" in exercise_check.explain_error(ex, records)


def test_known_errors_match_in_order_and_whole():
    """``errors``: the first entry that matches wins; an entry of several strings needs all."""
    (_, ex) = find("12")
    assert ex.name == "12_my_ddp_buckets"
    none = "AttributeError: 'NoneType' object has no attribute 'flatten'"
    in_init = [{"rank": 0, "status": "error", "error": none, "where": "in __init__: x"},
               {"rank": 1, "status": "ok", "result": {}}]  # fmt: skip
    later = [{**in_init[0], "where": "in _launch: x"}, in_init[1]]
    assert "p.grad is None until the first backward" in exercise_check.explain_error(ex, in_init)
    said = exercise_check.explain_error(ex, later)
    assert "a gradient was still None" in said and "until the first backward" not in said
