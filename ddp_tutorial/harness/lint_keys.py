"""What lint reads about a checkpoint's keys: the hand-written ways of taking the DDP wrapper's
``module.`` prefix off them, each of which renames some key it should not.

``k[7:]`` (DDP115) cuts seven characters from keys that never had the prefix; ``k.lstrip(
"module.")`` (DDP124) strips a set of characters (``"layer.weight"`` loses its ``l``);
``k.replace("module.", "")`` (DDP129) removes the text anywhere in the key, so a layer whose
name ends in ``module`` (``fusion_module.weight``) loses part of its name. Each works on the
models its author tried, which is why reviewers keep finding it; the fix is the same for all:
``str.removeprefix`` or torch's ``consume_prefix_in_state_dict_if_present``. Only names a loop
or comprehension iterates count as keys, and an edit behind ``if k.startswith(...)`` is fine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from ddp_tutorial.harness.lint_ast import last_name
from ddp_tutorial.harness.lint_rules import WRAPPER_PREFIXES


def _loop_names(tree: ast.Module) -> set[str]:
    """The first name each ``for``/comprehension binds: ``k`` in ``for k, v in s.items()``."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension):
            target = node.target
            first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
            if isinstance(first, ast.Name):
                keys.add(first.id)
    return keys


def _guarded(tree: ast.Module) -> set[int]:
    """Nodes under ``k[7:] if k.startswith("module.") else k`` or ``if k.startswith(...):``."""
    return {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If | ast.IfExp)
        and isinstance(node.test, ast.Call)
        and last_name(node.test) == "startswith"
        for part in (node.body if isinstance(node.body, list) else [node.body])
        for sub in ast.walk(part)
    }


def key_edits(tree: ast.Module) -> Iterator[tuple[ast.AST, str, dict[str, Any]]]:
    """``(node, code, message fields)`` for each unguarded edit of a key: DDP115, 124, 129."""
    keys, guarded = _loop_names(tree), _guarded(tree)
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in keys
            and isinstance(node.slice, ast.Slice)
            and isinstance(node.slice.lower, ast.Constant)
            and node.slice.lower.value == len("module.")
            and node.slice.upper is None
        ):
            yield node, "DDP115", {"name": node.value.id}
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in keys
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in WRAPPER_PREFIXES
        ):
            continue
        prefix, name, how = node.args[0].value, node.func.value.id, node.func.attr
        if how in ("lstrip", "strip") and len(node.args) == 1:
            chars = ", ".join(repr(c) for c in dict.fromkeys(prefix))
            yield node, "DDP124", {"name": name, "how": how, "prefix": prefix, "chars": chars}
        elif how == "replace" and len(node.args) >= 2:
            yield node, "DDP129", {"name": name, "prefix": prefix, "stem": prefix.rstrip(".")}
