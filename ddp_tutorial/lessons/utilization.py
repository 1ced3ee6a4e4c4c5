"""Helpers of lesson 06 (the template, and utilization): its sections, thresholds, step times.

* :func:`template_sections` reads the numbered sections of ``scripts/train.py``
  out of the file when the lesson runs, so the lesson shows the template as it
  is, never a copy that drifted from it.
* :func:`utilization_plan` says, per kind of device the monitor sampled, which
  run must keep it busy and what "busy" and "balanced" mean there: a CPU rank
  is measured in % of one core, a GPU in NVML's kernel-busy %.
* :func:`cpu_busy_floor` lowers the CPU level "busy" must reach to what a
  loaded machine leaves each computing process (its fair share of the cores).
* :func:`step_breakdown` turns ``scripts/demos/imbalance.py``'s per-step times
  into a table per rank.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^\s*# (\d+)\. ")
"""A section starts at a comment line ``# N. …``, as the template numbers its steps."""


@dataclass(frozen=True, repr=False)
class Section:
    """One numbered step of the template: its number, heading and code (lines ``start``–``end``)."""

    number: int
    title: str
    start: int
    end: int
    code: str
    whole_function: bool = False  # a function whose docstring starts "N. " (data_loader)

    def _repr_markdown_(self) -> str:
        where = f"*`scripts/train.py`, lines {self.start}–{self.end}*"
        return f"{where}\n\n```python\n{self.code}\n```"

    def __repr__(self) -> str:  # what a plain-text viewer shows
        return f"# scripts/train.py, lines {self.start}-{self.end}\n{self.code}"


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    return text.split(". ", 1)[0].rstrip(".") + "."


def _docstring_number(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, str] | None:
    """``(N, heading)`` of a function whose docstring starts ``N. …`` (a whole section)."""
    found = re.match(r"(\d+)\. (.*)", ast.get_docstring(fn) or "", re.DOTALL)
    return (int(found.group(1)), _first_sentence(found.group(2))) if found else None


def _comment_heading(lines: list[str], line: int) -> str:
    """The first sentence of the comment that starts at ``line``, continuation lines joined."""
    words = [MARKER.sub("", lines[line - 1])]
    for following in lines[line:]:
        if not following.lstrip().startswith("#") or MARKER.match(following):
            break
        words.append(following.strip().lstrip("#"))
    return _first_sentence(" ".join(words))


def _block(lines: list[str], start: int, end: int) -> str:
    """Lines ``start``–``end`` (1-based, inclusive), dedented, trailing blank lines dropped."""
    return textwrap.dedent("\n".join(lines[start - 1 : end])).rstrip()


def _statements(tree: ast.AST) -> list[tuple[ast.stmt, list[ast.stmt]]]:
    """Every statement with the block (the list of statements) it belongs to."""
    found = []
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                found += [(stmt, block) for stmt in block if isinstance(stmt, ast.stmt)]
        for handler in getattr(node, "handlers", []):
            found += [(stmt, handler.body) for stmt in handler.body]
    return found


def _section_end(statements: list[tuple[ast.stmt, list[ast.stmt]]], line: int, stop: int) -> int:
    """The last line of the statements that follow the comment at ``line``, in its block.

    The block is that of the first statement after the comment; the section
    takes its statements in order until one reaches ``stop`` (the next numbered
    comment) or the block ends — so a section inside a loop ends with the loop
    body, and one before a loop stops before the loop that holds the next.
    """
    after = [(s, b) for s, b in statements if s.lineno > line]
    if not after:
        return line
    first = min(s.lineno for s, _ in after)
    stmt, block = max(((s, b) for s, b in after if s.lineno == first),
                      key=lambda sb: (sb[0].end_lineno or 0) - sb[0].lineno)  # fmt: skip
    end = line
    for following in block[block.index(stmt) :]:
        if following.lineno >= stop or (following.end_lineno or following.lineno) >= stop:
            break
        end = following.end_lineno or following.lineno
    if end == line and stmt.lineno < stop:  # the next section sits inside this very statement
        end = stop - 1  # (``# 8.`` above a loop whose body holds ``# 9.``): up to it, as text
    return end


def script_flags(path: str | os.PathLike[str]) -> dict[str, dict[str, str]]:
    """Each ``--flag`` a script declares, ``p.add_argument("--x", ...)`` or ``add("--x", ...)``
    (the template's alias), with its ``default`` and ``help`` as source text: read with ``ast``,
    so lesson 06 compares the rung's flags with the template's without running either file."""
    found: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if not (
            isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
        ):
            continue
        called = getattr(node.func, "attr", getattr(node.func, "id", None))
        flag = str(node.args[0].value)
        if called in ("add_argument", "add") and flag.startswith("--"):
            words = {k.arg: ast.unparse(k.value) for k in node.keywords}
            found[flag] = {"default": words.get("default", ""), "help": words.get("help", "")}
    return found


def template_sections(source: str) -> list[Section]:
    """The numbered sections of the template's source, in the order they appear in the file.

    Two spellings, both the template's: a comment line ``# N. …`` starts a
    section made of the statements that follow it in the same block, up to the
    next numbered comment or the block's end (section 3 ends with ``main()``'s
    ``finally:``; section 9, inside the epoch loop, with the loop's body); a
    function whose docstring starts ``N. …`` (``data_loader``) is a section on
    its own. The caller checks the numbering.
    """
    lines = source.splitlines()
    tree = ast.parse(source)
    statements = _statements(tree)
    markers = [(i, int(m.group(1))) for i, line in enumerate(lines, 1) if (m := MARKER.match(line))]
    sections = []
    for k, (line, number) in enumerate(markers):
        stop = markers[k + 1][0] if k + 1 < len(markers) else len(lines) + 1
        end = _section_end(statements, line, stop)
        title = _comment_heading(lines, line)
        sections.append(Section(number, title, line, end, _block(lines, line, end)))
    for fn in _functions(tree):
        if (found := _docstring_number(fn)) is not None:
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            end = fn.end_lineno or fn.lineno
            code = _block(lines, start, end)
            sections.append(Section(found[0], found[1], start, end, code, whole_function=True))
    return sorted(sections, key=lambda s: s.start)


def utilization_plan(kind: str) -> dict[str, Any]:
    """What the lesson checks on a monitor of ``kind`` (``"cpu"`` or ``"gpu"``), and where.

    * ``cpu``: each rank's CPU time per second of wall time, its DataLoader
      workers included (100 = one core). The template's own run is CPU-bound:
      a rank that computes runs whenever a core is free, so it uses most of a
      core on a quiet machine and about 66 % with one CPU-bound job beside it
      (two ranks and one job share two cores), while a rank that waits in a
      collective, or sits idle, uses a few %. ``min_busy`` = 40 % sits between
      the two: "busy" means computing most of the time, and it holds with one
      CPU-bound job beside the run (66 / 40: a margin of 1.6). On a machine
      busier than that no process gets 40 % of a core: :func:`cpu_busy_floor`
      lowers the level to what the machine's load leaves a computing rank.
    * ``gpu``: NVML's utilization, the share of time *a kernel was running*
      on the GPU. The template's synthetic images are generated on the CPU
      (~0.5 ms a sample) while the small CNN's step is under a millisecond of
      GPU work, so the template leaves a GPU mostly idle; the check runs on
      ``scripts/demos/imbalance.py``'s balanced run instead, whose batches are
      generated on the GPU and whose model (resnet18, batch 256) keeps it busy.

    ``balance``: the largest allowed ``(max − min) / max`` of the ranks' means.
    """
    if kind == "cpu":
        return {"run": "template", "unit": "% of one core", "min_busy": 40.0, "balance": 0.35}
    if kind == "gpu":
        return {"run": "balanced demo", "unit": "% kernel-busy (NVML)", "min_busy": 50.0,
                "balance": 0.25}  # fmt: skip
    raise ValueError(f"kind must be 'cpu' or 'gpu', got {kind!r}")


def cpu_busy_floor(min_busy: float, cores: int, load: float) -> float:
    """The CPU level (% of one core) that a computing rank reaches on a machine under ``load``.

    ``load`` is the load average: the processes running or waiting for a core
    (``os.getloadavg()``, which counts the ranks themselves). A computing rank
    is always among them, so it gets about ``100 × cores / load`` % of a core
    when ``load`` exceeds ``cores``, and a whole core otherwise: its fair
    share. The floor is 45 % of that share, and never above ``min_busy``: on a
    quiet machine it is ``min_busy`` itself; with one CPU-bound job beside two
    ranks on two cores (load ≈ 3, share 66 %), 30 %; at a load of 10 on 2
    cores, 9 %. Not more: the load average trails the load (a minute's mean),
    and under ``make test`` a rank measured 22.9 % of a core where the load read
    5.0 on 2 cores (share 40 %). A rank that waits in a collective uses a few %
    whatever the load, so it stays below the floor until the machine is loaded
    about 15 times over.
    """
    if cores < 1 or load < 0:
        raise ValueError(f"need cores >= 1 and load >= 0, got {cores}, {load}")
    share = 100.0 * cores / max(load, cores)
    return min(min_busy, 0.45 * share)


GPU_SECONDS = 8.0  # each GPU run of the demo: 32 of the lesson's samples (0.25 s apart)


def imbalance_workload(kind: str) -> list[str]:
    """``scripts/demos/imbalance.py`` sizes that keep a device of ``kind`` busy for seconds.

    On a CPU the defaults (a small CNN on 16-pixel images, 30 steps) already
    take every core the rank has. A GPU does that in milliseconds: resnet18 on
    64-pixel batches of 256 generated on the GPU, for at least 100 steps and at
    least :data:`GPU_SECONDS` (a Hopper GPU does 100 steps in about a second: 4-6
    NVML samples, too few to judge against ``min_busy``; the demo times its
    first steps and raises its step count to fill the seconds).
    """
    if kind == "cpu":
        return []
    if kind == "gpu":
        return ["--model", "resnet18", "--image-size", "64", "--batch-size", "256",
                "--eval-batch", "1024", "--steps", "100",
                "--seconds", str(GPU_SECONDS)]  # fmt: skip
    raise ValueError(f"kind must be 'cpu' or 'gpu', got {kind!r}")


def step_breakdown(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per rank, mean ms per step of: extra work, DDP forward+backward (incl. waiting), step.

    For records holding per-step lists ``eval``, ``forward``, ``backward`` and
    ``step`` (seconds), as ``scripts/demos/imbalance.py`` writes them. A rank whose
    DDP time exceeds its peers' by roughly another rank's extra work spent that
    time waiting inside a collective.
    """
    rows = []
    for r in records:
        n = len(r["step"])
        rows.append(
            {
                "rank": r["rank"],
                "extra ms": 1000 * sum(r["eval"]) / n,
                "ddp ms": 1000 * (sum(r["forward"]) + sum(r["backward"])) / n,
                "step ms": 1000 * sum(r["step"]) / n,
            }
        )
    return rows


def output_of_each_rank(*flags: str) -> dict[int, tuple[str, bool]]:
    """Lesson 06: for `torchrun <flags> --nproc-per-node 2 train.py`, where each local rank's
    stderr goes (a file, /dev/null or "" for the console) and whether it also reaches the
    console, as torchrun's own LogsSpecs decides it (built as torch/distributed/run.py does)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args([*flags, "--nproc-per-node", "2", "train.py"])
    specs = DefaultLogsSpecs(
        log_dir=args.log_dir,
        redirects=Std.from_str(args.redirects),
        tee=Std.from_str(args.tee),
        local_ranks_filter={int(r) for r in args.local_ranks_filter.split(",")},
    )
    dest = specs.reify({rank: {"TORCHELASTIC_RUN_ID": "demo"} for rank in range(2)})
    return {r: (dest.stderrs[r], dest.stderrs[r] == "" or r in dest.tee_stderrs) for r in range(2)}
