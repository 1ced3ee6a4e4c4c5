"""Code a lesson shows in its prose is the code that runs.

A notebook opened without outputs (a first look in JupyterLab, a repository browser) shows no
``Code(...)`` display, so a lesson puts the lines it teaches in its markdown too, tagged with
where they come from; this test keeps every tagged block equal to its source:

    <!-- same as: scripts/demos/collectives.py broadcast -->      a function or class
    <!-- same as: scripts/single_process.py -->                   the code after the docstring
    <!-- same as: diff scripts/single_process.py scripts/minimal_ddp.py -->   lesson 00's diff
    <!-- same as: scripts/train.py section 5 -->                 lesson 06: a numbered step
    <!-- same as: scripts/ddp_kit.py from "def _handle(" to "signum" -->   lines, first to last
    <!-- same as: lesson 09 launch unused -->                     a launch of lesson 09, as typed
"""

from __future__ import annotations

import ast
import json
import re

import pytest

from conftest import REPO
from ddp_tutorial.lessons.debugging import lab_cases, typed_command
from ddp_tutorial.lessons.faults import excerpt
from ddp_tutorial.lessons.first_steps import code_after_docstring, code_diff
from ddp_tutorial.lessons.utilization import template_sections

TAG = re.compile(r"<!-- same as: (.+?) -->\n```[a-z]*\n(.*?)\n```", re.S)
EXCERPT = re.compile(r'(?P<path>\S+) from "(?P<first>.+)" to "(?P<last>.+)"')
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def tagged_blocks() -> list[tuple[str, str, str]]:
    """(notebook, what the tag names, the block's text) for every tagged block."""
    found = []
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                for what, text in TAG.findall("".join(cell["source"])):
                    found.append((path.name, what, text))
    return found


def source_of(what: str) -> str:
    if m := EXCERPT.fullmatch(what):  # a few lines of a file, from one text to another
        return excerpt((REPO / m["path"]).read_text(), m["first"], m["last"])
    words = what.split()
    if words[:3] == ["lesson", "09", "launch"]:  # a launch of the debugging lab, as typed
        return lab_command(words[3])
    if words[0] == "diff":
        return code_diff(REPO / words[1], REPO / words[2]).rstrip("\n")
    path = REPO / words[0]
    if len(words) == 3 and words[1] == "section":  # lesson 06: the template's numbered steps
        sections = template_sections(path.read_text())
        return next(s.code for s in sections if s.number == int(words[2]))
    if len(words) == 1:
        return code_after_docstring(path).strip("\n")
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == words[1]:
            return ast.get_source_segment(text, node)
    raise LookupError(f"{words[0]} defines no {words[1]}")


def lab_command(name: str) -> str:
    """Lesson 09's launch ``name`` with the lesson's default parameters (its parameters cell);
    29500 stands for the port another job holds."""
    cells = json.loads((REPO / "notebooks" / "09_debugging.ipynb").read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    values: dict[str, object] = {}
    exec("".join(tagged[0]["source"]), values)
    demos = "../scripts/demos"
    cases = lab_cases(values["HANG_TIMEOUT_S"], values["LAUNCH_TIMEOUT_S"], demos, 2, 29500)
    return typed_command(cases[name], demos)


BLOCKS = tagged_blocks()


@pytest.mark.parametrize("notebook, what, text", BLOCKS, ids=[f"{n}:{w}" for n, w, _ in BLOCKS])
def test_tagged_code_in_the_prose_is_the_code_that_runs(notebook, what, text):
    assert text == source_of(what), f"{notebook}: the block tagged '{what}' differs from the file"


def test_the_tag_finds_blocks():
    assert any(n.startswith("01_") for n, _, _ in BLOCKS), "lesson 01 shows its collectives"


def test_lesson_06_shows_every_numbered_step_of_the_template():
    """Without outputs, lesson 06's walk through the template read as ten empty cells (a
    learner review): each numbered section now stands in the prose, tagged and kept equal."""
    shown = {what for n, what, _ in BLOCKS if n.startswith("06_")}
    numbers = {s.number for s in template_sections((REPO / "scripts" / "train.py").read_text())}
    assert {f"scripts/train.py section {n}" for n in numbers} <= shown
    assert "scripts/train.py data_loader" in shown, "section 6's function"
