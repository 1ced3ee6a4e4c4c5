"""Wrong answers to the exercises, written as small edits of the reference solutions.

Each lesson's ``tests/test_exercises_NN.py`` lists its :class:`Case` objects with
:func:`register`; the session fixture ``exercise_verdicts`` (conftest) checks every
registered case at once, so that dozens of wrong answers cost a launch or two per world size
(``ddp_tutorial.harness.exercise_check`` batches them), and each case's test reads its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddp_tutorial.exercises.core import Exercise, find

# an edit that binds `all_reduce` in the file: the spies must see such calls too
BY_NAME = (
    "import torch.distributed as dist\n",
    "import torch.distributed as dist\nfrom torch.distributed import all_reduce\n",
)


@dataclass(frozen=True)
class Case:
    """One file to check and what its verdict must say.

    ``expect``: None when the file must pass; else text the failure message must contain
    (the mistake's name, in the lesson's words; "" for any named failure). The file is the
    solution with ``edits`` applied (each ``old`` must occur in it exactly once, so an edited
    solution that no longer has the line fails here, loudly), or ``text`` in full, or the
    untouched stub (``stub``).
    """

    exercise: str
    label: str
    expect: str | None
    edits: tuple[tuple[str, str], ...] = ()
    text: str | None = None
    stub: bool = False

    def __str__(self) -> str:
        return f"{self.exercise}-{self.label}"

    @property
    def spec(self) -> Exercise:
        (ex,) = find(self.exercise)
        return ex

    def write(self, folder: Path) -> Path:
        """The file this case checks, under ``folder``, named after its exercise."""
        ex = self.spec
        if self.stub:
            return ex.stub
        source = self.text if self.text is not None else ex.solution.read_text()
        for old, new in self.edits:
            count = source.count(old)
            assert count == 1, f"{self}: {old!r} occurs {count} times in {ex.solution.name}"
            source = source.replace(old, new)
        path = folder / str(self).replace("/", "_") / f"{ex.name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        return path


REGISTERED: list[Case] = []


def register(cases: list[Case]) -> list[Case]:
    """Add a lesson's cases to the session's batch; returns them for ``parametrize``."""
    REGISTERED.extend(c for c in cases if c not in REGISTERED)
    return cases


def assert_verdict(case: Case, verdicts: dict[str, object]) -> None:
    """The case's verdict says what the case expects (its message shown when it does not)."""
    verdict = verdicts[str(case)]
    if case.expect is None:
        assert verdict.passed, f"{case} should pass: {verdict.message}"
        # a pass says what it has shown (and, where the exercise measures, what it measured)
        assert verdict.message.startswith(f"right: {case.spec.proves}"), verdict.message
        if case.spec.report is not None:
            assert verdict.message.endswith(")") and " ms" in verdict.message, verdict.message
    else:
        assert not verdict.passed, f"{case} should fail with {case.expect!r}, but passed"
        assert case.expect in verdict.message, (
            f"{case}: expected {case.expect!r} in: {verdict.message}"
        )
