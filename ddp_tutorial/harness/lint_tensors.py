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
from collections.abc import Iterator

from ddp_tutorial.harness.lint_ast import dotted, is_collective, keyword, last_name, own_nodes

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
    """A factory call without ``device=``, or ``x.cpu()``; through calls that keep the device
    (``.int()``, ``.view(...)``) and both sides of an ``if`` (yolov7's broadcast indices)."""
    if isinstance(node, ast.IfExp):
        return made_on_cpu(node.body) and made_on_cpu(node.orelse)
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute) and node.func.attr in KEEPS_DEVICE:
        return made_on_cpu(node.func.value)
    if isinstance(node.func, ast.Attribute) and node.func.attr == "cpu" and not node.args:
        return True
    head, _, tail = dotted(node.func).rpartition(".")
    return head == "torch" and tail in FACTORIES and keyword(node, "device") is None


def nccl_only(tree: ast.Module) -> bool:
    """The file makes its group with the backend named "nccl" and nothing for the CPU."""
    for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
        if last_name(call) == "init_process_group":
            backend = keyword(call, "backend") or (call.args[0] if call.args else None)
            if isinstance(backend, ast.Constant) and str(backend.value).lower() == "nccl":
                return True
    return False


def default_device_set(tree: ast.Module) -> bool:
    """``torch.set_default_device(...)`` or ``with torch.device(...):``: factories follow it."""
    entered = {
        id(item.context_expr)
        for w in ast.walk(tree)
        if isinstance(w, ast.With | ast.AsyncWith)
        for item in w.items
    }
    return any(
        isinstance(n, ast.Call)
        and (
            last_name(n) == "set_default_device"
            or (dotted(n.func) == "torch.device" and id(n) in entered)
        )
        for n in ast.walk(tree)
    )


def scopes(tree: ast.Module) -> Iterator[list[ast.stmt]]:
    yield tree.body
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.body


def cpu_tensors_in_collectives(tree: ast.Module) -> list[tuple[ast.Call, str, int]]:
    """``(collective, what it was given, the line that made it)`` for every tensor made on
    the CPU that a collective of an nccl-only group is given, by name or directly."""
    if not nccl_only(tree) or default_device_set(tree):
        return []
    found = []
    for body in scopes(tree):
        nodes = list(own_nodes(body))
        made: dict[str, list[tuple[int, ast.expr]]] = {}  # a name's assignments, by line
        for node in nodes:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        made.setdefault(target.id, []).append((node.lineno, node.value))
        for call in (n for n in nodes if isinstance(n, ast.Call)):
            if not is_collective(call) or last_name(call) in PICKLING:
                continue
            for arg in [*call.args, *(k.value for k in call.keywords if k.arg == "tensor")]:
                value, line = arg, call.lineno
                if isinstance(arg, ast.Name):  # the last assignment before the call
                    before = [(n, v) for n, v in made.get(arg.id, []) if n <= call.lineno]
                    if not before:
                        continue
                    line, value = max(before, key=lambda pair: pair[0])
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
