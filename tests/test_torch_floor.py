"""The course runs on the oldest torch it lets users install, and the template on its own.

Only one torch is installed here, the newest, so a call that newer releases added passes
every other test and fails on a user's older torch (``nn.utils.get_total_norm``, torch 2.6,
once stopped ``train.py`` on 2.4 at its first evaluation; ``dist.set_timeout``, torch 2.14,
every exercise check before 2.14). Two lists hold every torch and torchvision name the code
calls and each keyword it passes (where torch's signature names its keywords: not those of
builtins like ``torch.tensor`` or of a ``**kwargs``), as checked to exist in a floor release:
``torch_floor.txt`` for the whole course (scripts, package, notebooks; the floor is
pyproject.toml's ``torch>=``) and ``torch_floor_template.txt`` for the files a user copies
(the ladder, ``train.py`` and its sidecar; the floor ``train.py``'s docstring states). A name
missing from its list fails here; to add it, record the list again under that release:

    python -m venv /tmp/floor && /tmp/floor/bin/pip install torch==2.10.0 torchvision==0.25.0 \
        numpy tqdm tensorboard
    /tmp/floor/bin/python tests/test_torch_floor.py --record template   # or: course

(``make floor-check`` builds such a venv for the template, checks its names there and runs
``tests/test_template_copy.py`` on that torch.)

which refuses (and names) whatever that release lacks. What it cannot see: methods of
objects (``ddp.register_comm_hook``), names reached through ``getattr`` or a local variable,
keywords passed as ``**options`` or through ``partial``, torchrun's flags (train.sbatch's
need 2.12: its header says so), and behaviour that changed under the same name: the closing
notes say which launches ran under which floor.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("torch", "torchvision")
TEMPLATE = ("single_process.py", "minimal_ddp.py", "resumable_ddp.py", "train.py", "ddp_kit.py")
SCOPES = ("course", "template")


def list_path(scope: str) -> Path:
    return Path(__file__).with_name(
        "torch_floor.txt" if scope == "course" else f"torch_floor_{scope}.txt"
    )


def floor(scope: str) -> str:
    """The oldest torch the scope promises: pyproject's for the course, train.py's own."""
    if scope == "course":
        text, pattern = (REPO / "pyproject.toml").read_text(), r'"torch>=([\d.]+)"'
    else:
        text, pattern = (REPO / "scripts" / "train.py").read_text(), r"torch ([\d.]+) or later"
    found = re.search(pattern, text)
    assert found, f"no torch floor ({pattern}) found for the {scope}"
    return found.group(1)


def sources(scope: str = "course") -> Iterator[tuple[str, str]]:
    """(name, Python source) of every file of the scope: .py files and notebook cells."""
    if scope == "template":
        for name in TEMPLATE:
            yield f"scripts/{name}", (REPO / "scripts" / name).read_text()
        return
    for folder in ("ddp_tutorial", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            yield str(path.relative_to(REPO)), path.read_text()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        lines = [
            ln for c in code for ln in c.splitlines() if not ln.lstrip().startswith(("%", "!"))
        ]
        yield str(path.relative_to(REPO)), "\n".join(lines)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted torch path, from the file's imports (anywhere in it)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    names[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ROOTS:
            for a in node.names:
                if a.name != "*":
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def used_names(source: str) -> set[str]:
    """Every torch/torchvision name the source refers to (the longest dotted chain), and
    ``name(keyword=)`` for each keyword passed to one."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = set(aliases.values())
    inner: set[int] = set()  # the Attribute nodes inside a longer chain already taken
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _dotted(node.func, aliases)):
            found.update(f"{name}({k.arg}=)" for k in node.keywords if k.arg)
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            if name := _dotted(node, aliases):
                found.add(name)
                child = node.value
                while isinstance(child, ast.Attribute):
                    inner.add(id(child))
                    child = child.value
    return found


def names_of(scope: str) -> dict[str, str]:
    """Every name the scope's files use -> the first file that uses it."""
    first: dict[str, str] = {}
    for where, source in sources(scope):
        for name in used_names(source):
            first.setdefault(name, where)
    return first


def digest(release: str, names: set[str]) -> str:
    """What the list's third line holds: a list edited by hand, not recorded, fails the test."""
    return hashlib.sha256("\n".join([release, *sorted(names)]).encode()).hexdigest()


def listed(scope: str) -> tuple[str, set[str]]:
    """(the release the scope's list was recorded under, the names in it)."""
    lines = list_path(scope).read_text().splitlines()
    release = lines[0].removeprefix("# recorded under torch ").split()[0]
    names = {ln for ln in lines if ln and not ln.startswith("#")}
    assert lines[2] == f"# sha256 {digest(release, names)}", (
        f"{list_path(scope).name} was edited by hand: record it under torch {release} instead "
        "(this file's docstring says how)"
    )
    return release, names


def _resolve(name: str) -> object:
    """The object a dotted name refers to, importing submodules on the way; raises if absent."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def missing_at_this_release(name: str) -> str | None:
    """Why ``name`` does not work with the torch installed now (None: it does)."""
    call = re.fullmatch(r"(.+)\((\w+)=\)", name)
    try:
        obj = _resolve(call.group(1) if call else name)
    except (ImportError, AttributeError) as exc:
        return f"absent ({type(exc).__name__}: {exc})"
    if call is None:
        return None
    try:  # builtins (torch.tensor, TCPStore) have none, and **kwargs takes any name:
        params = inspect.signature(obj).parameters  # those keywords are not checked
    except (TypeError, ValueError):
        return None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return None if takes_any or call.group(2) in params else "no such keyword"


@pytest.mark.parametrize("scope", SCOPES)
def test_every_torch_name_was_checked_at_the_floor(scope):
    release, names = listed(scope)
    assert release.startswith(floor(scope) + "."), (
        f"{list_path(scope).name} was recorded under torch {release}, the {scope}'s floor is "
        f"{floor(scope)}: record it again under torch {floor(scope)} (see this file's docstring)"
    )
    new = {name: where for name, where in names_of(scope).items() if name not in names}
    assert not new, (
        f"torch names not checked against torch {release} (the {scope}'s floor): "
        + ", ".join(f"{n} ({w})" for n, w in sorted(new.items())[:12])
        + f". Record {list_path(scope).name} again under torch {release} (this file's "
        "docstring says how), or keep to what that release has"
    )


def test_the_checker_sees_calls_keywords_and_aliases():
    source = (
        "import torch.distributed as dist\nfrom torch import nn\nimport torch\n"
        "dist.init_process_group('gloo', device_id=None)\nn = nn.utils.get_total_norm(ps)\n"
        "x = torch.tensor([1.0]).item()\n"
    )
    assert used_names(source) == {
        "torch.distributed",
        "torch.nn",
        "torch",
        "torch.distributed.init_process_group",
        "torch.distributed.init_process_group(device_id=)",
        "torch.nn.utils.get_total_norm",
        "torch.tensor",
    }
    assert missing_at_this_release("torch.nn.utils.no_such_function")
    assert missing_at_this_release("torch.distributed.init_process_group(no_such_keyword=)")
    assert missing_at_this_release("torch.distributed.init_process_group(backend=)") is None


def record(scope: str) -> int:
    """Write the scope's list under the torch installed now; refuse if it lacks a name."""
    import torch
    import torchvision

    names = names_of(scope)
    absent = {n: (w, why) for n, w in names.items() if (why := missing_at_this_release(n))}
    for name, (where, why) in sorted(absent.items()):
        print(f"{where}: {name}: {why}", file=sys.stderr)
    if absent:
        print(f"{len(absent)} names do not work with torch {torch.__version__}", file=sys.stderr)
        return 1
    header = [
        f"# recorded under torch {torch.__version__} torchvision {torchvision.__version__}",
        f"# every torch/torchvision name the {scope} uses, present there (test_torch_floor.py)",
        f"# sha256 {digest(torch.__version__, set(names))}",
    ]
    list_path(scope).write_text("\n".join([*header, *sorted(names)]) + "\n")
    print(f"{len(names)} names of the {scope} recorded under torch {torch.__version__}")
    return 0


def test_the_doctor_warns_below_the_same_floor():
    """``ddp-tutorial doctor`` reads the floor from the installed package's metadata."""
    from ddp_tutorial.harness.advice import course_torch_floor, release

    assert course_torch_floor() == release(floor("course")), "reinstall: pip install -e ."


def check(scope: str) -> int:
    """Under the floor release: does it have every name the scope's code uses? (make
    floor-check; writes nothing, whatever the build's local label, +cpu or +cu121)."""
    import torch

    from ddp_tutorial.harness.advice import release

    if release(torch.__version__) != release(floor(scope)):
        print(f"torch {torch.__version__} is not the {scope}'s floor, {floor(scope)}")
        return 1
    names = names_of(scope)
    absent = sorted(
        f"{w}: {n}: {why}" for n, w in names.items() if (why := missing_at_this_release(n))
    )
    print(
        "\n".join(absent) or f"torch {torch.__version__} has all {len(names)} names of the {scope}"
    )
    return 1 if absent else 0


if __name__ == "__main__":
    if (
        len(sys.argv) != 3
        or sys.argv[1] not in ("--record", "--check")
        or sys.argv[2] not in SCOPES
    ):
        sys.exit(f"usage: python tests/test_torch_floor.py --record|--check {{{','.join(SCOPES)}}}")
    sys.exit((record if sys.argv[1] == "--record" else check)(sys.argv[2]))
