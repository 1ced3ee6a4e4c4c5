"""Every lesson notebook executes top to bottom with ddp_tutorial.harness.course, within budget.

New notebooks are picked up automatically. Notebooks in git carry no outputs
and exactly one `parameters` cell.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO
from ddp_tutorial.harness.hosted import SETUP_CELL, SETUP_TAG

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
BUDGET_S = 120  # per notebook on the 2-core CI machine (DESIGN.md)
# Per cell: above every launch timeout of a lesson, so that a launch that hangs is killed
# by its own timeout (torchrun and every rank) and says so, before nbclient kills the kernel.
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    assert NOTEBOOKS, "no lesson notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    dirty = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{path.name}: code cells {dirty} carry outputs (run `ddp-tutorial strip`)"
    tagged = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    assert nb["cells"][0]["cell_type"] == "markdown", "a lesson starts with prose"
    if nb.get("nbformat_minor", 0) >= 5:  # cell ids: a hard error in future nbformat versions
        assert all("id" in cell for cell in nb["cells"]), f"{path.name}: a cell without an id"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_lesson_starts_its_code_with_the_setup_cell(path):
    """Kaggle and Colab open a lesson with no course installed: its first code cell installs it
    (``ddp_tutorial.harness.hosted``; tests/test_hosted.py runs each branch)."""
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert SETUP_TAG in code[0]["metadata"].get("tags", []), f"{path.name}: no setup cell first"
    assert "".join(code[0]["source"]) == SETUP_CELL, f"{path.name}: an old copy of the setup cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_lesson_opens_with_its_card_and_ends_with_what_to_remember(path):
    """DESIGN.md "How a lesson reads": a title and one-line summary (the course map reads
    them), the card (what you will learn, what you need), and at the end what to remember,
    as a few points and the snippet to copy, then where to go next."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]
    first, last = ("".join(c["source"]) for c in (cells[0], cells[-1]))
    title, summary, *card = first.splitlines()
    assert re.fullmatch(rf"# {path.name[:2]} · \S.*", title), f"{path.name}: title {title!r}"
    assert summary.strip(), f"{path.name}: the one-sentence summary on line 2"
    learn = [line for line in card if line.startswith("**You will learn:**")]
    need = [line for line in card if line.startswith("**You need:**")]
    assert len(learn) == len(need) == 1, f"{path.name}: the card's two lines"
    assert last.startswith("## What to remember\n"), f"{path.name}: ends with What to remember"
    points = re.findall(r"(?m)^\* ", last)
    assert 3 <= len(points) <= 6, f"{path.name}: {len(points)} points to remember"
    assert "```python" in last or "```bash" in last, f"{path.name}: no snippet to copy"
    assert re.search(r"(?m)^(\*\*)?Next:", last), f"{path.name}: no Next line"


def timeout_parameters(nb: dict) -> dict[str, float]:
    """``{name: seconds}``: the numbers a lesson's parameters cell gives names with TIMEOUT."""
    import ast

    (cell,) = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    found = {}
    for node in ast.walk(ast.parse("".join(cell["source"]))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and "TIMEOUT" in target.id:
                    found[target.id] = float(node.value.value)
    return found


def test_every_launch_timeout_is_below_the_cell_timeout():
    timeouts = {p.name: timeout_parameters(json.loads(p.read_text())) for p in NOTEBOOKS}
    assert sum(bool(found) for found in timeouts.values()) >= len(NOTEBOOKS) - 2, timeouts
    too_long = {n: f for n, f in timeouts.items() if any(t >= CELL_TIMEOUT_S for t in f.values())}
    assert not too_long, f"launch timeouts >= the cell timeout ({CELL_TIMEOUT_S} s): {too_long}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    pytest.importorskip("nbclient")
    from ddp_tutorial.harness.course import run_notebook

    result = run_notebook(path, output_dir=tmp_path, timeout=CELL_TIMEOUT_S, html=False)
    assert result.ok, f"{path.name} failed in cell {result.failed_cell}:\n{result.error[-4000:]}"
    assert result.seconds < BUDGET_S, f"{path.name} took {result.seconds:.0f}s > {BUDGET_S}s"
