"""Shared fixtures: paths, the GPU skip, a guard against leaked processes and unmarked launches."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def gpu_count() -> int:
    """Visible GPUs via NVML (no CUDA initialised in the test process)."""
    from ddp_tutorial.devices import visible_gpu_count

    return visible_gpu_count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible via NVML)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def processes_running(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(autouse=True)
def _only_marked_tests_launch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A test that starts torchrun must say so (``@pytest.mark.torchrun``).

    ``make test-fast`` leaves those out; this keeps the marker honest, so the
    edit loop never pays for a launch it did not ask for.
    """
    if any(request.node.get_closest_marker(m) for m in ("torchrun", "notebook", "gpu")):
        return
    from ddp_tutorial.harness import processes

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts torchrun: mark it @pytest.mark.torchrun"
        )

    monkeypatch.setattr(processes, "spawn", refuse)


@pytest.fixture
def write_script(tmp_path: Path):
    """Write a small script into tmp_path and return its path."""

    def write(name: str, body: str) -> Path:
        path = tmp_path / name
        path.write_text(body)
        return path

    return write


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
