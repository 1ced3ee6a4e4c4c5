"""``ddp-tutorial check NN``: run the learner's exercise files under torchrun and name the mistake.

The same from a shell and from a notebook cell. An untouched stub is recognised without a
launch ("not started yet"), so an unfinished exercise costs a lesson no time and never stops
``make run``. Files that are started go to the rank side (``ddp_tutorial.exercises.runner``)
in as few launches as possible: one per world size, plus one more after a candidate whose
rank died (gloo aborts the process on some mistakes), for the candidates after it.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_tutorial import settings
from ddp_tutorial.exercises.core import (
    BEGIN,
    END,
    STARTED,
    Exercise,
    Record,
    all_exercises,
    find,
    not_started,
    your_code_blocks,
)
from ddp_tutorial.harness.launch import Launch, RunResult, start
from ddp_tutorial.harness.runs import default_run_dir
from ddp_tutorial.records import read_rank_records

MAX_LAUNCH_S = 420.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")
HANG_WORDS = (
    "timed out",
    "Timed out",
    "timeout caused pair closure",
    "Connection closed by peer",
    "Connection reset",
)


@dataclass
class ExerciseVerdict:
    """One exercise checked on one file."""

    exercise: Exercise
    file: Path
    passed: bool
    message: str
    started: bool = True
    seconds: float = 0.0

    def line(self) -> str:
        mark = "PASS" if self.passed else ("TODO" if not self.started else "FAIL")
        return f"{mark}  {self.exercise.name} ({self.file}): {self.message}"


def _hung(record: Record) -> bool:
    return any(w in record.get("error", "") for w in HANG_WORDS)


def explain_error(ex: Exercise, records: list[Record], output: str = "") -> str:
    """The first failing rank's error, named: a known mistake, a hang, or the line it came from.

    ``ex.errors`` are matched against the failing ranks' errors and the lines they failed at,
    and against the launch's output only when a rank died without a record (the output is
    shared by every candidate of the launch). A real error beats a peer's timeout: the first
    failure is the one to read (lesson 09); a hang names every rank that waited, and where.
    """
    bad = [r for r in records if r.get("status") != "ok"]
    died = len(records) < ex.nproc
    said = "\n".join([f"{r.get('error', '')}\n{r.get('where', '')}" for r in bad]
                     + ([output] if died else []))  # fmt: skip
    for text, mistake in ex.errors:  # text: one string, or several that must all be there
        if all(t in said for t in ((text,) if isinstance(text, str) else text)):
            return ex.hint(mistake)
    if not bad:
        missing = sorted(set(range(ex.nproc)) - {r["rank"] for r in records})
        return ex.hint(
            f"rank {missing[0] if missing else '?'} never reported: it crashed or "
            "hung (the launch's output above says how)"
        )
    first = min(bad, key=lambda r: (_hung(r), r["rank"]))
    if _hung(first):
        waits = "; ".join(f"rank {r['rank']} waited" + (f" at {r['where']}" if r.get("where")
                          else "") for r in sorted(bad, key=lambda r: r["rank"]))  # fmt: skip
        others = [r["rank"] for r in records if r.get("status") == "ok"]
        if not others and all("send(" in r.get("where", "") for r in bad):
            return ex.hint(
                f"{waits}: every rank called a blocking send first, and a send waits for its "
                "recv - use dist.isend (then recv, then wait()), or let even ranks send first "
                "and odd ranks receive first"
            )
        return ex.hint(
            f"{waits}, for a peer that never came"
            + (f" (rank {others[0]} had finished)" if others else "")
            + ": every rank must call the same collectives, and each send needs its recv, in "
            "the same order - is one under `if rank == ...`, or in a loop that runs more "
            "times on one rank (a collective per batch, over shares of different sizes), or "
            "do the ranks pass tensors of different shapes"
            + (f" ({ex.shapes_hint})" if ex.shapes_hint else "")
            + "?"
        )
    where = f" at {first['where']}" if first.get("where") else ""
    error = ANSI.sub("", first["error"]).splitlines()[0]  # torch's bold in its own messages
    return ex.hint(f"rank {first['rank']} raised {error}{where}")


def told_init_wrong(results: list[Record]) -> str | None:
    """A rank= or world_size= given to init_process_group that is not this process's global one.

    The check makes each candidate's group itself (and so replaces what the learner passed);
    on a real job of several machines LOCAL_RANK or LOCAL_WORLD_SIZE there breaks the group.
    """
    n = len(results)
    for rank, result in enumerate(results):
        asked = result.get("init_asked") or {}
        for key, real in (("rank", rank), ("world_size", n)):
            if key in asked and asked[key] != real:
                return (f"rank {rank} called init_process_group({key}={asked[key]}); this process "
                        f"is global rank {rank} of {n}: rank= and world_size= are the global "
                        "ones, RANK and WORLD_SIZE - not LOCAL_RANK or LOCAL_WORLD_SIZE, one "
                        "machine's own (the check may run each process as a machine of its "
                        "own) - or leave both out: init reads torchrun's environment")  # fmt: skip
    return None


def judge(ex: Exercise, records: list[Record], output: str = "") -> tuple[bool, str]:
    """(passed, message) from every rank's record of one candidate (``output``: the launch's)."""
    if len(records) < ex.nproc or any(r.get("status") != "ok" for r in records):
        return False, explain_error(ex, records, output)
    results = [r.get("result", {}) for r in sorted(records, key=lambda r: r["rank"])]
    mistake = told_init_wrong(results) or ex.judge(results)
    if mistake is not None:
        return False, ex.hint(mistake)
    return True, f"right: {ex.proves}" + (f" ({ex.report(results)})" if ex.report else "")


def _start(batch: list[tuple[Exercise, Path]], echo: bool) -> tuple[Launch, Path]:
    """Start one torchrun for a batch of the same world size; its run directory."""
    nproc = batch[0][0].nproc
    args = [a for ex, path in batch for a in ("--candidate", f"{ex.name}={path.resolve()}")]
    run_dir = default_run_dir("exercise_check")
    # a batch that outlives this is killed; the candidates without a record run again
    timeout = min(sum(ex.launch_timeout_s for ex, _ in batch), MAX_LAUNCH_S)
    # CPU and gloo everywhere: the same check on a laptop and a GPU box
    env = {settings.VISIBLE_DEVICES_ENV: "", "OMP_NUM_THREADS": "1"}
    launch = start("ddp_tutorial.exercises.runner", *args, module=True, nproc=nproc, env=env,
                   run_dir=run_dir, timeout=timeout, check=False, echo=echo)  # fmt: skip
    return launch, run_dir


MISMATCH = ("doesn't match", "EnforceNotMet")  # gloo's words for ranks in different collectives


def died(ex: Exercise, path: Path, output: str) -> str:
    """The ranks died without a record (gloo aborts a process whose peers called another
    collective): where in the learner's file, if the output says, else how to see it."""
    # a traceback names the innermost frame last ("line 9, in f"); a fatal error's dump
    # (faulthandler, when gloo aborts) first ("line 9 in f")
    found = re.findall(rf'File "{re.escape(str(path.resolve()))}", line (\d+)(,?)', output)
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
    if not found and codes and codes <= set(ex.exit_codes):  # os._exit(75): ended on the spot
        return ex.hint(f"a rank ended its process with status {min(codes)} before the check "
                       "could read what it did (os._exit stops a process on the spot: the lines "
                       "after it, the report this file writes and every finally are skipped) - "
                       "set the status and leave the loop; main() returns it (on a cluster, end "
                       "the script with sys.exit(main()))")  # fmt: skip
    if not found:
        errors = re.findall(r"^\S*(?:Error|Exception): .*$", output, re.M)
        said = f" ({errors[-1].strip()[:200]})" if errors else ""
        if ex.kind != "script":  # the check imports your file: torchrun alone would run nothing
            return ex.hint(f"the launch failed before your code ran{said}: check again; if it "
                           "fails the same way, `ddp-tutorial doctor` checks this machine's "
                           "torch and gloo")  # fmt: skip
        return ex.hint(f"the launch failed before your code ran{said}: run it in a shell, "
                       f"torchrun --standalone --nproc-per-node {ex.nproc} {path}")  # fmt: skip
    traced = [n for n, comma in found if comma]
    line = int(traced[-1] if traced else found[0][0])
    code = path.read_text().splitlines()[line - 1].strip() if path.is_file() else ""
    if any(word in output for word in MISMATCH):
        return ex.hint(f"the ranks were aborted by gloo at your file, line {line}: {code} - "
                       "the ranks called different collectives (or sent tensors of different "
                       "sizes): is a collective under an `if` only some ranks take?")  # fmt: skip
    return ex.hint(f"a rank died at your file, line {line}: {code} - run it in a shell to see "
                   f"why: torchrun --standalone --nproc-per-node {ex.nproc} {path}")  # fmt: skip


# lint's findings that a check's own model cannot show: right here, wrong on the learner's model
LUCKY = ("DDP124", "DDP129")  # k.lstrip("module."): "0.weight" survives it, "layer.weight"
# does not; k.replace("module.", ""): so does every key of a model without "...module." inside


def by_luck(ex: Exercise, path: Path) -> str | None:
    """A passing file that holds a mistake the check's runs happen to hide: a lint finding
    (the keys of its model start with a digit, so ``k.lstrip("module.")`` leaves them whole),
    or one of the exercise's ``hidden`` patterns in the learner's own lines."""
    from ddp_tutorial.harness.lint import lint_source

    text = path.read_text()
    found = [f for f in lint_source(text, str(path)) if f.code in LUCKY]
    if found:
        return ex.hint(f"right on this check's model only: your file, line {found[0].line}: "
                       f"{found[0].message}")  # fmt: skip
    for pattern, mistake in ex.tried_on_a_pass:
        if re.search(pattern, _your_lines(ex, text)):
            said = "" if mistake.startswith("passed, but") else "right in this check's run only: "
            return ex.hint(said + mistake)
    return None


def _your_lines(ex: Exercise, text: str) -> str:
    """The code of the learner's YOUR CODE blocks, then every other line the stub does not have
    (markers deleted with the stub's comments, helper 136; a change outside the blocks, helper
    139: ``DDP(model, broadcast_buffers=False)``), comments left out."""
    lines = [line for block in your_code_blocks(text) for line in block.splitlines()]
    if ex.stub.is_file():
        stub = {line.strip() for line in ex.stub.read_text().splitlines()} | set(lines)
        lines += [
            line for line in text.splitlines() if line not in stub and line.strip() not in stub
        ]
    return "\n".join(line.split("#", 1)[0] for line in lines)


def hung_by(ex: Exercise, path: Path, records: list[Record]) -> str | None:
    """A hang whose cause the learner's own lines show (``ex.when_hung``): named, instead of
    the list of what makes ranks wait for each other."""
    if not any(_hung(r) for r in records) or not path.is_file():
        return None
    code = _your_lines(ex, path.read_text())
    named = next((ex.hint(m) for p, m in ex.when_hung if re.search(p, code)), None)
    if named is None and (under := UNDER_RANK_0.search(code)):  # helper 146: any exercise
        op = under["op"] or under["inner"]
        named = ex.hint(f"dist.{op}() is under `if rank == 0`: the other ranks never call it, "
                        "and every rank that does waits for them - call it on every rank, "
                        "outside the `if`")  # fmt: skip
    return named


_OPS = r"all_reduce|barrier|broadcast\w*|all_gather\w*|reduce_scatter\w*|reduce|scatter|gather"
# a collective on the `if` line itself, or on a line indented under it
UNDER_RANK_0 = re.compile(
    rf"(?m)^( *)if\b[^\n]*\b(?:rank|get_rank\(\))\s*==\s*0\b[^\n]*:[ \t]*(?:[^\n]*"
    rf"\bdist\.(?P<op>{_OPS})\(|\n(?:\1 +[^\n]*\n|[ \t]*\n)*?\1 +[^\n]*\bdist\.(?P<inner>{_OPS})\()"
)


# dist.all_reduce(x.float()), dist.all_reduce(torch.stack(...)): the collective works in place
# on a new tensor nobody reads (not .detach() nor .contiguous(): they share x's memory)
COPY_REDUCED = re.compile(
    r"(?:dist|distributed)\.(?P<op>all_reduce|broadcast|reduce)\(\s*(?:(?P<new>torch\.(?:stack|"
    r"tensor|cat))|[\w.\[\]]+(?:\.\w+\(\))*?\.(?P<copy>float|double|long|int|half|bfloat16|clone|"
    r"to|cpu|cuda))\("
)


def reduced_a_copy(ex: Exercise, path: Path) -> str | None:
    """A failed file whose collective was handed a new tensor (the runs show own results)."""
    found = COPY_REDUCED.search(_your_lines(ex, path.read_text())) if path.is_file() else None
    if found is None:
        return None
    op, copy, new = found["op"], found["copy"], found["new"]
    made = f"{new}(...)" if new else f"x.{copy}(...)"
    when = "always" if new or copy == "clone" else "whenever it converts"
    return ex.hint(f"dist.{op}({made}) was handed a new tensor: {made} makes one ({when}), and "
                   f"{op} worked on that copy in place, which nothing reads - make it first "
                   f"(x = {made}), then dist.{op}(x), and read x")  # fmt: skip


def _hung_in(ex: Exercise, folder: Path) -> bool:
    """Whether a stopped launch was stopped in this candidate after it had run longer than its
    own limit (the batch's limit alone can end a launch of many slow, right candidates)."""
    started = folder / STARTED
    return started.is_file() and time.time() - started.stat().st_mtime >= ex.launch_timeout_s


def _read_batch(pairs: Sequence[tuple[Exercise, Path]], indexes: list[int], run_dir: Path,
                result: RunResult, verdicts: dict[int, ExerciseVerdict]) -> int:  # fmt: skip
    """The verdicts of one ended launch's candidates (``indexes`` into ``pairs``, in the order
    it ran them), into ``verdicts``; how many it judged (the rest run again)."""
    ran = 0
    for c, i in enumerate(indexes):
        records = read_rank_records(run_dir / f"c{c}", "status-rank*.json")
        if not records:
            break  # the batch stopped before this one: launch the rest again
        ex, path = pairs[i]
        passed, message = judge(ex, records, result.output)
        if passed and (luck := by_luck(ex, path)):
            passed, message = False, luck
        elif not passed and (  # a verdict that already names a copy is the check's own
            named := hung_by(ex, path, records)
            or (None if "copy" in message else reduced_a_copy(ex, path))
        ):
            message = named
        verdicts[i] = ExerciseVerdict(ex, path, passed, message, seconds=result.seconds)
        ran += 1
    # the launch died, or was stopped in a candidate that had run past its own limit: that
    # one's verdict now (helper 122: relaunched first, a hang cost the batch's limit twice)
    if ran < len(indexes) and (ran == 0 or _hung_in(pairs[indexes[ran]][0], run_dir / f"c{ran}")):
        ex, path = pairs[indexes[ran]]
        message = died(ex, path, result.output)
        if result.timed_out:  # killed by the launch's own timeout: nothing died, it never ended
            where = (f"run it in a shell to see where: torchrun --standalone --nproc-per-node "
                     f"{ex.nproc} {path}") if ex.kind == "script" else (
                     f"check it alone (ddp-tutorial check {ex.name} {path}) and, while it "
                     "hangs, py-spy dump --pid <a rank's pid> shows where each rank waits (a "
                     ".wait() inside a Future's .then() callback never returns)")  # fmt: skip
            message = ex.hint(f"your code never returned: the launch was stopped after "
                              f"{result.seconds:.0f} s with no rank's record (an endless loop, "
                              f"or a wait for something that never comes) - {where}")  # fmt: skip
        verdicts[indexes[ran]] = ExerciseVerdict(ex, path, False, message, seconds=result.seconds)
        ran += 1
    return ran


def check_files(pairs: Sequence[tuple[Exercise, Path]], echo: bool = False,
                force: bool = False, per_launch: int = 0) -> list[ExerciseVerdict]:  # fmt: skip
    """Verdicts for (exercise, file) pairs, in order; untouched stubs without a launch
    (``force``: launch them too - the tests prove that every stub runs). One launch per world
    size, side by side (lesson 01's 3-rank ring and 2-rank gather: one wait, not two);
    ``per_launch``: at most that many candidates in one, the rest in more launches beside it
    (the tests' batch of hundreds mostly waits: on hangs' timeouts, on deliberate late starts)."""
    verdicts: dict[int, ExerciseVerdict] = {}
    sizes: dict[int, list[int]] = {}  # world size -> indexes to launch
    for i, (ex, path) in enumerate(pairs):
        if not path.is_file():
            verdicts[i] = ExerciseVerdict(ex, path, False, f"no such file: {path}")
        elif not force and not_started(path.read_text()):
            again = "" if path.resolve() == ex.stub.resolve() else f" {path}"
            verdicts[i] = ExerciseVerdict(ex, path, False, started=False, message=(
                f"not started yet: write your lines between `{BEGIN}` and `{END}` in {path}, "
                f"then run `ddp-tutorial check {ex.lesson}{again}` ({ex.teaches})"))  # fmt: skip
        elif syntax := syntax_error(path):  # told at once: a launch would bury it in importlib
            verdicts[i] = ExerciseVerdict(ex, path, False, ex.hint(syntax))
        else:
            sizes.setdefault(ex.nproc, []).append(i)
    todo: dict[tuple[int, int], list[int]] = {}  # (world size, share) -> indexes still to run
    for n, indexes in sizes.items():
        shares = -(-len(indexes) // per_launch) if per_launch else 1
        todo.update(((n, k), indexes[k::shares]) for k in range(shares))
    launches: dict[tuple[int, int], tuple[Launch, Path]] = {}
    try:
        while todo:  # a launch that ended early starts again at once with what it left
            for key, indexes in todo.items():
                if key not in launches:
                    launches[key] = _start([pairs[i] for i in indexes], echo)
            while not (ended := [key for key, (launch, _) in launches.items() if launch.done]):
                for launch, _ in launches.values():
                    launch.poll(block_s=0.05)
            for key in ended:
                launch, run_dir = launches.pop(key)
                ran = _read_batch(pairs, todo[key], run_dir, launch.wait(), verdicts)
                todo[key] = todo[key][ran:]
            todo = {key: indexes for key, indexes in todo.items() if indexes}
    except BaseException:  # an interrupt (Ctrl-C in a cell): no launch outlives the check
        for launch, _ in launches.values():
            launch.kill()
        raise
    return [verdicts[i] for i in range(len(pairs))]


def syntax_error(path: Path) -> str | None:
    """The file's syntax error, where it is, or None: Python would refuse the file at import."""
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as exc:
        return f"{path.name}, line {exc.lineno}: SyntaxError: {exc.msg} - fix it, then check again"
    return None


def from_first_line(path: Path, exercises: Sequence[Exercise]) -> Exercise | None:
    """The exercise whose stub's first line (``Lesson NN, your turn: ...``) the file keeps,
    if exactly one does: a copy renamed by the learner is still recognised."""
    try:
        first = path.read_text().lstrip().splitlines()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        return None
    found = [ex for ex in exercises if ex.stub.read_text().splitlines()[0] == first]
    return found[0] if len(found) == 1 else None


def check(key: str, files: Sequence[str | Path] = (), solution: bool = False,
          echo: bool = False) -> list[ExerciseVerdict]:  # fmt: skip
    """Check lesson ``key``'s exercises (or one exercise by name) on the learner's files.

    ``files``: the files to check (each matched to its exercise by name; a single file for a
    lesson with one exercise may have any name); default: the stubs in scripts/exercises/,
    or the reference answers with ``solution``.
    """
    exercises = find(key)
    if files and solution:
        raise LookupError("--solution checks the reference answers: give it no files")
    if not files:
        pairs = [(ex, ex.solution if solution else ex.stub) for ex in exercises]
    else:
        by_name = {ex.name: ex for ex in exercises}
        pairs = []
        for f in map(Path, files):
            if f.is_dir():
                raise LookupError(f"{f} is a folder: give the exercise's file")
            ex = by_name.get(f.stem) or (exercises[0] if len(exercises) == 1 else None)
            ex = ex or from_first_line(f, exercises)
            if ex is None and not f.is_file():
                raise LookupError(f"{f}: no such file")
            other = from_first_line(f, all_exercises())
            if ex is not None and other is not None and other is not ex:
                raise LookupError(f"{f} keeps the first line of {other.name}'s stub, not "
                                  f"{ex.name}'s: check it with `ddp-tutorial check "
                                  f"{other.name} {f}`")  # fmt: skip
            if ex is None:
                names = ", ".join(by_name)
                raise LookupError(f"{f}: which exercise? name the file after one of {names}, "
                                  "or keep its stub's first line")  # fmt: skip
            pairs.append((ex, f))
    return check_files(pairs, echo=echo)


def show(key: str, **options: Any) -> list[ExerciseVerdict]:
    """The notebook's check cell: print each verdict; never raise (a lesson must go on)."""
    try:
        verdicts = check(key, **options)
    except Exception as exc:  # a broken exercise file must not stop the lesson
        print(f"ddp-tutorial check {key}: {type(exc).__name__}: {exc}")
        return []
    for v in verdicts:
        print(v.line())
    return verdicts


def main(key: str, files: Sequence[str], solution: bool = False) -> int:
    """``ddp-tutorial check``: 0 when every exercise passes, 1 with the named mistakes."""
    try:
        verdicts = check(key, files, solution=solution, echo=False)
    except LookupError as exc:
        print(f"ddp-tutorial check: {exc}", file=sys.stderr)
        return 2
    for v in verdicts:
        print(v.line())
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":  # `python -m` this module: the same as `ddp-tutorial check`, not silence
    from ddp_tutorial.harness.cli import main as cli

    sys.exit(cli(["check", *sys.argv[1:]]))
