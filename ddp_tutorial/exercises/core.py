"""What an exercise is, where its files live, and whether the learner has started it.

Kept free of torch and of the host side: the runner (in every rank) and the checker (in
the notebook kernel) both read these definitions.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

EXERCISE_DIR = Path(__file__).resolve().parents[2] / "scripts" / "exercises"
SOLUTION_DIR = EXERCISE_DIR / "solutions"
BEGIN, END = "# YOUR CODE", "# END YOUR CODE"
STARTED = "started"  # a candidate's marker in its folder, written by rank 0 as it begins
# a verdict that ends with this names the one section behind its mistake (not every one)
OWN_SECTION = re.compile(r'\(lesson \d\d, "[^"]+"\)$')


def divided_by(n: int) -> str:
    """A regex of a division by ``n`` (``/ n``, ``/= n``, ``/ n.0``, ``.div_(n)``,
    ``torch.div(t, n)``), not ``// n`` (integer arithmetic), or of a multiplication by its
    reciprocal (``* 0.5``, ``*= 0.25``, ``.mul_(0.5)``; helper 117: those passed): the
    check's own count written in."""
    number = rf"{n}(?:\.0*)?(?![\w.])"
    whole, _, digits = format(1 / n, ".6g").partition(".")
    part = rf"{whole if whole != '0' else '0?'}\.{digits}0*(?![\w.])"
    divided = (
        rf"(?<!/)/(?!/)=?\s*{number}|\.div_?\(\s*{number}\s*\)|torch\.div\([^,()]+,\s*{number}"
    )
    times = rf"(?<!\*)\*(?!\*)=?\s*{part}|\.mul_?\(\s*{part}\s*\)|torch\.mul\([^,()]+,\s*{part}"
    return f"{divided}|{times}"


# a division by 2, the checks' number of ranks, where the world size belongs
DIVIDED_BY_2 = divided_by(2)


def ranks_written_as(n: int) -> str:
    """A regex of the check's number of ranks written where the world size belongs: a stride
    (``range(r, len, n)``, ``[r::n]``, ``i % n == rank``), ``num_replicas=n``, ``world = n``."""
    return (
        rf"range\(.*,\s*{n}\s*\)|::\s*{n}\s*\]|%\s*{n}\b(?!\.)|num_replicas\s*=\s*{n}\b|"
        rf"\bworld(?:_size)?\s*=\s*{n}\b"
    )


# a call's arguments (four levels of brackets inside it, over lines) naming no device
# (torch.tensor(float(sum(len(y) for ...))): four)
_NO_DEVICE = r"(?:(?!device)[^()])*"
for _ in range(4):
    _NO_DEVICE = rf"(?:(?!device)[^()]|\({_NO_DEVICE}\))*"
_NO_DEVICE = rf"\({_NO_DEVICE}\)"
# a move: .to(...) or .cuda(...) naming a device, or giving no dtype alone (.to(x.dtype) stays);
# .type_as(x), x's device and dtype (helper 174)
_MOVE = (
    r"\.type_as\(|\.(?:to|cuda)\((?:(?=[^()]*device)|(?!\s*(?:dtype\s*=|[\w.]*dtype\s*[,)]|"
    r"torch\.(?:u?int\d*|float\d*|bfloat16|half|long|double|bool)\s*\))))"
)
# a tensor made without device= (so on the CPU) that goes to a collective: right with gloo, the
# checks' backend; under nccl "No backend type associated with device type cpu" (lesson 01)
# (its call names no device; no move nor a new value of the name before the collective; not
# under a `with torch.device(...)`: helper 166's right answers - a call on 5 lines, .to(x), a
# with; helper 168's wrong ones - a device= on a line between, a list of them, .to(dtype);
# as_tensor only of a literal: of a tensor it keeps that tensor's device; helper 171's
# torch.Tensor(n) and a copy made with .cpu() or .to("cpu"); a list filled by .append, by
# .extend([...]) or += [...] (helper 177))
_FACTORY = (
    r"torch\.(?:zeros|empty|ones|full|tensor|Tensor|arange|LongTensor|FloatTensor|"
    r"as_tensor(?=\(\s*[\[(\d]))" + _NO_DEVICE
)
MADE_ON_THE_CPU = (
    r"(?ms)\A(?!.*\bwith\s+torch\.device\().*?^[ \t]*(?P<v>[\w.]+)(?:\s*=\s*(?:\[?\s*"
    + _FACTORY
    + r"|[\w.\[\]]+\.(?:cpu\(\)|to\(\s*[\"']cpu[\"']\s*\)))|"
    + r"(?:\.append\(|\.extend\(\s*\[|\s*\+=\s*\[)\s*"
    + _FACTORY
    + ")"
    + rf"(?:(?!{_MOVE}|^[ \t]*(?P=v)\s*=).)*?\bdist\.\w+\([^\n]*\b(?P=v)\b",
    "a tensor made without device= (or copied to the CPU) goes to a collective: right with "
    "gloo, this check's "
    "backend, but under nccl (GPUs) a collective takes CUDA tensors only - 'No backend type "
    "associated with device type cpu' on the first GPU run - make it on the device of the "
    'tensors it meets (device=x.device) (lesson 01, "Backends: gloo and nccl")',
)


# a collective given a CPU copy, dist.all_reduce(x.cpu()): on the CPU the copy is x itself (this
# check's run); on a GPU the result goes into a copy that is thrown away (helper 174)
# (not the object collectives, which pickle what they are given and take CPU tensors; not a
# .cpu().tolist(), a Python list: helper 177). exercise_check.COPY_REDUCED names the other
# copies (x.float(), x.clone(), torch.stack(...)) on a failure: those lose the result on the
# CPU too; x.cpu() alone is x there, so only a pass can show it
COPY_IN_A_COLLECTIVE = (
    r"\bdist\.(?!\w*object)\w+\((?:[^()\n,]*,\s*)?(?:\w+\s*=\s*)?[\w.\[\]]+(?:\.detach\(\))?"
    r"\.(?:cpu\(\)|to\(\s*[\"']cpu[\"']\s*\))(?!\.(?:tolist|item|numpy)\()",
    "a collective is given x.cpu(): on the CPU that is x itself, so it worked here, but on a GPU "
    "it is a copy on the CPU - nccl refuses it, and a result written into it (all_reduce, "
    "broadcast, recv) is thrown away - hand the collective the tensor itself, on its device "
    '(lesson 01, "Backends: gloo and nccl")',
)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as a verdict quotes it: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:limit] if str(exc) else ''}"


Record = dict[str, Any]
# rank side: (the learner's module, this rank's context) -> what the judge reads
RunFn = Callable[[ModuleType, "Context"], Record]
# host side: every rank's record (rank order) -> None when right, else the named mistake
JudgeFn = Callable[[list[Record]], "str | None"]


@dataclass(frozen=True)
class Context:
    """What a rank knows while it runs one candidate file."""

    rank: int
    world_size: int
    out: Path  # this candidate's folder in the run directory (a script's --out)


@dataclass(frozen=True)
class Exercise:
    """One exercise: a stub the learner edits, a reference answer, a run and a judge.

    ``kind="functions"``: the runner starts the process group, imports the file and calls
    ``run(module, ctx)`` on every rank. ``kind="script"``: the runner executes the file as
    ``__main__`` with ``--out DIR`` (and ``args``), as torchrun would, and ``run`` (if any)
    reads what it left behind. ``judge`` sees every rank's record, on the host.
    ``teaches``: where the lesson explains it, quoted in every hint; ``proves``: what the
    judge found true, said on a pass.
    """

    name: str  # the file's stem: scripts/exercises/{name}.py
    lesson: str  # "00" ... "12"
    title: str
    teaches: str  # e.g. 'lesson 01, "The collectives"'
    proves: str  # what a pass has shown, said with it: "right" alone teaches nothing
    judge: JudgeFn
    run: RunFn | None = None
    kind: str = "functions"
    nproc: int = 2
    args: tuple[str, ...] = ()
    # (text in a rank's error or output - or a tuple of texts, all there - , the mistake)
    errors: tuple[tuple[str | tuple[str, ...], str], ...] = ()
    report: Callable[[list[Record]], str] | None = None  # on a pass: what was measured
    exit_codes: tuple[int, ...] = ()  # a script's sys.exit(code) that is an answer (lesson 08: 75)
    collective_timeout_s: float = 10.0  # a rank that waits this long for a peer fails, named
    # a script's: entered around the learner's file on each rank (lesson 08 slows rank 0's save)
    around: Callable[[Context], AbstractContextManager[Any]] | None = None
    launch_timeout_s: float = 90.0
    # where tensors of different shapes are this exercise's likely hang: what differs (02: a
    # count per class that only the classes a rank saw have), added to the hang's verdict
    shapes_hint: str = ""
    # (a regex over the code of the learner's blocks, the mistake): what the runs cannot show,
    # tried on a file that passed (05: the resume epoch read from the simulation's own flag)
    hidden: tuple[tuple[str, str], ...] = ()
    # (a regex over the code of the learner's blocks, the mistake): named when the ranks hang,
    # instead of the hang's general causes (05: the snapshot loaded under `if rank == 0`)
    when_hung: tuple[tuple[str, str], ...] = ()

    @property
    def tried_on_a_pass(self) -> tuple[tuple[str, str], ...]:
        """``hidden``, and for the functions the check hands tensors to (which a GPU job holds
        on its GPU): a tensor of the learner's made on the CPU for a collective."""
        held = (
            self.kind == "functions"
            and not re.search(  # 07's answer makes a CPU tensor on purpose
                MADE_ON_THE_CPU[0], self.solution.read_text()
            )
        )
        return (*self.hidden, *((MADE_ON_THE_CPU, COPY_IN_A_COLLECTIVE) if held else ()))

    @property
    def stub(self) -> Path:
        return EXERCISE_DIR / f"{self.name}.py"

    @property
    def solution(self) -> Path:
        return SOLUTION_DIR / f"{self.name}.py"

    def hint(self, mistake: str) -> str:
        """A mistake, with where the lesson teaches the point: the exercise's sections, unless
        the verdict ends with its own one, ``(lesson NN, "section")``."""
        return mistake if OWN_SECTION.search(mistake) else f"{mistake} ({self.teaches})"


def your_code_blocks(text: str) -> list[str]:
    """The learner's blocks: the lines between ``# YOUR CODE`` and ``# END YOUR CODE``."""
    pattern = re.compile(rf"^[ \t]*{re.escape(BEGIN)}\b.*?\n(.*?)^[ \t]*{re.escape(END)}\b",
                         re.S | re.M)  # fmt: skip
    return pattern.findall(text)


def not_started(text: str) -> bool:
    """True for an untouched stub: every ``# YOUR CODE`` block holds no code yet.

    Only comments, ``pass`` and ``...`` count as empty, so the notebook can say "not
    started yet" without a launch. A file without the markers counts as started.
    """
    blocks = your_code_blocks(text)
    if not blocks:
        return False
    for block in blocks:
        for line in block.splitlines():
            code = line.split("#", 1)[0].strip()
            if code not in ("", "pass", "..."):
                return False
    return True


def lesson_modules() -> list[ModuleType]:
    """Every ``lessonNN`` module of this package, in lesson order."""
    found = pkgutil.iter_modules([str(Path(__file__).parent)])
    names = sorted(m.name for m in found if m.name.startswith("lesson"))
    return [importlib.import_module(f"ddp_tutorial.exercises.{n}") for n in names]


def all_exercises() -> list[Exercise]:
    """Every exercise of every lesson, in lesson order."""
    return [ex for module in lesson_modules() for ex in module.EXERCISES]


def find(key: str) -> list[Exercise]:
    """A lesson's exercises ("01" or "1") or one exercise by name ("01_ring_average")."""
    exercises = all_exercises()
    if key.isdigit():
        found = [ex for ex in exercises if ex.lesson == f"{int(key):02d}"]
    else:
        found = [ex for ex in exercises if ex.name == Path(key).stem]
    if not found:
        known = ", ".join(sorted({ex.lesson for ex in exercises}))
        raise LookupError(f"no exercise {key!r}: lessons with exercises are {known}; "
                          "or name one by its file, e.g. 01_ring_average")  # fmt: skip
    return found
