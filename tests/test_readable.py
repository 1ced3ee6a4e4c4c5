"""Code a lesson shows in its prose is the code that runs.

A notebook opened without outputs (a first look in JupyterLab, a repository browser) shows no
``Code(...)`` display, so a lesson puts the lines it teaches in its markdown too, tagged with
where they come from; this test keeps every tagged block equal to its source:

    <!-- same as: scripts/demos/collectives.py broadcast -->      a function or class
    <!-- same as: scripts/single_process.py -->                   the code after the docstring
    <!-- same as: diff scripts/single_process.py scripts/minimal_ddp.py -->   lesson 00's diff
"""

from __future__ import annotations

import ast
import json
import re

import pytest

from conftest import REPO
from ddp_tutorial.lessons.first_steps import code_after_docstring, code_diff

TAG = re.compile(r"<!-- same as: (.+?) -->\n```[a-z]*\n(.*?)\n```", re.S)
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
    words = what.split()
    if words[0] == "diff":
        return code_diff(REPO / words[1], REPO / words[2]).rstrip("\n")
    path = REPO / words[0]
    if len(words) == 1:
        return code_after_docstring(path).strip("\n")
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == words[1]:
            return ast.get_source_segment(text, node)
    raise LookupError(f"{words[0]} defines no {words[1]}")


BLOCKS = tagged_blocks()


@pytest.mark.parametrize("notebook, what, text", BLOCKS, ids=[f"{n}:{w}" for n, w, _ in BLOCKS])
def test_tagged_code_in_the_prose_is_the_code_that_runs(notebook, what, text):
    assert text == source_of(what), f"{notebook}: the block tagged '{what}' differs from the file"


def test_the_tag_finds_blocks():
    assert any(n.startswith("01_") for n, _, _ in BLOCKS), "lesson 01 shows its collectives"
