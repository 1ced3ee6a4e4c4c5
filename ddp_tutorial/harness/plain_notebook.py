"""Run a lesson's code cells without Jupyter: for GPU machines that have none.

A stored notebook is plain JSON, and a lesson's cells are plain Python (no
magics, no ``display``; figures are returned, not shown). So the code cells
can run top to bottom in one namespace, in a fresh interpreter, from the
``notebooks/`` folder as Jupyter would — which is all ``make gpu-check``
needs to execute a lesson's GPU branch on a machine with torch but no
nbclient. The full course (outputs, HTML) still needs ``ddp-tutorial course``.

    python -m ddp_tutorial.harness.plain_notebook notebooks/03_device_mapping.ipynb
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def code_cells(path: Path, parameters: Mapping[str, Any] | None = None) -> list[str]:
    """The sources of ``path``'s code cells, with ``parameters`` set after the tagged cell."""
    cells = json.loads(path.read_text())["cells"]
    sources = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        sources.append("".join(cell["source"]))
        if parameters and "parameters" in cell.get("metadata", {}).get("tags", []):
            sources.append("\n".join(f"{k} = {v!r}" for k, v in parameters.items()))
    return sources


def run(path: Path, parameters: Mapping[str, Any] | None = None) -> tuple[int | None, str]:
    """Execute the code cells in order; ``(index of the failing cell or None, its traceback)``."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    sources = code_cells(path, parameters)
    previous, backend = Path.cwd(), os.environ.get("MPLBACKEND")
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display here
    os.chdir(path.resolve().parent)  # relative paths such as ../scripts/x.py, as in Jupyter
    try:
        for index, source in enumerate(sources):
            try:
                exec(compile(source, f"{path.name}[cell {index}]", "exec"), namespace)
            except BaseException:  # an assert, an error, an interrupt: report, stop
                return index, traceback.format_exc()
    finally:
        os.chdir(previous)
        if backend is None:
            os.environ.pop("MPLBACKEND", None)
    return None, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    args = parser.parse_args(argv)
    began = time.monotonic()
    failed, error = run(args.notebook)
    seconds = time.monotonic() - began
    if failed is not None:
        print(f"{args.notebook.name}: FAILED in code cell {failed}\n{error}", file=sys.stderr)
        return 1
    print(f"{args.notebook.name}: ok in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
