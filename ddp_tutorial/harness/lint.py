"""``ddp-tutorial lint FILE...``: the DDP mistakes reviewers flag by hand, found by reading code.

A static check (the standard ``ast`` module, nothing runs): each finding prints as
``file:line: CODE message (lesson NN)``, like a linter, and the exit status is 1 when
there is one. The rules are the course's own lessons turned around: every mistake the
three seed posts make that the code shows, every broken case of lesson 09's debugging
lab, and what the lessons teach against (a collective only rank 0 reaches, the global
rank used as a GPU index, a sampler that never changes its order...).

It reads one file at a time and guesses what a name holds from how it was made
(``dist.get_rank()``, ``DistributedDataParallel(...)``, a name whose ``.module`` is
read): it can miss a mistake spread over files, and a line it flags wrongly can carry
``# ddp-lint: ignore`` (or ``# ddp-lint: ignore[DDP101]``).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

# code: (what is wrong and what to do, the lesson that shows it)
RULES: dict[str, tuple[str, str]] = {
    "DDP101": (
        "{what} inside a branch that depends on the rank: the ranks that skip it leave the "
        "others waiting in it until the timeout; call it on every rank, outside the branch",
        "09",
    ),
    "DDP102": (
        "the global rank ({name}) used as a GPU index: on every node but the first it names a "
        "GPU that does not exist; use LOCAL_RANK (int(os.environ['LOCAL_RANK']))",
        "03",
    ),
    "DDP103": (
        "DistributedSampler {name} is never given .set_epoch(epoch): every epoch reads the "
        "same order; call {name}.set_epoch(epoch) at the top of the epoch loop",
        "02",
    ),
    "DDP104": (
        "shuffle=True beside sampler=: DataLoader refuses both; the sampler shuffles "
        "(DistributedSampler(shuffle=True) and set_epoch)",
        "02",
    ),
    "DDP105": (
        "torch.save on every rank: N processes write the same file at once (a torn file: "
        "'storage has wrong size'); save under `if rank == 0:` (the global rank)",
        "05",
    ),
    "DDP106": (
        "the save is guarded by the local rank ({name}): one writer per node, still concurrent "
        "writers on a shared disk; guard it with the global rank (dist.get_rank() == 0)",
        "05",
    ),
    "DDP107": (
        "{name}.state_dict() of the DDP wrapper: every key gets a 'module.' prefix that a "
        "plain model refuses; save {name}.module.state_dict()",
        "05",
    ),
    "DDP108": (
        "torch.load without map_location: tensors return to the device they were saved "
        "from (every rank onto cuda:0); pass map_location='cpu' or this rank's device",
        "05",
    ),
    "DDP109": (
        "init_process_group with nccl and no device_id: pass device_id=torch.device('cuda', "
        "local_rank) so that the group is bound to this rank's GPU (no guess, no "
        "'using GPU N to perform barrier' warning)",
        "03",
    ),
    "DDP110": (
        "torch.cuda.set_device after CUDA was used on line {line}: that work (and its "
        "context) is on the previous device, usually cuda:0; call set_device first",
        "03",
    ),
    "DDP111": (
        "init_process_group without destroy_process_group: call "
        "dist.destroy_process_group() at the end (in a finally:) for a clean exit",
        "01",
    ),
    "DDP112": (
        "CUDA_VISIBLE_DEVICES set after CUDA was used on line {line}: the process already "
        "chose its GPUs and ignores it; set it before the process starts (the launcher's "
        "environment)",
        "03",
    ),
    "DDP113": (
        "{what}: torch.distributed.launch and its --local_rank argument are deprecated; start "
        "with torchrun and read int(os.environ['LOCAL_RANK'])",
        "01",
    ),
    "DDP114": (
        "find_unused_parameters=True: DDP then walks the autograd graph after every forward; "
        "keep it only for a model that really leaves parameters unused",
        "04",
    ),
    "DDP115": (
        "{name}[7:] cuts 7 characters from every key, also from keys without 'module.'; use "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')",
        "05",
    ),
    "DDP116": (
        "nn.DataParallel: one process driving every GPU (and its GIL); use "
        "DistributedDataParallel, one process per GPU",
        "04",
    ),
    "DDP117": (
        "RANK set to a constant in the environment: every process started from here "
        "inherits it and believes it is that rank; pass each process its own rank",
        "01",
    ),
    "DDP118": (
        "a tqdm bar on every rank: N bars draw over one terminal; tqdm(..., disable=rank != 0)",
        "01",
    ),
    "DDP119": (
        "{name} has parameters that forward() never uses: DDP stops at the second step "
        "('Expected to have finished reduction'); remove or freeze it, or "
        "find_unused_parameters=True",
        "09",
    ),
    "DDP120": (
        "{what} has a length that depends on this rank's data: a collective on it gets "
        "different shapes on different ranks; give it a fixed length (minlength=...)",
        "09",
    ),
    "DDP121": (
        "training on a number of batches computed from the rank without Join: the rank with "
        "more batches waits in its last backward for partners that have finished; equal "
        "shards, or `with Join([model]):`",
        "09",
    ),
    "DDP122": (
        "rank 0 works alone ({what}) and the others wait for it in the next collective: "
        "longer than the timeout and they fail; do it before init_process_group, on every "
        "rank, or with a longer timeout",
        "09",
    ),
    "DDP123": (
        "the only save in the epoch loop is conditional and nothing saves after the loop: "
        "the last epoch's weights are never written",
        "05",
    ),
}

COLLECTIVES = frozenset(
    "all_reduce reduce broadcast all_gather all_gather_object all_gather_into_tensor gather "
    "gather_object scatter scatter_object_list reduce_scatter reduce_scatter_tensor "
    "all_to_all all_to_all_single broadcast_object_list barrier monitored_barrier".split()
)
DIST_PREFIXES = ("dist", "torch.distributed", "distributed")
GLOBAL_RANK_SOURCES = ("get_rank", "get_global_rank")
SLOW_WORK = re.compile(r"download|prepare|preprocess|tokeni[sz]e|build_cache|extract|sleep")
IGNORE = re.compile(r"#\s*ddp-lint:\s*ignore(?:\[(?P<codes>[A-Z0-9, ]+)\])?")
CUDA_STRING = re.compile(r"^cuda(:\d+)?$")


@dataclass(frozen=True, order=True)
class Finding:
    """One mistake at one line."""

    path: str
    line: int
    code: str
    message: str = field(compare=False)

    @property
    def lesson(self) -> str:
        return RULES[self.code][1]

    def format(self) -> str:
        return f"{self.path}:{self.line}: {self.code} {self.message} (lesson {self.lesson})"


def dotted(node: ast.AST) -> str:
    """``torch.distributed.all_reduce`` for the expression that names it ('' if not a name)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    if isinstance(node, ast.Call):  # torch.distributed.get_rank().something
        return dotted(node.func)
    return ""


def last_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else dotted(func)


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_collective(call: ast.Call) -> bool:
    name = dotted(call.func)
    head, _, tail = name.rpartition(".")
    return tail in COLLECTIVES and (head in DIST_PREFIXES or head.endswith(".distributed"))


def names_in(node: ast.AST) -> set[str]:
    """Names and dotted attributes read in ``node`` (``info.rank`` gives 'info' and 'info.rank')."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute) and (name := dotted(sub)):
            found.add(name)
    return found


def env_key(node: ast.AST) -> str | None:
    """'RANK' for ``os.environ["RANK"]``, ``os.environ.get("RANK")``, ``os.getenv("RANK")``."""
    if isinstance(node, ast.Subscript) and dotted(node.value).endswith("environ"):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    if isinstance(node, ast.Call) and dotted(node.func).endswith(("environ.get", "getenv")):
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def pairs(stmt: ast.stmt) -> list[tuple[str, ast.expr]]:
    """``(name, value)`` for each name an assignment binds (``a, b = x, y`` pairs them up)."""
    if isinstance(stmt, ast.Assign):
        nodes, value = list(stmt.targets), stmt.value
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign) and stmt.value is not None:
        nodes, value = [stmt.target], stmt.value
    else:
        return []
    out = []
    for node in nodes:
        if isinstance(node, ast.Tuple) and isinstance(value, ast.Tuple):
            if len(node.elts) == len(value.elts):
                out += [
                    (t.id, v)
                    for t, v in zip(node.elts, value.elts, strict=True)
                    if isinstance(t, ast.Name)
                ]
                continue
        out += [(name.id, value) for name in bound_names(node)]
    return out


def bound_names(target: ast.expr) -> list[ast.Name]:
    """The names an assignment target binds: ``a``, ``a, *b`` (not ``x[i]`` nor ``x.y``)."""
    if isinstance(target, ast.Name):
        return [target]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for e in target.elts for n in bound_names(e)]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    return []


def targets(stmt: ast.stmt) -> list[str]:
    return [name for name, _ in pairs(stmt)]


def own_nodes(body: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``body``, not looking into the functions and classes defined in it."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))


class Scope:
    """What one function (or the module's top level) makes of its names.

    ``rank``: names whose value depends on the rank (a branch on them splits the ranks);
    ``global_rank``: names that hold the global rank itself; wrappers: names that hold a
    DDP model at a given line (``net = model`` then ``net = model.module``: only before)."""

    def __init__(self, body: Sequence[ast.stmt], params: Iterable[str] = ()) -> None:
        self.rank = {p for p in params if "rank" in p.lower()}
        self.global_rank: set[str] = set()
        self.always_wrapped: set[str] = set()  # read as x.module, given to Join or no_sync
        self.bound: dict[str, list[tuple[int, bool | None]]] = {}  # name: (line, holds a wrapper)
        nodes = list(own_nodes(body))
        for sub in nodes:
            if isinstance(sub, ast.Attribute) and sub.attr in ("module", "no_sync"):
                if name := dotted(sub.value):
                    self.always_wrapped.add(name)
            if isinstance(sub, ast.Call) and last_name(sub) == "Join" and sub.args:
                if isinstance(sub.args[0], ast.List | ast.Tuple):
                    self.always_wrapped.update(dotted(e) for e in sub.args[0].elts)
        assigns = sorted(
            (s for s in nodes if isinstance(s, ast.stmt) and pairs(s)), key=lambda s: s.lineno
        )
        for _ in range(3):  # names feed each other: a few passes reach a fixed point
            self.bound = {}
            for stmt in assigns:
                for name, value in pairs(stmt):
                    self._learn(name, value, stmt.lineno)

    def _learn(self, name: str, value: ast.expr, line: int) -> None:
        if self.is_global_rank(value):
            self.global_rank.add(name)
        if self.depends_on_rank(value):
            self.rank.add(name)
        options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        status = [self.holds_wrapper(v, line) for v in options]
        wrapped = True if True in status else False if all(x is False for x in status) else None
        self.bound.setdefault(name, []).append((line, wrapped))

    def holds_wrapper(self, value: ast.expr, line: int) -> bool | None:
        """True: a DDP model (``DDP(...)``, or a name holding one); False: surely not (its
        ``.module``); None: cannot tell (``wrap(model)``: then how the name is used decides)."""
        if isinstance(value, ast.Call) and last_name(value) in ("DistributedDataParallel", "DDP"):
            return True
        if isinstance(value, ast.Name):
            return self.wrapper(value.id, line)
        if isinstance(value, ast.Attribute) and value.attr == "module":
            return False
        return None

    def wrapper(self, name: str, line: int) -> bool:
        """Whether ``name`` holds a DDP model at ``line`` (its last assignment before it)."""
        before = [w for at, w in self.bound.get(name, []) if at < line]
        if before and before[-1] is not None:
            return before[-1]
        return name in self.always_wrapped

    def is_global_rank(self, node: ast.AST) -> bool:
        """``dist.get_rank()``, ``int(os.environ["RANK"])`` or a name holding one of them."""
        if isinstance(node, ast.Call) and last_name(node) == "int" and node.args:
            return self.is_global_rank(node.args[0])
        if isinstance(node, ast.Call) and last_name(node) in GLOBAL_RANK_SOURCES:
            return True
        if isinstance(node, ast.Name):
            return node.id in self.global_rank
        return env_key(node) == "RANK"

    def depends_on_rank(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if self.is_global_rank(sub) or env_key(sub) in ("RANK", "LOCAL_RANK"):
                return True
        for name in names_in(node):
            if name in self.rank or "rank" in name.rsplit(".", 1)[-1].lower():
                return True
        return False


def is_rank_test(test: ast.expr, scope: Scope) -> bool:
    """``rank == 0``, ``not rank``, ``is_main``-like names: a test only some ranks pass."""
    return scope.depends_on_rank(test) or any(
        re.search(r"(main|master)_?(process|rank)|is_main|is_master", n) for n in names_in(test)
    )


def only_local(test: ast.expr, scope: Scope) -> str | None:
    """The local-rank name a guard tests when it tests no global rank ('args.local_rank')."""
    names = [n for n in names_in(test) if "rank" in n.rsplit(".", 1)[-1].lower()]
    local = [n for n in names if "local" in n.lower()]
    if (
        local
        and len(local) == len(names)
        and not any(scope.is_global_rank(n) for n in ast.walk(test))
    ):
        return local[0]
    return None


class Linter:
    """The rules over one parsed file."""

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.lines = source.splitlines()
        self.tree = ast.parse(source, filename=path)
        self.found: list[Finding] = []
        self.every = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        self.distributed = any(
            last_name(c) in ("init_process_group", "DistributedDataParallel", "DDP")
            or is_collective(c)
            for c in self.every
        )
        # mp.spawn(fn, ...) calls fn(index, ...): that index is the rank
        self.spawned = {dotted(c.args[0]) for c in self.every if last_name(c) == "spawn" and c.args}
        self.parents: dict[int, list[ast.stmt]] = {}
        for node in ast.walk(self.tree):
            for name in ("body", "orelse", "finalbody"):
                body = getattr(node, name, None)
                if isinstance(body, list):
                    for stmt in body:
                        self.parents[id(stmt)] = body

    def add(self, node: ast.AST, code: str, **fmt: object) -> None:
        line = getattr(node, "lineno", 1)
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        if (m := IGNORE.search(text)) and (not m["codes"] or code in m["codes"]):
            return
        self.found.append(Finding(self.path, line, code, RULES[code][0].format(**fmt)))

    def scopes(self) -> Iterator[tuple[ast.Module | ast.FunctionDef | ast.AsyncFunctionDef, Scope]]:
        yield self.tree, Scope(self.tree.body)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                if node.name in self.spawned and params:
                    params[0] = "rank"  # its first argument is the rank (renamed for the scan)
                    scope = Scope(node.body, params)
                    scope.rank.add(node.args.args[0].arg if node.args.args else "rank")
                else:
                    scope = Scope(node.body, params)
                yield node, scope

    def run(self) -> list[Finding]:
        for owner, scope in self.scopes():
            self.rank_branches(owner, scope)
            self.devices(owner, scope)
            self.saves(owner, scope)
            self.order(owner)
            self.uneven(owner, scope)
        self.whole_file()
        return sorted(set(self.found))

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

    def forward(self, call: ast.Call, scope: Scope) -> bool:
        return isinstance(call.func, ast.Name) and scope.wrapper(call.func.id, call.lineno)

    # ---------------------------------------------------------------- rules by scope

    def branch_calls(self, body: Sequence[ast.stmt], scope: Scope) -> list[tuple[str, ast.Call]]:
        """Collectives and DDP forwards in a branch: ('all_reduce', call), ('forward', call)."""
        out = []
        for call in (c for stmt in body for c in calls_in(stmt)):
            if is_collective(call):
                out.append((last_name(call), call))
            elif self.forward(call, scope):
                out.append(("forward", call))
        return out

    def rank_branches(self, owner: ast.AST, scope: Scope) -> None:
        """DDP101 (a collective some ranks skip), DDP122 (rank 0 busy, the others waiting)."""
        for stmt in self.statements(owner):
            if not isinstance(stmt, ast.If) or not is_rank_test(stmt.test, scope):
                continue
            inside = self.branch_calls(stmt.body, scope)
            elif_ = len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
            if elif_ and not is_rank_test(stmt.orelse[0].test, scope):  # type: ignore[attr-defined]
                other = []  # `elif <not about ranks>:` is a branch of its own
            else:
                other = self.branch_calls(stmt.orelse, scope)
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
            waits = any(
                is_collective(c) or self.forward(c, scope)
                for s in self.after(stmt)
                for c in calls_in(s)
            )
            if slow and waits:
                self.add(stmt, "DDP122", what=f"{last_name(slow[0])}()")

    def devices(self, owner: ast.AST, scope: Scope) -> None:
        """DDP102: the global rank where a GPU index goes."""
        for call in (c for s in self.statements(owner) for c in self.own_calls(s)):
            name = dotted(call.func)
            slots: list[ast.expr] = []
            if name.endswith("cuda.set_device") or last_name(call) in ("cuda", "to"):
                slots = list(call.args[:1])
            elif last_name(call) == "device" and call.args[:1] and self.is_cuda(call.args[0]):
                slots = list(call.args[1:2])
            ids = keyword(call, "device_ids")
            if isinstance(ids, ast.List | ast.Tuple):
                slots += list(ids.elts)
            for slot in slots:
                if scope.is_global_rank(slot):
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
            if not isinstance(stmt, ast.If) or not is_rank_test(stmt.test, scope):
                continue
            inside = any(sub is target for s in stmt.body for sub in ast.walk(s))
            exits = any(isinstance(s, ast.Return | ast.Continue | ast.Raise) for s in stmt.body)
            if inside or (exits and (stmt.end_lineno or line) < line):
                return stmt.test
        return None

    def saves(self, owner: ast.AST, scope: Scope) -> None:
        """DDP105-DDP107: who writes, and what."""
        for stmt in self.statements(owner):
            for call in self.own_calls(stmt):
                if last_name(call) == "state_dict" and isinstance(call.func, ast.Attribute):
                    holder = call.func.value
                    if isinstance(holder, ast.Name) and scope.wrapper(holder.id, call.lineno):
                        if not self.overwritten(stmt):
                            self.add(call, "DDP107", name=holder.id)
                if dotted(call.func) == "torch.save" and self.distributed:
                    self.writer(call, owner, scope)

    def writer(self, call: ast.Call, owner: ast.AST, scope: Scope) -> None:
        """A save in a helper is judged where the helper is called (every call guarded?)."""
        test = self.guard(call, owner, scope)
        sites: list[tuple[ast.Call, ast.AST, Scope]] = []
        if test is None and isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef):
            for site_owner, site_scope in self.scopes():
                for stmt in self.statements(site_owner):
                    sites += [
                        (c, site_owner, site_scope)
                        for c in self.own_calls(stmt)
                        if last_name(c) == owner.name
                    ]
            if not sites:
                return  # a helper this file never calls: its callers guard it, or not
        checks = [(call, test)] if not sites else [(c, self.guard(c, o, s)) for c, o, s in sites]
        for where, guard in checks:
            if guard is None:
                self.add(where, "DDP105")
            elif (local := only_local(guard, scope)) is not None:
                self.add(where, "DDP106", name=local)

    def order(self, owner: ast.AST) -> None:
        """DDP110, DDP112: what must come before CUDA starts."""
        touched: int | None = None  # the line CUDA was first used on (the driver started)
        context: int | None = None  # the line a CUDA context was first made on
        for stmt in self.statements(owner):
            for call in self.own_calls(stmt):
                name = dotted(call.func)
                if name.endswith("cuda.set_device") and context is not None:
                    self.add(call, "DDP110", line=context)
                makes = (
                    last_name(call) == "cuda"
                    or (last_name(call) == "to" and any(self.is_cuda(a) for a in call.args))
                    or self.is_cuda(keyword(call, "device"))
                )
                starts = (
                    makes
                    or (".cuda." in f".{name}" and not name.endswith("set_device"))
                    or (last_name(call) == "init_process_group" and self.nccl(call))
                )
                context = call.lineno if makes and context is None else context
                touched = call.lineno if starts and touched is None else touched
            if touched is not None and isinstance(stmt, ast.Assign) and touched < stmt.lineno:
                if any(env_key(t) == "CUDA_VISIBLE_DEVICES" for t in stmt.targets):
                    self.add(stmt, "DDP112", line=touched)

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

    # ---------------------------------------------------------------- rules over the file

    def whole_file(self) -> None:
        names = {last_name(c) for c in self.every}
        for call in self.every:
            name = last_name(call)
            if name == "init_process_group":
                if "destroy_process_group" not in names:
                    self.add(call, "DDP111")
                if self.nccl(call) and keyword(call, "device_id") is None:
                    self.add(call, "DDP109")
            elif name == "DataLoader":
                sampler, shuffle = keyword(call, "sampler"), keyword(call, "shuffle")
                if (
                    not is_none(sampler)
                    and isinstance(shuffle, ast.Constant)
                    and shuffle.value is True
                ):
                    self.add(call, "DDP104")
            elif dotted(call.func) == "torch.load":
                if keyword(call, "map_location") is None and len(call.args) < 2:
                    self.add(call, "DDP108")
            elif name == "add_argument" and any(
                isinstance(a, ast.Constant) and a.value == "--local_rank" for a in call.args
            ):
                self.add(call, "DDP113", what="an argument --local_rank")
            elif name in ("DistributedDataParallel", "DDP"):
                unused = keyword(call, "find_unused_parameters")
                if isinstance(unused, ast.Constant) and unused.value is True:
                    self.add(call, "DDP114")
            elif name == "DataParallel":
                self.add(call, "DDP116")
            elif name == "tqdm" and self.distributed and keyword(call, "disable") is None:
                self.add(call, "DDP118")
            elif name == "bincount" and unbounded_bincount(call) and self.reaches_collective(call):
                self.add(call, "DDP120", what="torch.bincount without minlength")
        self.samplers()
        for i, text in enumerate(self.lines, 1):
            if "torch.distributed.launch" in text:
                self.add(ast.Pass(lineno=i), "DDP113", what="torch.distributed.launch")
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if any(env_key(t) == "RANK" for t in node.targets):
                    self.add(node, "DDP117")
        self.key_slices()
        self.unused_modules()
        self.last_epoch()

    def reaches_collective(self, call: ast.Call) -> bool:
        """Whether the value ``call`` makes is given to a collective in the same scope."""
        for owner in ast.walk(self.tree):
            if not isinstance(owner, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for stmt in self.statements(owner):
                if any(sub is call for sub in ast.walk(stmt)) and (made := set(targets(stmt))):
                    return any(
                        is_collective(c) and made & names_in(c)
                        for s in self.statements(owner)
                        for c in self.own_calls(s)
                    )
        return False

    def samplers(self) -> None:
        """DDP103: a shuffling DistributedSampler that never hears of the epoch."""
        epochs = {
            dotted(c.func.value)
            for c in self.every
            if last_name(c) == "set_epoch" and isinstance(c.func, ast.Attribute)
        }
        named = {
            id(value): name
            for node in ast.walk(self.tree)
            if isinstance(node, ast.stmt)
            for name, value in pairs(node)
        }
        by_loader = any(e.endswith(".sampler") for e in epochs)  # loader.sampler.set_epoch
        for call in self.every:
            shuffle = keyword(call, "shuffle")
            if last_name(call) != "DistributedSampler" or (
                isinstance(shuffle, ast.Constant) and shuffle.value is False
            ):
                continue  # an evaluation sampler: one order is the point
            name = named.get(id(call))
            if name not in epochs and not by_loader:
                self.add(call, "DDP103", name=name or "(made in the DataLoader call)")

    def key_slices(self) -> None:
        """DDP115: ``k[7:]`` on the keys of a loop."""
        keys = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.For | ast.comprehension):
                target = node.target
                first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                if isinstance(first, ast.Name):
                    keys.add(first.id)
        for node in ast.walk(self.tree):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in keys
                and isinstance(node.slice, ast.Slice)
                and isinstance(node.slice.lower, ast.Constant)
                and node.slice.lower.value == len("module.")
                and node.slice.upper is None
            ):
                self.add(node, "DDP115", name=node.value.id)

    def unused_modules(self) -> None:
        """DDP119: a layer built in ``__init__`` that no other method reads."""
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            init = methods.get("__init__")
            if init is None or "forward" not in methods:
                continue
            used = {n for m in methods.values() if m is not init for n in names_in(m)}
            for stmt in ast.walk(init):
                if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)):
                    continue
                if not dotted(stmt.value.func).startswith(("nn.", "torch.nn.")):
                    continue
                for target in stmt.targets:
                    name = dotted(target)
                    if name.startswith("self.") and name not in used:
                        self.add(stmt, "DDP119", name=f"{cls.name}.{name[5:]}")

    def last_epoch(self) -> None:
        """DDP123: ``if epoch % k == 0: torch.save(...)`` and no save after the loop."""
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, ast.For)):
            if "epoch" not in dotted(loop.target).lower():
                continue
            saves = [c for c in calls_in(loop) if dotted(c.func) == "torch.save"]
            if not saves or not all(under_modulo(loop, s) for s in saves):
                continue
            later = any("save" in last_name(c) for s in self.after(loop) for c in calls_in(s))
            if not later:
                self.add(saves[0], "DDP123")


def calls_in(node: ast.AST) -> list[ast.Call]:
    """Every call in ``node`` (itself included), not in the functions defined inside it."""
    return [c for c in own_nodes([node]) if isinstance(c, ast.Call)]  # type: ignore[list-item]


def is_none(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is None)


def under_modulo(loop: ast.For, call: ast.Call) -> bool:
    """Whether ``call`` runs only under an ``if`` that tests a remainder (``epoch % k``)."""
    for node in ast.walk(loop):
        if isinstance(node, ast.If) and any(sub is call for s in node.body for sub in ast.walk(s)):
            if any(
                isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod) for b in ast.walk(node.test)
            ):
                return True
    return False


def unbounded_bincount(call: ast.Call) -> bool:
    """``torch.bincount(x)`` whose length can be this rank's largest label + 1."""
    minlength = keyword(call, "minlength")
    if minlength is None:
        return True
    options = (
        [minlength.body, minlength.orelse] if isinstance(minlength, ast.IfExp) else [minlength]
    )
    return any(isinstance(o, ast.Constant) and o.value == 0 for o in options)


def lint_source(source: str, path: str = "<string>") -> list[Finding]:
    """Every finding in one file's source (a SyntaxError is the caller's to report)."""
    return Linter(path, source).run()


def lint_paths(paths: Iterable[str | Path]) -> tuple[list[Finding], list[str]]:
    """Findings over files (folders: their ``*.py``), and the files that could not be read."""
    findings, errors = [], []
    for path in expand(paths):
        try:
            findings += lint_source(Path(path).read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(f"{path}: cannot read it ({exc})")
        except SyntaxError as exc:
            errors.append(f"{path}:{exc.lineno}: not Python the linter can parse ({exc.msg})")
    return findings, errors


def expand(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for path in map(Path, paths):
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def main(paths: Sequence[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the findings; exit status 1 if any, 2 if a file could not be read."""
    out, err = out or sys.stdout, err or sys.stderr
    if not paths:
        print("ddp-tutorial lint: give the training scripts to check (files or folders)", file=err)
        return 2
    findings, errors = lint_paths(paths)
    for finding in findings:
        print(finding.format(), file=out)
    for error in errors:
        print(error, file=err)
    if findings:
        count = len(findings)
        print(
            f"{count} finding{'s' * (count != 1)} in {len({f.path for f in findings})} file(s)",
            file=err,
        )
    return 2 if errors else 1 if findings else 0
