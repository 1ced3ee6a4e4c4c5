"""The checks of ``ddp-tutorial lint`` that read one function (or the module's top level)
at a time: branches on the rank, devices, saves, what must come before CUDA, uneven data."""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from collections.abc import Iterator, Sequence

from ddp_tutorial.harness.lint_ast import (
    Kept,
    Scope,
    calls_in,
    complementary,
    dotted,
    env_key,
    is_collective,
    is_rank_test,
    keyword,
    last_name,
    names_in,
    pairs,
    targets,
)
from ddp_tutorial.harness.lint_rules import (
    ALIASED,
    CUDA_STRING,
    DEVICE_CONTEXTS,
    GPU_INDEX,
    IGNORE,
    RANK_ZERO_FIRST,
    RULES,
    SLOW_WORK,
    LintFinding,
)
from ddp_tutorial.harness.lint_saves import Helpers, SaveChecks, loaded_into, rank_predicates
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV

# set_device of every accelerator torch has a module for (torch.xpu, torch_npu's torch.npu, ...)
ACCELERATOR_SET_DEVICE = tuple(
    f"{a}.set_device" for a in ("cuda", "xpu", "npu", "musa", "mlu", "hpu", "mps")
) + ("set_device_index",)


def first_gpu(test: ast.expr) -> bool:
    """``self.gpu_id == 0`` (a GPU index that is the rank, in the official tutorial)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(first_gpu(part) for part in test.values)
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.ops[0], ast.Eq)
        and bool(GPU_INDEX.match(dotted(test.left).rsplit(".", 1)[-1]))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == 0
    )


class ScopeChecks(SaveChecks):
    """One parsed file, and the rules that read it a function at a time."""

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.lines = source.splitlines()
        self.tree = ast.parse(source, filename=path)
        aliases = {  # `DistributedSampler as DS`: read as the class it names
            alias.asname: alias.name
            for node in ast.walk(self.tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if alias.asname and alias.name in ALIASED
        }
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and node.id in aliases:
                node.id = aliases[node.id]
        self.found: list[LintFinding] = []
        self.every = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        self.distributed = any(
            last_name(c) in ("init_process_group", "DistributedDataParallel", "DDP")
            or is_collective(c)
            for c in self.every
        )
        self.functions = Helpers(self.tree)  # a helper's collectives for DDP101
        # `model.load_state_dict(...)`, `resume(..., model=model)`: a model whose own
        # checkpoint comes back into it, prefix and all
        self.resumed = {dotted(node) for c in self.every for node in loaded_into(c)}
        self.predicates = rank_predicates(self.tree)  # `def do_save(): if not is_master: ...`
        self.buffers = {  # `buffer = io.BytesIO()`: a save into it writes memory, no file
            name
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and last_name(node.value) == "BytesIO"
            for name in map(dotted, node.targets)
        }  # fmt: skip
        # mp.spawn(fn, ...) calls fn(index, ...): that index is the rank
        self.spawned = {dotted(c.args[0]) for c in self.every if last_name(c) == "spawn" and c.args}
        self.kept = {  # each method: the ranks its class keeps on self
            id(method): kept
            for owner in ast.walk(self.tree)
            if isinstance(owner, ast.ClassDef)
            for kept in [Kept.of(owner)]
            for method in owner.body
        }
        self.parents: dict[int, list[ast.stmt]] = {}
        for node in ast.walk(self.tree):
            for name in ("body", "orelse", "finalbody"):
                body = getattr(node, name, None)
                if isinstance(body, list):
                    for stmt in body:
                        self.parents[id(stmt)] = body

    def code_lines(self) -> list[str]:
        """The file's lines without their comments (a comment that names the old launcher
        is no use of it)."""
        lines = [line.rstrip("\r\n") for line in io.StringIO(self.source).readlines()]
        tokens = tokenize.generate_tokens(io.StringIO(self.source).readline)  # rows as these
        for token in tokens:
            if token.type == tokenize.COMMENT:
                row, col = token.start
                lines[row - 1] = lines[row - 1][:col]
        return lines

    def add(self, node: ast.AST, code: str, **fmt: object) -> None:
        line = getattr(node, "lineno", 1)
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        if (m := IGNORE.search(text)) and (not m["codes"] or code in m["codes"]):
            return
        self.found.append(LintFinding(self.path, line, code, RULES[code][0].format(**fmt)))

    def scopes(self) -> Iterator[tuple[ast.Module | ast.FunctionDef | ast.AsyncFunctionDef, Scope]]:
        yield self.tree, Scope(self.tree.body, (), Kept(rank=set(self.predicates)))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                kept = self.kept.get(id(node)) or Kept()
                kept = Kept(kept.rank | self.predicates, kept.global_rank, kept.local_rank)
                if node.name in self.spawned and params:
                    params[0] = "rank"  # its first argument is the rank (renamed for the scan)
                    scope = Scope(node.body, params, kept)
                    scope.rank.add(node.args.args[0].arg if node.args.args else "rank")
                else:
                    scope = Scope(node.body, params, kept)
                yield node, scope

    # ---------------------------------------------------------------- walking

    @staticmethod
    def statements(owner: ast.AST) -> Iterator[ast.stmt]:
        """The statements of one scope, in source order, not those of nested functions."""
        todo = list(reversed(owner.body))  # type: ignore[attr-defined]
        while todo:
            stmt = todo.pop()
            yield stmt
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            children = [c for c in ast.iter_child_nodes(stmt) if isinstance(c, ast.stmt)]
            for handler in getattr(stmt, "handlers", []):
                children.extend(handler.body)
            todo.extend(sorted(children, key=lambda c: c.lineno, reverse=True))

    @staticmethod
    def own_calls(stmt: ast.stmt) -> list[ast.Call]:
        """The calls of one statement itself, not of the statements nested in it."""
        nested = {
            id(c)
            for s in ast.iter_child_nodes(stmt)
            if isinstance(s, ast.stmt | ast.excepthandler)
            for c in ast.walk(s)
        }
        return [c for c in ast.walk(stmt) if isinstance(c, ast.Call) and id(c) not in nested]

    def after(self, stmt: ast.stmt) -> list[ast.stmt]:
        """The statements that follow ``stmt`` in its block."""
        body = self.parents.get(id(stmt), [])
        return body[body.index(stmt) + 1 :] if stmt in body else []

    def overwritten(self, stmt: ast.stmt) -> bool:
        """``x = a`` at once followed by ``x = b`` (not reading x): the first value is dead
        (an exercise's stub line, kept above the answer that replaces it)."""
        following = self.after(stmt)
        names = targets(stmt)
        if not following or not names or not isinstance(following[0], ast.Assign):
            return False
        nxt = following[0]
        return set(names) <= set(targets(nxt)) and not set(names) & names_in(nxt.value)

    @staticmethod
    def is_cuda(node: ast.AST | None) -> bool:
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and bool(CUDA_STRING.match(node.value))
        )

    @staticmethod
    def nccl(call: ast.Call) -> bool:
        backend = keyword(call, "backend") or (call.args[0] if call.args else None)
        return isinstance(backend, ast.Constant) and "nccl" in str(backend.value)

    def may_be_nccl(self, call: ast.Call) -> bool:
        """nccl named, or one of the backends a computed one can be: ``"nccl" if
        torch.cuda.is_available() else "gloo"``, inline or in a name the file assigns it to
        (the GPU branch of such a script binds no device either)."""
        backend = keyword(call, "backend") or (call.args[0] if call.args else None)
        if backend is None or isinstance(backend, ast.Constant):
            return self.nccl(call)
        sources = [backend] + [
            node.value
            for node in ast.walk(self.tree)  # type: ignore[attr-defined]
            if isinstance(backend, ast.Name) and isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == backend.id for t in node.targets)
        ]  # fmt: skip
        return any(
            isinstance(c, ast.Constant) and str(c.value).lower() == "nccl"
            for source in sources
            for c in ast.walk(source)
        )

    @staticmethod
    def gloo(call: ast.Call) -> bool:
        """A backend named, without nccl in it: a group that never runs on a GPU."""
        backend = keyword(call, "backend") or (call.args[0] if call.args else None)
        return isinstance(backend, ast.Constant) and "nccl" not in str(backend.value)

    def forward(self, call: ast.Call, scope: Scope) -> bool:
        return isinstance(call.func, ast.Name) and scope.wrapper(call.func.id, call.lineno)

    # ---------------------------------------------------------------- rules by scope

    def branch_calls(
        self, body: Sequence[ast.stmt], scope: Scope, helpers: bool = False
    ) -> list[tuple[str, ast.Call]]:
        """Collectives and DDP forwards in a branch: ('all_reduce', call), ('forward', call);
        with ``helpers``, those of a function of this file it calls (`if rank == 0:
        evaluate(...)`, whose all_reduce the other ranks never join), named at the call."""
        out = []
        for call in (c for stmt in body for c in calls_in(stmt)):
            if is_collective(call):
                out.append((last_name(call), call))
            elif self.forward(call, scope):
                out.append(("forward", call))
            elif helpers and (helper := self.functions.get(call)) is not None:
                inner = [c for s in helper.body for c in calls_in(s)]
                out += [(last_name(c), call) for c in inner if is_collective(c)]
        return out

    def rank_branches(self, owner: ast.AST, scope: Scope) -> None:
        """DDP101 (a collective some ranks skip), DDP122 (rank 0 busy, the others waiting)."""
        for stmt in self.statements(owner):  # `with torch_distributed_zero_first(rank):`
            if isinstance(stmt, ast.With) and any(
                RANK_ZERO_FIRST.search(last_name(i.context_expr).lower())
                for i in stmt.items
                if isinstance(i.context_expr, ast.Call)
            ):
                slow = [c for c in calls_in(stmt) if SLOW_WORK.search(last_name(c).lower())]
                if slow:
                    self.add(stmt, "DDP122", what=f"{last_name(slow[0])}()")
        ifs = [s for s in self.statements(owner) if isinstance(s, ast.If)]
        for stmt in ifs:
            if not is_rank_test(stmt.test, scope):
                continue
            # a helper's collectives when the test names the rank itself (not a value that
            # merely came from rank-dependent data, like an all_reduced flag)
            direct = any(
                "rank" in n.rsplit(".", 1)[-1].lower() or n in scope.global_rank
                for n in names_in(stmt.test)
            )
            inside = self.branch_calls(stmt.body, scope, direct)
            if not stmt.orelse and any(  # rank 0 first: each rank passes one of two barriers
                not o.orelse
                and complementary(stmt.test, o.test)
                and Counter(n for n, _ in self.branch_calls(o.body, scope))
                == Counter(n for n, _ in inside)
                for o in ifs
            ):
                continue
            elif_ = len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
            if elif_ and not is_rank_test(stmt.orelse[0].test, scope):  # type: ignore[attr-defined]
                other = []  # `elif <not about ranks>:` is a branch of its own
            else:
                other = self.branch_calls(stmt.orelse, scope, direct)
            # the same collectives on both sides is fine (point-to-point is not in the list)
            if Counter(n for n, _ in inside) != Counter(n for n, _ in other):
                for name, call in inside + other:
                    what = "a forward of the DDP model (it syncs buffers: a collective)"
                    self.add(call, "DDP101", what=what if name == "forward" else f"dist.{name}")
            if inside or stmt.orelse:
                continue
            slow = [
                c for s in stmt.body for c in calls_in(s) if SLOW_WORK.search(last_name(c).lower())
            ]
            waits = any(  # a collective of its own group (group=...): its own timeout
                (is_collective(c) and keyword(c, "group") is None) or self.forward(c, scope)
                for s in self.after(stmt)
                for c in calls_in(s)
            )
            if slow and waits:
                self.add(stmt, "DDP122", what=f"{last_name(slow[0])}()")

    def devices(self, owner: ast.AST, scope: Scope) -> None:
        """DDP102: the global rank where a GPU index goes; DDP130: a device context manager
        called as a statement of its own (it sets nothing)."""
        for stmt in self.statements(owner):
            bare = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(bare, ast.Call) and dotted(bare.func).endswith(DEVICE_CONTEXTS):
                self.add(stmt, "DDP130", what=dotted(bare.func))
        for call in (c for s in self.statements(owner) for c in self.own_calls(s)):
            name = dotted(call.func)
            slots: list[ast.expr] = []
            if name.endswith(ACCELERATOR_SET_DEVICE) or last_name(call) in (
                "cuda",
                "to",
            ):
                slots = list(call.args[:1])
            elif last_name(call) == "device" and call.args[:1] and self.is_cuda(call.args[0]):
                slots = list(call.args[1:2])
            ids = keyword(call, "device_ids")
            if isinstance(ids, ast.List | ast.Tuple):
                slots += list(ids.elts)
            text = call.args[0] if call.args else None  # f"cuda:{rank}", "cuda:" + str(rank)
            if isinstance(text, ast.JoinedStr | ast.BinOp) and "cuda" in ast.unparse(text):
                slots += [n for n in ast.walk(text) if isinstance(n, ast.Name | ast.Attribute)]
            for slot in slots:
                held = isinstance(slot, ast.Name | ast.Attribute) and dotted(slot)
                if scope.is_global_rank(slot) or held in scope.global_device:
                    label = dotted(slot) or "the rank"
                    self.add(
                        call, "DDP102", name=label + ("()" if isinstance(slot, ast.Call) else "")
                    )
                    break

    def guard(self, target: ast.AST, owner: ast.AST, scope: Scope) -> ast.expr | None:
        """The rank test that keeps ``target`` to some ranks: an enclosing ``if``, or an
        earlier ``if <rank test>: return`` in the same function (None: every rank runs it)."""
        line = target.lineno  # type: ignore[attr-defined]
        for stmt in self.statements(owner):
            if stmt.lineno > line:
                break
            if not isinstance(stmt, ast.If) or not (
                is_rank_test(stmt.test, scope) or first_gpu(stmt.test)
            ):
                continue
            inside = any(sub is target for s in stmt.body for sub in ast.walk(s))
            exits = any(isinstance(s, ast.Return | ast.Continue | ast.Raise) for s in stmt.body)
            if inside or (exits and (stmt.end_lineno or line) < line):
                return stmt.test
        return None

    def order(self, owner: ast.AST) -> None:
        """DDP110, DDP112: what must come before CUDA starts."""
        touched: int | None = None  # the line CUDA was first used on (the driver started)
        context: int | None = None  # the line a CUDA context was first made on
        made: ast.Call | None = None  # the call that made it
        group = False  # a group joined that may be nccl's (a barrier then runs on the device)
        for stmt in self.statements(owner):
            for call in self.own_calls(stmt):
                name = dotted(call.func)
                if name.endswith("cuda.set_device") and made and not self.apart(made, call, owner):
                    self.add(call, "DDP110", line=context)
                    made = None  # the first set_device after it says so
                makes = (
                    last_name(call) == "cuda"
                    or (last_name(call) == "to" and any(self.is_cuda(a) for a in call.args))
                    or self.is_cuda(keyword(call, "device"))
                    or (group and is_collective(call))  # on cuda:0 (MoCo v3, SimSiam)
                )
                group = group or last_name(call) == "init_process_group" and not self.gloo(call)
                group = group and not name.endswith("cuda.set_device")  # then on its device
                starts = (
                    makes
                    or (".cuda." in f".{name}" and not name.endswith("set_device"))
                    or (last_name(call) == "init_process_group" and self.nccl(call))
                )
                if makes and context is None:
                    context, made = call.lineno, call
                touched = call.lineno if starts and touched is None else touched
            if touched is not None and isinstance(stmt, ast.Assign) and touched < stmt.lineno:
                if any(env_key(t) == VISIBLE_DEVICES_ENV for t in stmt.targets):
                    self.add(stmt, "DDP112", line=touched)

    @staticmethod
    def apart(a: ast.AST, b: ast.AST, owner: ast.AST) -> bool:
        """Whether ``a`` and ``b`` sit on two sides of one ``if``/``else``: no run reaches both."""
        for node in ast.walk(owner):
            if isinstance(node, ast.If):
                sides = [
                    {id(n) for s in side for n in ast.walk(s)} for side in (node.body, node.orelse)
                ]
                if any(id(a) in one and id(b) in other for one, other in (sides, sides[::-1])):
                    return True
        return False

    def uneven(self, owner: ast.AST, scope: Scope) -> None:
        """DDP121: a DDP model trained on a number of batches computed from the rank."""
        joined = {
            id(sub)
            for w in ast.walk(owner)
            if isinstance(w, ast.With)
            and any(dotted(i.context_expr).endswith("Join") for i in w.items)
            for sub in ast.walk(w)
        }
        counted = {
            name
            for stmt in self.statements(owner)
            for name, value in pairs(stmt)
            if isinstance(value, ast.Call)
            and any(
                isinstance(b, ast.BinOp) and scope.depends_on_rank(b)
                for a in value.args
                for b in ast.walk(a)
            )
        }
        for stmt in self.statements(owner):
            if (
                isinstance(stmt, ast.For)
                and dotted(stmt.iter) in counted
                and id(stmt) not in joined
            ):
                if any(last_name(c) == "backward" for c in calls_in(stmt)):
                    self.add(stmt, "DDP121")
            for call in self.own_calls(stmt):
                if id(call) in joined:
                    continue
                if not any(isinstance(a, ast.Name) and a.id in counted for a in call.args):
                    continue  # (training_params walks the file: asked only when it matters)
                trains = self.training_params(last_name(call))
                for i, arg in enumerate(call.args):
                    if isinstance(arg, ast.Name) and arg.id in counted and i in trains:
                        self.add(call, "DDP121")

    def training_params(self, function: str) -> set[int]:
        """Positions of the parameters a function of this file trains on (a ``for`` over
        the parameter with a backward inside)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef) and node.name == function:
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                return {
                    params.index(loop.iter.id)
                    for loop in ast.walk(node)
                    if isinstance(loop, ast.For)
                    and isinstance(loop.iter, ast.Name)
                    and loop.iter.id in params
                    and any(last_name(c) == "backward" for c in calls_in(loop))
                }
        return set()
