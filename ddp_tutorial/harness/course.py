"""Execute the lesson notebooks with nbclient — the one implementation.

``make run``, ``ddp-tutorial course`` and the notebook tests all call
:func:`run_notebook`, so a notebook that passes the tests is exactly the one
a learner runs. The kernel is this interpreter (whatever ``python3`` kernel a
user has registered elsewhere is ignored), the working directory is the
notebook's folder (so ``../scripts/…`` resolves), and the first failing cell is
reported with its error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from ddp_tutorial import settings

REPO_ROOT = Path(__file__).resolve().parents[2]  # ddp_tutorial/harness/course.py
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
DEFAULT_TIMEOUT_S = 300.0


class _ThisInterpreter(KernelSpecManager):
    """Every kernel name resolves to an ipykernel on ``sys.executable``."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name=f"Python ({sys.executable})",
            language="python",
            resource_dir=str(NOTEBOOK_DIR),
        )


@dataclass
class NotebookResult:
    """How one notebook's execution went."""

    path: Path
    seconds: float
    ok: bool
    error: str = ""  # the failing cell's source and the error, when not ok
    failed_cell: int | None = None  # index of the failing cell
    executed_path: Path | None = None
    html_path: Path | None = None

    @property
    def status(self) -> str:
        return "ok" if self.ok else "FAILED"


def notebooks(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """The lesson notebooks in course order (``00_…``, ``01_…``)."""
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))


def inject_parameters(nb: nbformat.NotebookNode, parameters: Mapping[str, Any]) -> None:
    """Insert a cell after the ``parameters``-tagged one that overrides its values.

    Papermill's convention, without papermill: the learner's defaults stay
    visible, the override is a separate cell tagged ``injected-parameters``.
    """
    if not parameters:
        return
    index = next(
        (
            i
            for i, cell in enumerate(nb.cells)
            if "parameters" in cell.get("metadata", {}).get("tags", [])
        ),
        None,
    )
    if index is None:
        raise ValueError("notebook has no cell tagged 'parameters' to override")
    source = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)


def _failing_cell(nb: nbformat.NotebookNode) -> int | None:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return i
    return None


SOCKET_PATH_MAX = 100  # bytes in a Unix socket's path: 107 on Linux, 103 on macOS


def local_kernel(sockets: Path) -> KernelManager:
    """A kernel on this interpreter that talks over Unix sockets in ``sockets`` (a private
    folder): nothing listens on a TCP port, and ipykernel (>= 7.4) has no plain-text TCP to
    warn about at every lesson of `make run`. Under a deep TMPDIR (a socket path too long:
    zmq fails and nbclient then waits forever) it stays on TCP."""
    if len(os.fsencode(sockets / "kernel-99")) > SOCKET_PATH_MAX:
        return KernelManager(kernel_spec_manager=_ThisInterpreter())
    return KernelManager(
        kernel_spec_manager=_ThisInterpreter(), transport="ipc", ip=str(sockets / "kernel")
    )


def stop_kernel(km: KernelManager) -> None:
    """End the kernel and every process it started (torchrun trees a timed-out cell left).

    nbclient leaves a kernel it was handed alive after ``execute()``, and a cell
    killed by its timeout leaves its launches running in sessions of their own:
    kill the kernel's descendants first, then the kernel.
    """
    from ddp_tutorial.harness.processes import kill_tree, tree_root

    # the kernel's Popen, if it was not reaped yet: after that, its pid may be anyone's
    popen = getattr(getattr(km, "provisioner", None), "process", None)
    kernel = tree_root(popen) if popen is not None and popen.poll() is None else None
    try:
        children = kernel.children() if kernel else []
    except psutil.NoSuchProcess:
        kernel, children = None, []
    for child in children:
        kill_tree(child, grace_s=2.0)
    try:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    except Exception:  # noqa: BLE001 - already gone: nothing left to stop
        pass
    if kernel:
        kill_tree(kernel, grace_s=2.0)


@contextlib.contextmanager
def _callers_sigint() -> Iterator[None]:
    """The caller's Ctrl-C stays as it was: a run under pytest-xdist's workers was seen to
    come back with SIGINT's handler changed by the Jupyter client machinery."""
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if saved is not None:
            signal.signal(signal.SIGINT, saved)


def run_notebook(
    path: str | Path,
    output_dir: str | Path | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    parameters: Mapping[str, Any] | None = None,
    html: bool = True,
    runs_dir: str | Path | None = None,
) -> NotebookResult:
    """Execute one notebook top to bottom; never raises for a failing cell.

    ``timeout`` bounds each cell. With ``output_dir`` the executed notebook
    (and, with ``html``, an HTML copy) is written there, failed or not, so
    the error can be read in context. The lesson's launches write their run
    directories under ``runs_dir`` (default: ``<output_dir>/runs/<notebook>``,
    or a temporary folder removed afterwards), never into ``notebooks/``.
    """
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, parameters or {})
    sockets = Path(tempfile.mkdtemp(prefix="ddp-tutorial-kernel-"))
    km = local_kernel(sockets)
    client = NotebookClient(
        nb,
        km=km,
        timeout=int(timeout),
        resources={"metadata": {"path": str(path.parent)}},
    )
    scratch = None
    if runs_dir is None and output_dir is not None:
        runs_dir = Path(output_dir) / "runs" / path.stem
    elif runs_dir is None:
        runs_dir = scratch = Path(tempfile.mkdtemp(prefix=f"{path.stem}-runs-"))
    env = {**os.environ, settings.RUNS_ENV: str(Path(runs_dir).resolve())}
    start = time.monotonic()
    ok, error = True, ""
    try:
        with _callers_sigint():
            client.execute(env=env)
    except CellExecutionError as exc:
        ok, error = False, str(exc)
    except (CellTimeoutError, DeadKernelError, TimeoutError, RuntimeError) as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"
    finally:
        stop_kernel(km)  # with every launch a cell left running: nothing outlives the lesson
        shutil.rmtree(sockets, ignore_errors=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - start
    result = NotebookResult(path, seconds, ok, error, None if ok else _failing_cell(nb))
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        result.executed_path = out / path.name
        nbformat.write(nb, result.executed_path)
        if html:
            body = notebook_html(nb)
            result.html_path = out / f"{path.stem}.html"
            result.html_path.write_text(body, encoding="utf-8")
    return result


def notebook_html(nb: Any) -> str:
    """The executed lesson as one HTML page, without the setup cell (plumbing, not the lesson)."""
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    from ddp_tutorial.harness.hosted import SETUP_TAG

    exporter = HTMLExporter()
    exporter.register_preprocessor(TagRemovePreprocessor(remove_cell_tags={SETUP_TAG}), True)
    return exporter.from_notebook_node(nb)[0]


def inline_markdown(text: str) -> str:
    """One line of a lesson's markdown as inline HTML (backticks become code, not raw ticks)."""
    import mistune

    return mistune.html(text).strip().removeprefix("<p>").removesuffix("</p>")


def run_course(
    paths: Iterable[Path] | None = None,
    output_dir: str | Path | None = REPO_ROOT / "build",
    timeout: float = DEFAULT_TIMEOUT_S,
    echo: bool = True,
) -> list[NotebookResult]:
    """Execute notebooks in order; print a line as each one finishes."""
    results = []
    for path in paths if paths is not None else notebooks():
        if echo:
            print(f"running {Path(path).name} ...", flush=True)
        result = run_notebook(path, output_dir=output_dir, timeout=timeout)
        results.append(result)
        if echo and not result.ok:
            print(result.error[-3000:], flush=True)
    return results


def write_index(results: Iterable[NotebookResult], output_dir: str | Path) -> Path:
    """``output_dir/index.html``: every executed lesson with its title, status, time and a link.

    The executed course can then be read without running it — opened from disk or
    published as a static site (the HTML of each lesson sits beside it).
    """
    import html

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in results:
        meta = lesson_info(r.path)
        page_of = r.html_path or r.executed_path
        link = page_of.name if page_of else ""
        title = html.escape(meta["title"])
        name = f'<a href="{html.escape(link)}">{title}</a>' if link else title
        cell = f" (cell {r.failed_cell})" if r.failed_cell is not None else ""
        rows.append(
            f"<tr><td>{name}</td><td>{inline_markdown(meta['summary'])}</td>"
            f'<td class="{r.status.lower()}">{r.status}{cell}</td><td>{r.seconds:.1f} s</td></tr>'
        )
    total = sum(r.seconds for r in results)
    ok = sum(r.ok for r in results)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ddp-tutorial: the executed course</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
td,th{{padding:.3em .6em;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}}
.ok{{color:#080}}.failed{{color:#c00;font-weight:bold}}</style></head><body>
<h1>ddp-tutorial: the executed course</h1>
<p>Every lesson below was executed top to bottom by <code>make run</code>; each claim in it is
an <code>assert</code> that held on this run. {ok}/{len(rows)} lessons ok, {total:.0f} s in all,
{html.escape(time.strftime("%Y-%m-%d %H:%M"))}.</p>
<table><tr><th>lesson</th><th>what it teaches</th><th>status</th><th>time</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def results_table(results: Iterable[NotebookResult]) -> str:
    """``notebook | seconds | status`` as a plain-text table."""
    results = list(results)
    width = max([len("notebook")] + [len(r.path.name) for r in results])
    lines = [f"{'notebook':<{width}}  {'seconds':>8}  status", "-" * (width + 18)]
    for r in results:
        cell = f" (cell {r.failed_cell})" if r.failed_cell is not None else ""
        lines.append(f"{r.path.name:<{width}}  {r.seconds:8.1f}  {r.status}{cell}")
    total = sum(r.seconds for r in results)
    lines.append(
        f"{'total':<{width}}  {total:8.1f}  {sum(r.ok for r in results)}/{len(results)} ok"
    )
    return "\n".join(lines)


def strip_outputs(path: str | Path) -> bool:
    """Remove outputs and execution counts in place; True when the file changed."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count = [], None
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


def lesson_info(path: Path) -> dict[str, str]:
    """``{notebook, title, summary}`` from a notebook's first markdown cell (title, first line)."""
    nb = nbformat.read(path, as_version=4)
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    lines = [line.strip() for line in first.splitlines() if line.strip()]
    title = lines[0].lstrip("# ").strip() if lines else path.stem
    summary = next((line for line in lines[1:] if not line.startswith("#")), "")
    return {"notebook": path.name, "title": title, "summary": summary}


def lesson_map(directory: Path = NOTEBOOK_DIR) -> list[dict[str, str]]:
    """``[{notebook, title, summary}]`` read from each notebook's first markdown cell.

    The map is built from the notebooks themselves, so it cannot drift from
    what is actually in the course.
    """
    return [lesson_info(path) for path in notebooks(directory)]
