"""What lint reads about saves, DDP105-DDP107: which ranks write the file, and whether the
weights carry the wrapper's ``module.`` prefix; and which of the file's own functions answer
"am I the rank that writes?" (a branch on one of their calls is a rank test, for every rule).

A mixin of the linter: it walks with :class:`~ddp_tutorial.harness.lint_scopes.ScopeChecks`'s
``statements``, ``own_calls``, ``guard``, ``scopes`` and reports with its ``add``.
"""

from __future__ import annotations

import ast
import re

from ddp_tutorial.harness.lint_ast import (
    Scope,
    dotted,
    is_rank_test,
    keyword,
    last_name,
    names_in,
    only_local,
    pairs,
)


class Helpers:
    """This file's functions by name, for the calls that reach them: ``evaluate(...)``,
    ``self.save()``, ``trainer.save()``; not ``torch.save`` or ``th.save``, a module's function
    that shares a name with one of this file's (guided-diffusion's ``save``)."""

    def __init__(self, tree: ast.Module) -> None:
        self.by_name = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        self.methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                        for f in c.body if isinstance(f, ast.FunctionDef)}  # fmt: skip
        imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
        self.modules = {(a.asname or a.name).split(".")[0] for node in imports for a in node.names}
        # each name's bindings, in line order, and whether each made an object of an imported
        # class (`store = dist.TCPStore(...)`: its methods are not this file's, whatever they
        # are called); torch.compile and deepcopy hand back this file's object, wrapped
        self.bindings: dict[str, list[tuple[int, bool]]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                made = dotted(node.value.func) if isinstance(node.value, ast.Call) else ""
                foreign = made.split(".")[0] in self.modules and made not in KEEPS_OBJECT
                for name, _ in pairs(node):
                    self.bindings.setdefault(name, []).append((node.lineno, foreign))

    def foreign(self, name: str, line: int) -> bool:
        """Whether ``name``'s last binding before ``line`` made an imported class's object."""
        before = sorted(b for b in self.bindings.get(name, []) if b[0] < line)
        return bool(before) and before[-1][1]

    def get(self, call: ast.Call) -> ast.FunctionDef | None:
        if not isinstance(call.func, ast.Attribute):
            return self.by_name.get(last_name(call))
        owner = dotted(call.func.value)
        if owner.split(".")[0] in self.modules or self.foreign(owner, call.lineno):
            return None
        found = self.by_name.get(call.func.attr)  # `x.check()` reaches a method, never a
        return found if found is not None and id(found) in self.methods else None  # function


KEEPS_OBJECT = frozenset({"torch.compile", "copy.deepcopy", "deepcopy", "compile"})
RESTORES = re.compile(r"(^|_)(load|resume|restart|restore)(_|$)")


def loaded_into(call: ast.Call) -> list[ast.expr]:
    """The models a call puts a checkpoint back into: ``model.load_state_dict(...)``'s model,
    every argument of a ``load``/``resume``/``restart``/``restore`` helper (DINO's
    ``restart_from_checkpoint(path, student=student)``)."""
    if last_name(call) == "load_state_dict" and isinstance(call.func, ast.Attribute):
        nodes = [call.func.value]
    elif RESTORES.search(last_name(call).lower()):
        nodes = [*call.args, *(k.value for k in call.keywords)]
    else:
        nodes = []
    return [n for n in nodes if isinstance(n, ast.Name | ast.Attribute)]


def rank_predicates(tree: ast.Module) -> set[str]:
    """The file's functions whose answer is a rank test: TAPE's ``do_save`` begins ``if not
    is_master: return False``; ``def should_log(): return rank == 0``. A branch on a call to
    one (``if do_save(epoch):``) runs on some ranks only, as a branch on the test would."""
    found: set[str] = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        scope = Scope(func.body, [a.arg for a in func.args.args])
        for stmt in func.body:
            test = None
            if isinstance(stmt, ast.If) and any(
                isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant))
                for s in stmt.body
            ):
                test = stmt.test  # an early answer for some ranks
            elif isinstance(stmt, ast.Return) and isinstance(
                stmt.value, ast.Compare | ast.BoolOp | ast.UnaryOp
            ):
                test = stmt.value
            if test is not None and is_rank_test(test, scope):
                found |= {func.name, f"self.{func.name}"}
    return found


class SaveChecks:
    """DDP105-DDP107, for :class:`~ddp_tutorial.harness.lint.Linter`."""

    def resumed_wrapper(self, holder: ast.expr, owner: ast.AST, scope: Scope) -> bool:
        """Whether the wrapper whose ``state_dict()`` is saved takes a checkpoint back too: the
        keys then agree with the file (``module.`` both ways). A load in this scope counts where
        the name holds the wrapper: MLPerf's SSD loads into the plain model, wraps, and saves
        the wrapper's keys, which the next resume refuses. A load elsewhere (a helper) counts."""
        name = dotted(holder)
        if name not in self.resumed:  # type: ignore[attr-defined]
            return False
        here = [
            call.lineno
            for stmt in self.statements(owner)  # type: ignore[attr-defined]
            for call in self.own_calls(stmt)  # type: ignore[attr-defined]
            if any(dotted(node) == name for node in loaded_into(call))
        ]
        if not here or not isinstance(holder, ast.Name):
            return True
        return any(scope.wrapper(holder.id, line) for line in here)

    def wrapped_attributes(self) -> set[str]:
        """``self.model`` where the file assigns ``self.model = DDP(...)``: the official
        series' Trainer holds its wrapper in an attribute."""
        return {
            dotted(target)
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and last_name(node.value) in ("DDP", "DistributedDataParallel")
            for target in node.targets
            if isinstance(target, ast.Attribute)
        }  # fmt: skip

    def saves(self, owner: ast.AST, scope: Scope) -> None:
        """DDP105-DDP107: who writes, and what."""
        for stmt in self.statements(owner):
            for call in self.own_calls(stmt):
                if last_name(call) == "state_dict" and isinstance(call.func, ast.Attribute):
                    holder = call.func.value
                    if self.resumed_wrapper(holder, owner, scope):
                        continue  # loaded back into the same wrapper: its keys agree
                    if isinstance(holder, ast.Name) and scope.wrapper(holder.id, call.lineno):
                        if not self.overwritten(stmt):
                            self.add(call, "DDP107", name=holder.id)
                    elif dotted(holder) in self.wrapped_attributes():  # self.model = DDP(...)
                        if not self.overwritten(stmt):
                            self.add(call, "DDP107", name=dotted(holder))
                if dotted(call.func) == "torch.save" and self.distributed:
                    self.writer(call, owner, scope)

    def rank_named(self, path: ast.expr) -> bool:
        """A path that names the rank (f"rng_rank{rank}.pt"), or a name assigned one anywhere in
        the file (swav: ``queue_path = ... + str(args.rank) + ".pth"``): a file per rank."""

        def named(node: ast.AST) -> bool:
            return any("rank" in n.rsplit(".", 1)[-1].lower() for n in names_in(node))

        return named(path) or isinstance(path, ast.Name) and any(
            named(node.value)
            for node in ast.walk(self.tree)  # type: ignore[attr-defined]
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == path.id for t in node.targets)
        )  # fmt: skip

    def caller_guard(self, function: ast.AST) -> ast.expr | None:
        """The rank test around every call of ``function`` (a helper whose save sits in a
        function nested in it: MLPerf's ``save`` calls ``write_checkpoint``), or None."""
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        guards = [
            self.guard(c, site_owner, site_scope)  # type: ignore[attr-defined]
            for site_owner, site_scope in self.scopes()  # type: ignore[attr-defined]
            for stmt in self.statements(site_owner)  # type: ignore[attr-defined]
            for c in self.own_calls(stmt)  # type: ignore[attr-defined]
            if last_name(c) == function.name and not dotted(c.func).startswith("torch.")
        ]
        return guards[0] if guards and all(g is not None for g in guards) else None

    def writer(self, call: ast.Call, owner: ast.AST, scope: Scope) -> None:
        """A save in a helper is judged where the helper is called (every call guarded?)."""
        target = call.args[1] if len(call.args) > 1 else keyword(call, "f")
        if target is not None and (
            self.rank_named(target)
            or "BytesIO" in ast.unparse(target)
            or dotted(target) in self.buffers
        ):
            return  # a file per rank (f"rng_rank{rank}.pt"), or memory: no shared file
        test = self.guard(call, owner, scope)
        sites: list[tuple[ast.Call, ast.AST, Scope]] = []
        if test is None and isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef):
            for site_owner, site_scope in self.scopes():
                for stmt in self.statements(site_owner):
                    sites += [  # `save(...)`, `self.save(...)`; not the torch.save in it
                        (c, site_owner, site_scope)
                        for c in self.own_calls(stmt)
                        if last_name(c) == owner.name
                        and c is not call
                        and not dotted(c.func).startswith("torch.")
                    ]
            if not sites and owner.name not in self.spawned:
                return  # a helper this file never calls: its callers guard it, or not
            # mp.spawn(worker): the worker runs on every rank, the save in it too
        checks = (
            [(call, test)]
            if not sites
            else [(c, self.guard(c, o, s) or self.caller_guard(o)) for c, o, s in sites]
        )
        if all(guard is None for _, guard in checks):
            checks = [(call, None)]  # no caller guards it (main()): the save's own line
        for where, guard in checks:
            if guard is None:
                self.add(where, "DDP105")
            elif (local := only_local(guard, scope)) is not None:
                self.add(where, "DDP106", name=local)


def under_modulo(loop: ast.For, call: ast.Call) -> bool:
    """Whether ``call`` runs only under an ``if`` that tests a remainder (``epoch % k``)."""

    def modulo(test: ast.AST) -> bool:  # `a or b`: each way must go through a remainder
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
            return all(modulo(v) for v in test.values)
        if isinstance(test, ast.BoolOp):  # `rank == 0 and (...)`: one part with a remainder
            return any(modulo(v) for v in test.values)
        return any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod) for b in ast.walk(test))

    for node in ast.walk(loop):
        if isinstance(node, ast.If) and any(sub is call for s in node.body for sub in ast.walk(s)):
            if modulo(node.test):  # `or epoch == epochs - 1`: the last epoch is saved too
                return True
    return False
