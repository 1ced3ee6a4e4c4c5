"""What lint reads about tensors: DDP120's unbounded ``bincount``, and DDP128, a tensor made on
the CPU and handed to a collective of an nccl-only group.

``init_process_group("nccl")`` gives the group one backend, for CUDA tensors: a collective on
a CPU tensor fails with "No backend type associated with device type cpu" (a mixed
``"cpu:gloo,cuda:nccl"`` group, or one made without naming a backend, takes both). The
usual way in: a metric summed into ``torch.tensor([loss, n])`` and all_reduced, written and
tried on a CPU machine with gloo, then run on GPUs with nccl. Read from how the tensor was
made, in the same scope: ``torch.tensor``/``zeros``/... without ``device=``, or ``.cpu()``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from ddp_tutorial.harness.lint_ast import (
    dotted,
    is_collective,
    keyword,
    last_name,
    own_nodes,
    pairs,
)

# torch's factories that make a tensor on the default device (the CPU) unless told otherwise;
# not torch.as_tensor or the *_like ones, which keep the device of what they are given
FACTORIES = frozenset(
    "tensor zeros ones empty full arange linspace rand randn randint eye from_numpy".split()
)
# methods whose result is on the device of the tensor they are called on
KEEPS_DEVICE = frozenset(
    "int long float double half bfloat16 bool byte short contiguous clone detach view reshape "
    "flatten squeeze unsqueeze".split()
)
# these pickle any object and move it through the group's device themselves
PICKLING = frozenset(
    "all_gather_object broadcast_object_list gather_object scatter_object_list".split()
)


def made_on_cpu(node: ast.AST) -> bool:
    """A factory call without ``device=`` (nor ``**kwargs`` that may hold one), or ``x.cpu()``;
    through calls that keep the device (``.int()``, ``.view(...)``) and both sides of an
    ``if`` (yolov7's broadcast indices)."""
    if isinstance(node, ast.IfExp):
        return made_on_cpu(node.body) and made_on_cpu(node.orelse)
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute) and node.func.attr in KEEPS_DEVICE:
        return made_on_cpu(node.func.value)
    if isinstance(node.func, ast.Attribute) and node.func.attr == "cpu" and not node.args:
        return True
    head, _, tail = dotted(node.func).rpartition(".")
    told = keyword(node, "device") is not None or any(k.arg is None for k in node.keywords)
    return head == "torch" and tail in FACTORIES and not told


def nccl_only(tree: ast.Module) -> bool:
    """The file makes its group with the backend named "nccl", and no group with gloo (a
    CPU-only branch, a side group for CPU tensors)."""
    backends = []
    for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
        name = last_name(call)
        if name not in ("init_process_group", "new_group"):
            continue
        first = call.args[0] if call.args and name == "init_process_group" else None
        backend = keyword(call, "backend") or first
        if isinstance(backend, ast.Constant):
            backends.append(str(backend.value).lower())
    return "nccl" in backends and not any("gloo" in b for b in backends)


def default_device_set(tree: ast.Module) -> bool:
    """``torch.set_default_device(...)``, ``set_default_tensor_type`` or ``with
    torch.device(...):``: the factories follow it."""
    entered = {
        id(item.context_expr)
        for w in ast.walk(tree)
        if isinstance(w, ast.With | ast.AsyncWith)
        for item in w.items
    }
    return any(
        isinstance(n, ast.Call)
        and (
            last_name(n) in ("set_default_device", "set_default_tensor_type")
            or (dotted(n.func) == "torch.device" and id(n) in entered)
        )
        for n in ast.walk(tree)
    )


def assignments(body: list[ast.stmt]) -> dict[str, list[tuple[ast.stmt, ast.expr]]]:
    """Each name's assignments in one scope (``a, b = x, y`` paired up), in source order."""
    made: dict[str, list[tuple[ast.stmt, ast.expr]]] = {}
    nodes = [n for n in own_nodes(body) if isinstance(n, ast.Assign | ast.AnnAssign)]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        for name, value in pairs(node):
            made.setdefault(name, []).append((node, value))
    return made


def other_branch_moves_it(name: str, stmt: ast.stmt, body: list[ast.stmt]) -> bool:
    """``stmt`` sits in one branch of an ``if`` whose other branch makes ``name`` otherwise:
    a CPU tensor only where the other branch does not run (no GPU there: no nccl either)."""
    for node in own_nodes(body):
        if not isinstance(node, ast.If):
            continue
        for mine, other in ((node.body, node.orelse), (node.orelse, node.body)):
            if any(stmt is s for part in mine for s in ast.walk(part)):
                there = assignments(other).get(name, [])
                return any(not made_on_cpu(value) for _, value in there)
    return False


def cpu_tensors_in_collectives(
    tree: ast.Module, bodies: Iterable[list[ast.stmt]]
) -> list[tuple[ast.Call, str, int]]:
    """``(collective, what it was given, the line that made it)`` for every tensor made on
    the CPU that a collective of an nccl-only group is given, by name or directly; not one on
    a group of its own (``group=``: it may be a gloo group)."""
    if not nccl_only(tree) or default_device_set(tree):
        return []
    found = []
    for body in bodies:  # each scope's statements: the module's, each function's
        made = assignments(body)
        for call in (n for n in own_nodes(body) if isinstance(n, ast.Call)):
            if not is_collective(call) or last_name(call) in PICKLING:
                continue
            if keyword(call, "group") is not None or len(call.args) > 3:
                continue
            for arg in [*call.args, *(k.value for k in call.keywords if k.arg == "tensor")]:
                value, line = arg, call.lineno
                if isinstance(arg, ast.Name):  # the last assignment before the call
                    before = [(s, v) for s, v in made.get(arg.id, []) if s.lineno <= call.lineno]
                    if not before or other_branch_moves_it(arg.id, before[-1][0], body):
                        continue
                    line, value = before[-1][0].lineno, before[-1][1]
                if isinstance(value, ast.ListComp):  # all_gather's list of outputs
                    value = value.elt
                if made_on_cpu(value):
                    found.append((call, ast.unparse(arg), line))
    return found


def unbounded_bincount(call: ast.Call) -> bool:
    """``torch.bincount(x)`` whose length can be this rank's largest label + 1."""
    minlength = keyword(call, "minlength")
    if minlength is None:
        return True
    options = (
        [minlength.body, minlength.orelse] if isinstance(minlength, ast.IfExp) else [minlength]
    )
    return any(isinstance(o, ast.Constant) and o.value == 0 for o in options)
