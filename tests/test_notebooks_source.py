"""What every lesson's code must say, read from the notebooks' source (no kernel).

A lesson's kernel must never touch CUDA (lesson 00's rule): a ``torch.load``
without ``map_location`` restores each tensor onto the device it was saved
from, so a file a rank saved from ``cuda:0`` would open a CUDA context on GPU 0
in the kernel. On this CPU machine nothing shows it at run
time; the source does.
"""

from __future__ import annotations

import ast
import re

import pytest

from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def code_cells(path):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            # IPython magics are not Python: drop them before parsing
            yield index, re.sub(r"(?m)^\s*[%!].*$", "", cell.source)


def torch_loads(source: str) -> list[ast.Call]:
    """Every call spelled ``torch.load(...)`` in ``source``."""
    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    ]


def test_the_finder_sees_a_load_with_and_without_map_location():
    calls = torch_loads(
        'a = torch.load(p, weights_only=True)\nb = torch.load(p, map_location="cpu")'
    )
    assert [any(k.arg == "map_location" for k in c.keywords) for c in calls] == [False, True]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_torch_load_in_a_lesson_says_where_the_tensors_go(path):
    missing = [
        f"cell {index}, line {call.lineno}"
        for index, source in code_cells(path)
        for call in torch_loads(source)
        if not any(keyword.arg == "map_location" for keyword in call.keywords)
    ]
    assert not missing, f"{path.name}: torch.load without map_location at {missing}"
