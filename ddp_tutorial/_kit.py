"""The template's sidecar, ``scripts/ddp_kit.py``, as a module of this package.

The helpers a copy of ``scripts/train.py`` needs live in that one torch-only file, so
that a user copies two files and needs nothing of this repository. The package's
modules re-export them for the lessons and tests from here: one copy of each helper.
The file is loaded under its own name, ``ddp_kit``, so that ``train.py`` (which imports
it by that name) and the package share one module: the same classes, the same errors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "ddp_kit"
PATH = Path(__file__).resolve().parents[1] / "scripts" / f"{NAME}.py"


def _load() -> ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"the template's sidecar {PATH} is missing: the course runs from a "
                          f"checkout of its repository")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # before running it: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


kit = _load()
