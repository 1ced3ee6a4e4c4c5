"""The first code cell of every lesson: a no-op where the course is installed, an install
in a hosted notebook (Kaggle, Colab) opened from a clone of the repository.

The cell cannot import this package (that is what it installs), so its text lives
here as :data:`SETUP_CELL`, and :func:`add_setup_cell` puts the same text in every
lesson; a test checks that every lesson carries it unchanged. In a hosted notebook
it keeps the torch and torchvision that are there (a constraints file pins them)
and installs the course without its Jupyter stack (the service has its own): the
runtime dependencies it lists, then the package itself without dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUNTIME_DEPENDENCIES = ("numpy", "matplotlib", "nvidia-ml-py", "psutil", "tqdm", "py-spy")
"""pyproject's dependencies minus torch/torchvision (kept) and the notebook stack (the host's)."""

SETUP_TAG = "setup"

SETUP_CELL = """# Setup, for hosted notebooks (Kaggle, Colab): where the course is installed
# (make lab, make run) this does nothing. Opened from a clone of the repository elsewhere,
# it installs the course beside the torch already there, for this kernel and its ranks.
import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

if importlib.util.find_spec("ddp_tutorial") is None:
    repo = pathlib.Path.cwd().parent
    if not (repo / "ddp_tutorial" / "__init__.py").is_file():
        raise SystemExit(
            "This lesson needs the course's repository around it. First, in a terminal or a "
            "cell starting with '!':\\n  git clone <the repository's URL> ddp-tutorial\\n"
            "then open ddp-tutorial/notebooks/ and this lesson from there (in Kaggle or "
            "Colab: a cell with %cd ddp-tutorial/notebooks, then run this cell again)."
        )
    keep = [f"{name}=={importlib.metadata.version(name)}" for name in ("torch", "torchvision")
            if importlib.util.find_spec(name)]  # fmt: skip
    pins = pathlib.Path(tempfile.mkdtemp()) / "keep-torch.txt"
    pins.write_text("\\n".join(keep) + "\\n")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(pins)]
    runtime = ["numpy", "matplotlib", "nvidia-ml-py", "psutil", "tqdm", "py-spy"]  # no Jupyter
    subprocess.check_call([*pip, *runtime])
    subprocess.check_call([*pip, "--no-deps", "-e", str(repo)])
    sys.path.insert(0, str(repo))  # this kernel; new processes see the editable install
    print(f"installed the course from {repo}, keeping {keep or 'no torch'}")"""


SETUP_METADATA = {"tags": [SETUP_TAG], "jupyter": {"source_hidden": True}}
"""The setup cell is plumbing: JupyterLab shows it collapsed, and the HTML leaves it out."""


def setup_cell_index(nb: Any) -> int | None:
    """Index of the lesson's setup cell (tagged ``setup``), if it has one."""
    return next(
        (i for i, c in enumerate(nb.cells) if SETUP_TAG in c.get("metadata", {}).get("tags", [])),
        None,
    )


def add_setup_cell(path: str | Path) -> bool:
    """Put :data:`SETUP_CELL` first among the code cells of ``path`` (after the card).

    Replaces an older copy; returns True when the file changed.
    """
    import nbformat  # not at import time: a GPU box for gpu-check has no Jupyter

    nb = nbformat.read(path, as_version=4)
    index = setup_cell_index(nb)
    if index is not None:
        cell = nb.cells[index]
        if cell.source == SETUP_CELL and cell.metadata == SETUP_METADATA:
            return False
        cell.source, cell.metadata = SETUP_CELL, nbformat.from_dict(SETUP_METADATA)
    else:
        first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        cell = nbformat.v4.new_code_cell(SETUP_CELL, metadata=SETUP_METADATA)
        nb.cells.insert(first_code, cell)
    nbformat.write(nb, path)
    return True
