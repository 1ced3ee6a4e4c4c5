"""What lint reads about a checkpoint's keys: the hand-written ways of taking the DDP wrapper's
``module.`` prefix off them, each of which renames some key it should not.

``k[7:]`` (DDP115) cuts seven characters from keys that never had the prefix; ``k.lstrip(
"module.")`` (DDP124) strips a set of characters (``"layer.weight"`` loses its ``l``);
``k.replace("module.", "")`` (DDP129) removes the text anywhere in the key, so a layer whose
name ends in ``module`` (``fusion_module.weight``) loses part of its name. Each works on the
models its author tried, which is why reviewers keep finding it; the fix is the same for all:
``str.removeprefix`` or torch's ``consume_prefix_in_state_dict_if_present``. Only names a loop
or comprehension iterates count as keys (for DDP129: of what looks like a state dict). Behind
``if k.startswith("module.")``, ``k[7:]`` is right, and so is ``replace`` with a count of 1;
``lstrip`` is wrong behind any guard. ``_orig_mod.`` (torch.compile's) is not DDP129's: it sits
inside the keys of compiled submodules, where replacing it everywhere is the clean-up.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Any

from ddp_tutorial.harness.lint_ast import bound_names, last_name
from ddp_tutorial.harness.lint_rules import WRAPPER_PREFIXES

STATE = re.compile(r"state|ckpt|checkpoint|weights", re.I)  # what a state dict is called


def _loop_names(tree: ast.Module, states_only: bool = False) -> set[str]:
    """The first name each ``for``/comprehension binds (``k`` in ``for k, v in s.items()``);
    ``states_only``: of loops over what looks like a state dict - ``.items()`` or ``.keys()``
    of anything but a ``named_*()`` call, or a name that says so (``state_dict``, ``ckpt``)."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and (names := bound_names(node.target)):
            name = names[0].id
            text = ast.unparse(node.iter)
            listed = re.search(r"\.(items|keys)\(\)$", text) and "named_" not in text
            if not states_only or listed or STATE.search(text):
                keys.add(name)
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


def _count_one(call: ast.Call) -> bool:
    """``k.replace("module.", "", 1)``: the first occurrence only (the prefix, once guarded)."""
    count = call.args[2] if len(call.args) > 2 else next(
        (kw.value for kw in call.keywords if kw.arg == "count"), None)  # fmt: skip
    return isinstance(count, ast.Constant) and count.value == 1


def key_edits(tree: ast.Module) -> Iterator[tuple[ast.AST, str, dict[str, Any]]]:
    """``(node, code, message fields)`` for each hand-made edit of a key: DDP115, 124, 129."""
    keys, states, guarded = _loop_names(tree), _loop_names(tree, True), _guarded(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and id(node) not in guarded  # k[7:] behind k.startswith("module."): right
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
        if how in ("lstrip", "strip") and len(node.args) == 1:  # wrong behind any guard too
            chars = ", ".join(repr(c) for c in dict.fromkeys(prefix))
            yield node, "DDP124", {"name": name, "how": how, "prefix": prefix, "chars": chars}
        elif (
            how == "replace"
            and len(node.args) >= 2
            and prefix == "module."  # _orig_mod. sits inside keys too: replacing it is right
            and name in states
            and not (id(node) in guarded and _count_one(node))
        ):
            yield node, "DDP129", {"name": name, "new": ast.unparse(node.args[1])}
