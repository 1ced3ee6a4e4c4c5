"""Lesson 02 reads without running: the code it teaches stands in its markdown, equal to the files.

The lesson shows the evaluation code of ``scripts/demos/sampling.py`` (the script its launch
runs; a cell asserts every rank ran those lines) and the F1 of ``ddp_tutorial/lessons/sampling.py``
as fenced blocks in its markdown, so that a notebook with no outputs (a first open, a
repository browser) still shows them. Here, without a kernel: each block is the files' text.
"""

from __future__ import annotations

import ast
import json
import re

from conftest import REPO
from ddp_tutorial.lessons.sampling import function_source

NOTEBOOK = REPO / "notebooks" / "02_data_sampling.ipynb"
SOURCES = (
    REPO / "scripts" / "demos" / "sampling.py",
    REPO / "ddp_tutorial" / "lessons" / "sampling.py",
    REPO / "scripts" / "demos" / "rank0_first.py",  # the rank-0-first section's two fixes
)
TAUGHT = {"validation_shard", "evaluate_sums", "gather_predictions", "macro_f1"}


def markdown_blocks() -> list[str]:
    """Every fenced python block of the lesson's markdown cells that defines a function."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    blocks = [b for t in text for b in re.findall(r"```python\n(.*?)```", t, re.S)]
    return [b for b in blocks if re.search(r"(?m)^def ", b)]


def expected(block: str) -> str:
    """The same functions, read from whichever file defines each, in the block's order."""
    names = [n.name for n in ast.parse(block).body if isinstance(n, ast.FunctionDef)]
    parts = []
    for name in names:
        (path,) = [p for p in SOURCES if re.search(rf"(?m)^def {name}\(", p.read_text())]
        parts.append(function_source(path, name))
    return "\n\n".join(parts)


def test_the_taught_functions_stand_in_the_markdown():
    shown = {n.name for b in markdown_blocks() for n in ast.parse(b).body
             if isinstance(n, ast.FunctionDef)}  # fmt: skip
    assert TAUGHT <= shown, f"not in the lesson's markdown: {TAUGHT - shown}"


def test_each_block_is_the_files_text():
    for block in markdown_blocks():
        assert block == expected(block), "a markdown block differs from its file: copy it again"


def test_no_cell_displays_code_that_the_markdown_lacks():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    shown = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and "Code(" in "".join(c["source"])
    ]
    assert not shown, f"cells {shown} display code with Code(...): put the lines in the markdown"


def test_function_source_is_what_inspect_reads(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n\n\n@staticmethod\ndef a(x):\n    return x\n\n\ndef b():\n    pass\n"
    )
    assert (
        function_source(path, "b", "a")
        == "def b():\n    pass\n\n\n@staticmethod\ndef a(x):\n    return x\n"
    )


def test_the_minimal_scripts_sampler_lines_stand_in_the_markdown():
    """The lesson's first cell prints these lines from scripts/minimal_ddp.py (and asserts
    them); its markdown shows the same lines, for a reader without outputs."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    (intro,) = [t for t in text if t.startswith("## The sampler line of the minimal script")]
    (block,) = re.findall(r"```python\n(.*?)```", intro, re.S)
    minimal = (REPO / "scripts" / "minimal_ddp.py").read_text().splitlines()
    printed = [s.strip() for s in minimal if "sampler" in s and not s.startswith("from")]
    assert block.splitlines() == printed, "the markdown's sampler lines differ from the script's"
