"""What ``ddp-tutorial lint`` knows of Python code: names, calls, and what a name holds.

The linter reads one file at a time and guesses what a name holds from how it was made
(``dist.get_rank()``, ``DistributedDataParallel(...)``, a name whose ``.module`` is read)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ddp_tutorial.harness.lint_rules import (
    COLLECTIVES,
    DIST_PREFIXES,
    GLOBAL_RANK_SOURCES,
    MAIN,
    WORLD,
)


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
    return call.func.attr if isinstance(call.func, ast.Attribute) else dotted(call.func)


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
    """'RANK' for ``os.environ["RANK"]``, ``os.environ.get("RANK")``, ``os.getenv("RANK")``,
    and for a copy of the environment by its name (pytorch/examples' ``env_dict["RANK"]``)."""
    if isinstance(node, ast.Subscript) and environment(node.value):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    get = node.func if isinstance(node, ast.Call) else None
    if get is not None and (
        dotted(get).endswith("getenv")
        or (isinstance(get, ast.Attribute) and get.attr == "get" and environment(get.value))
    ):
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def environment(node: ast.AST) -> bool:
    """``os.environ``, or a name that says it holds the environment (``env``, ``env_dict``)."""
    name = dotted(node)
    return name.endswith("environ") or name.rsplit(".", 1)[-1].lower().startswith("env")


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


@dataclass
class Kept:
    """The attributes a class's methods set to a rank (``self.gpu_id = int(os.environ[
    "LOCAL_RANK"])`` in ``__init__``, tested in ``train``): what every method then knows."""

    rank: set[str] = field(default_factory=set)
    global_rank: set[str] = field(default_factory=set)
    local_rank: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, owner: ast.ClassDef) -> Kept:
        kept = cls()
        methods = [f for f in owner.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        for _ in range(2):  # `self.rank = self.gpu_id`: an attribute from another one
            for method in methods:
                scope = Scope(method.body, [a.arg for a in method.args.args], kept)
                for node in own_nodes(method.body):
                    if isinstance(node, ast.Assign):
                        for target in node.targets:
                            kept.learn(dotted(target), node.value, scope)
        return kept

    def learn(self, name: str, value: ast.expr, scope: Scope) -> None:
        if not name.startswith("self.") or name.count(".") != 1:
            return
        if scope.is_global_rank(value):
            self.global_rank.add(name)
        if scope.is_local_rank(value):
            self.local_rank.add(name)
        plain = isinstance(value, ast.Compare | ast.BoolOp | ast.UnaryOp | ast.Name | ast.Attribute)
        if name in self.global_rank | self.local_rank or plain and scope.depends_on_rank(value):
            self.rank.add(name)  # not `self.model = DDP(net.to(self.gpu_id))`


class Scope:
    """What one function (or the module's top level) makes of its names.

    ``rank``: names whose value depends on the rank (a branch on them splits the ranks);
    ``global_rank``: names that hold the global rank itself; wrappers: names that hold a
    DDP model at a given line (``net = model`` then ``net = model.module``: only before)."""

    def __init__(
        self, body: Sequence[ast.stmt], params: Iterable[str] = (), kept: Kept | None = None
    ) -> None:
        kept = kept or Kept()  # what the methods of a class keep on self (self.gpu_id = ...)
        self.rank = {p for p in params if "rank" in p.lower()} | kept.rank
        self.global_rank: set[str] = set(kept.global_rank)
        self.global_device: set[str] = set()  # device = f"cuda:{rank}", torch.device(..., rank)
        self.local_rank: set[str] = set(kept.local_rank)  # from LOCAL_RANK (`gpu = int(...)`)
        self.placements: set[str] = set()  # devices made from a rank (see _taint)
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
        self.wrapped_if: set[str] = {  # `if ddp: model = DDP(model)`: wrapped on a condition
            name
            for branch in nodes
            if isinstance(branch, ast.If)
            for stmt in own_nodes(branch.body)
            if isinstance(stmt, ast.stmt)
            for name, value in pairs(stmt)
            if isinstance(value, ast.Call)
            and last_name(value) in ("DistributedDataParallel", "DDP")
        }
        assigns = sorted(
            (s for s in nodes if isinstance(s, ast.stmt) and pairs(s)), key=lambda s: s.lineno
        )
        for _ in range(3):  # names feed each other: a few passes reach a fixed point
            self.bound = {}
            for stmt in assigns:
                for name, value in pairs(stmt):
                    self._learn(name, value, stmt.lineno)
            for sub in nodes:  # `args.save_logs = ... and is_master(args)`: attributes too
                if isinstance(sub, ast.Assign):
                    for t in (t for t in sub.targets if isinstance(t, ast.Attribute)):
                        self._taint(dotted(t), sub.value)
        self.none_by_rank = {  # `x = load() if rank == 0 else None`, or set in a rank branch:
            name  # whether x is None depends on the rank (not so for a shard made from it)
            for branch in nodes
            if isinstance(branch, ast.If) and self.depends_on_rank(branch.test)
            for stmt in own_nodes([*branch.body, *branch.orelse])
            if isinstance(stmt, ast.stmt)
            for name, _ in pairs(stmt)
        } | {
            name
            for stmt in assigns
            for name, value in pairs(stmt)
            if isinstance(value, ast.IfExp) and self.depends_on_rank(value.test)
        }

    def _learn(self, name: str, value: ast.expr, line: int) -> None:
        if self.is_global_rank(value):
            self.global_rank.add(name)
        if self.is_global_device(value):
            self.global_device.add(name)
        if self.is_local_rank(value):
            self.local_rank.add(name)
        self._taint(name, value)
        options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        status = [self.holds_wrapper(v, line) for v in options]
        wrapped = True if True in status else False if all(x is False for x in status) else None
        if isinstance(value, ast.IfExp) and (x := unwraps(value)):
            asks = isinstance(value.test, ast.Call) and last_name(value.test) == "hasattr"
            if x in self.wrapped_if or asks and dotted(value.test.args[0]) == x:  # type: ignore[attr-defined]
                wrapped = False  # nanoGPT's `model.module if ddp else model`; HF's `... if
                # hasattr(model, "module") else model`: the plain model whichever way
        self.bound.setdefault(name, []).append((line, wrapped))

    def _taint(self, name: str, value: ast.expr) -> None:
        """``torch.device("cuda", local_rank)``, ``f"cuda:{local_rank}"``: a device, which a
        test on it splits the ranks (``if device.index == 0``) and a value computed with it
        does not (DLRM's metrics of a model on this rank's GPU are every rank's); ``net.to(
        device)``, ``DDP(net, device_ids=[local_rank])``: the same model, placed."""
        if not self.depends_on_rank(value) or self.world_half(name, value):
            return
        call = value if isinstance(value, ast.Call) else None
        cuda = isinstance(value, ast.JoinedStr) and "cuda" in ast.unparse(value)
        if cuda or (call and last_name(call) == "device"):
            self.placements.add(name)
            return
        held: list[ast.expr] = [value]
        if call and isinstance(call.func, ast.Attribute) and call.func.attr in ("to", "cuda"):
            held = [call.func.value]
        elif call and last_name(call) in ("DDP", "DistributedDataParallel"):
            held = call.args[:1]
        if any(self.depends_on_rank(h) for h in held):
            self.rank.add(name)

    def world_half(self, name: str, value: ast.expr) -> bool:
        """``rank, world = rank_world()``: the world size from a helper, not from a rank."""
        named = isinstance(value, ast.Call) and WORLD.fullmatch(name.rsplit(".", 1)[-1])
        return bool(named) and not any(self.is_global_rank(n) for n in ast.walk(value))

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
        if any(at > line and w is True for at, w in self.bound.get(name, [])):
            return False  # `model = DDP(model)` comes later: here it is the plain model
        return name in self.always_wrapped

    def is_global_rank(self, node: ast.AST) -> bool:
        """``dist.get_rank()``, ``int(os.environ["RANK"])`` or a name holding one of them."""
        if isinstance(node, ast.Call) and last_name(node) == "int" and node.args:
            return self.is_global_rank(node.args[0])
        if isinstance(node, ast.Call) and last_name(node) in GLOBAL_RANK_SOURCES:
            return True
        if isinstance(node, ast.Name | ast.Attribute) and dotted(node):
            return dotted(node) in self.global_rank
        return env_key(node) == "RANK"

    def per_node(self, node: ast.AST) -> bool:
        """``rank % gpus_per_node`` (``% torch.cuda.device_count()``): the global rank brought
        to a slot of this node, a local rank where the nodes are alike."""
        return (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and (self.is_global_rank(node.left) or "rank" in dotted(node.left).lower())
        )

    def is_global_device(self, value: ast.expr) -> bool:
        """A CUDA device built from the global rank: ``f"cuda:{rank}"``, ``torch.device("cuda",
        rank)`` (assigned to a name, then passed where a GPU goes)."""
        if isinstance(value, ast.Call) and last_name(value) == "device":
            parts: list[ast.expr] = list(value.args)
        elif isinstance(value, ast.JoinedStr | ast.BinOp) and "cuda" in ast.unparse(value):
            parts = [value]
        else:
            return False
        local = {id(n) for p in parts for m in ast.walk(p) if self.per_node(m) for n in ast.walk(m)}
        held = (n for p in parts for n in ast.walk(p) if isinstance(n, ast.Name | ast.Attribute))
        return any(self.is_global_rank(n) for n in held if id(n) not in local)

    def is_local_rank(self, value: ast.expr) -> bool:
        """``int(os.environ["LOCAL_RANK"])`` or a name (``self.gpu_id``) holding it."""
        inner = value.args[0] if isinstance(value, ast.Call) and value.args else value
        if isinstance(inner, ast.Name | ast.Attribute) and dotted(inner) in self.local_rank:
            return True
        if self.per_node(value):
            return True
        return env_key(inner) == "LOCAL_RANK" or env_key(value) == "LOCAL_RANK"

    def depends_on_rank(self, node: ast.AST) -> bool:
        if launched_test(node):
            return False  # "was I started by torchrun?": the same answer on every rank
        given = {id(n) for c in calls_in(node) for a in [*c.args, *c.keywords] for n in ast.walk(a)}
        for sub in ast.walk(node):
            if self.is_global_rank(sub) or env_key(sub) in ("RANK", "LOCAL_RANK"):
                return True
            if (d := dotted(sub)) in self.placements and d and id(sub) not in given:  # `if device…`
                return True
        for name in names_in(node):  # `args.rank`, `is_master(args)`, `save = is_main()`
            if name in self.rank or "rank" in name.rsplit(".", 1)[-1].lower() or MAIN.search(name):
                return True
        return False


def unwraps(value: ast.IfExp) -> str | None:
    """``x`` for ``x.module if C else x``: the plain model whichever way C goes, when ``x``
    was wrapped under that same kind of condition."""
    body, other = value.body, value.orelse
    if isinstance(body, ast.Attribute) and body.attr == "module" and isinstance(other, ast.Name):
        return other.id if dotted(body.value) == other.id else None
    return None


def complementary(a: ast.expr, b: ast.expr) -> bool:
    """``x != v`` and ``x == v``, or ``not t`` and ``t``: every rank passes exactly one of them
    (the "rank 0 first" barriers: the others wait in one, rank 0 reaches the other later)."""
    for one, other in ((a, b), (b, a)):
        if isinstance(one, ast.UnaryOp) and isinstance(one.op, ast.Not):
            return ast.dump(one.operand) == ast.dump(other)
    one, other = _membership(a), _membership(b)
    if one is None or other is None or one[0] != other[0] or one[1] == other[1]:
        return False
    small, large = sorted((one[2], other[2]), key=len)  # `local_rank not in [-1, 0]` and
    rest = large - small  # `== 0`: -1, no launcher
    return small <= large and all(isinstance(v, int | float) and v < 0 for v in rest)


def _membership(test: ast.expr) -> tuple[str, bool, frozenset[object]] | None:
    """``x == 0`` -> (x, True, {0}); ``x not in [-1, 0]`` -> (x, False, {-1, 0}); a rank's
    ``x > 0`` or ``x >= 1`` is ``x != 0``, ``x < 1`` or ``x <= 0`` is ``x == 0`` (YOLOX)."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    op, right = test.ops[0], test.comparators[0]
    items = right.elts if isinstance(right, ast.List | ast.Tuple | ast.Set) else [right]
    values = []
    for item in items:
        number = getattr(getattr(item, "operand", None), "value", None)
        if isinstance(item, ast.UnaryOp) and isinstance(number, int | float):
            item = ast.Constant(-number if isinstance(item.op, ast.USub) else number)
        if not isinstance(item, ast.Constant):
            return None
        values.append(item.value)
    if (bound := {ast.Gt: 0, ast.GtE: 1, ast.Lt: 1, ast.LtE: 0}.get(type(op))) is not None:
        below = isinstance(op, ast.Lt | ast.LtE)
        return (ast.dump(test.left), below, frozenset({0})) if values == [bound] else None
    if not isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
        return None
    return ast.dump(test.left), isinstance(op, ast.Eq | ast.In), frozenset(values)


def launched_test(node: ast.AST) -> bool:
    """``int(os.environ.get("RANK", -1)) != -1`` or ``"RANK" in os.environ`` (nanoGPT's
    ``ddp = ...``), or ``RANK != -1`` (yolov5): whether a launcher set the variable, not which
    rank this is (-1: the default where none did)."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return False
    if (kept := _membership(node)) and all(isinstance(v, int) and v < 0 for v in kept[2]):
        return True
    left, right = node.left, node.comparators[0]
    if isinstance(node.ops[0], ast.In | ast.NotIn):
        return isinstance(left, ast.Constant) and dotted(right).endswith("environ")
    if isinstance(left, ast.Call) and last_name(left) == "int" and left.args:
        left = left.args[0]
    default = left.args[1] if isinstance(left, ast.Call) and len(left.args) > 1 else None
    return (  # the default it compares with: ast.dump, since -1 is an operator on 1
        env_key(left) is not None and default is not None and ast.dump(default) == ast.dump(right)
    )


def is_rank_test(test: ast.expr, scope: Scope) -> bool:
    """``rank == 0``, ``not rank``, ``is_main``-like names: a test only some ranks pass;
    not ``x is None`` where x is a value every rank has (a shard of the data, by rank)."""
    if isinstance(test, ast.BoolOp):
        return any(is_rank_test(part, scope) for part in test.values)
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Is | ast.IsNot)
        and is_none(test.comparators[0])
        and dotted(test.left)
        and not scope.is_global_rank(test.left)
    ):
        return dotted(test.left) in scope.none_by_rank  # None on some ranks only, or on none
    return scope.depends_on_rank(test)


def only_local(test: ast.expr, scope: Scope) -> str | None:
    """The local-rank name a guard tests when it tests no global rank ('args.local_rank'),
    or the global rank brought to a slot of the node ('rank % ngpus_per_node')."""
    for node in ast.walk(test):
        if scope.per_node(node):
            return ast.unparse(node)
    names = [
        n for n in names_in(test) if "rank" in n.rsplit(".", 1)[-1].lower() or n in scope.local_rank
    ]
    local = [n for n in names if "local" in n.lower() or n in scope.local_rank]
    if (
        local
        and len(local) == len(names)
        and not any(scope.is_global_rank(n) for n in ast.walk(test))
    ):
        return local[0]
    return None


def calls_in(node: ast.AST) -> list[ast.Call]:
    """Every call in ``node`` (itself included), not in the functions defined inside it."""
    return [c for c in own_nodes([node]) if isinstance(c, ast.Call)]  # type: ignore[list-item]


def is_none(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is None)
