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
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from ddp_tutorial.harness.lint_ast import (
    Scope,
    calls_in,
    complementary,
    dotted,
    env_key,
    is_collective,
    is_none,
    is_rank_test,
    keyword,
    last_name,
    names_in,
    pairs,
    targets,
)
from ddp_tutorial.harness.lint_keys import key_edits
from ddp_tutorial.harness.lint_rules import (
    EVALUATION,
    PARAMETER_FREE,
    RULES,
    LintFinding,
)
from ddp_tutorial.harness.lint_saves import under_modulo
from ddp_tutorial.harness.lint_scopes import ScopeChecks
from ddp_tutorial.harness.lint_tensors import cpu_tensors_in_collectives, unbounded_bincount

__all__ = ["RULES", "LintFinding", "lint_paths", "lint_source", "main"]


def sharded(data: ast.expr | None) -> bool:
    """A dataset already cut per rank, by a name that says so (``Subset(data, shard)``)."""
    if data is None:
        return True  # cannot tell: no finding
    return any("shard" in name.lower() for name in names_in(data))


class Linter(ScopeChecks):
    """Every rule over one parsed file: per scope (``ScopeChecks``), then over the file."""

    def run(self) -> list[LintFinding]:
        for owner, scope in self.scopes():
            self.rank_branches(owner, scope)
            self.devices(owner, scope)
            self.saves(owner, scope)
            self.order(owner)
            self.uneven(owner, scope)
            self.read_before_written(owner, scope)
        self.whole_file()
        self.never_synced()
        chosen = [c for c in self.every if last_name(c) == "init_process_group"]
        if any(keyword(c, "timeout") is not None for c in chosen):  # waits sized for rank 0's
            self.found = [f for f in self.found if f.code != "DDP122"]  # work (yolov5: 3 h)
        return sorted(set(self.found))

    # ---------------------------------------------------------------- rules over the file

    def rank_guarded(self) -> set[int]:
        """The calls that run on some ranks only: under an ``if`` or an ``... if ... else``
        on the rank (rank 0's progress bar)."""
        out = set()
        for owner, scope in self.scopes():
            for node in ast.walk(owner):
                if isinstance(node, ast.If | ast.IfExp) and is_rank_test(node.test, scope):
                    for part in node.body if isinstance(node.body, list) else [node.body]:
                        out.update(id(c) for c in ast.walk(part) if isinstance(c, ast.Call))
        return out

    def whole_file(self) -> None:
        names, guarded = {last_name(c) for c in self.every}, self.rank_guarded()
        legacy, chosen = self.local_rank_flag_used(names), self.loads_with_a_chosen_device()
        for call in self.every:
            name = last_name(call)
            if name == "init_process_group":
                if "destroy_process_group" not in names:
                    self.add(call, "DDP111")
                    names.add("destroy_process_group")  # said once, at the first init
                binds = {"set_device", "set_device_index"} & names  # the current GPU, set
                if self.may_be_nccl(call) and keyword(call, "device_id") is None and not binds:
                    self.add(call, "DDP109")
            elif name == "DataLoader":
                shuffle = keyword(call, "shuffle")
                if not is_none(keyword(call, "sampler")) and getattr(shuffle, "value", 0) is True:
                    self.add(call, "DDP104")
            elif dotted(call.func) == "torch.load":
                unplaced = keyword(call, "map_location") is None and len(call.args) < 2
                own = bool(call.args) and self.rank_named(call.args[0])  # a file per rank
                if unplaced and id(call) not in chosen and not own:
                    self.add(call, "DDP108")
            elif (
                name == "add_argument"
                and legacy
                and any(
                    isinstance(a, ast.Constant) and a.value in ("--local_rank", "--local-rank")
                    for a in call.args
                )
            ):  # kept for old launch commands, while LOCAL_RANK is read from the environment
                self.add(call, "DDP113", what="an argument --local_rank")
            elif name in ("DistributedDataParallel", "DDP"):
                unused = keyword(call, "find_unused_parameters")
                if isinstance(unused, ast.Constant) and unused.value is True:
                    self.add(call, "DDP114")
            elif name == "DataParallel" and not any(
                "DDP" in n or "DistributedD" in n for n in names
            ):
                self.add(call, "DDP116")  # beside DDP (or yolov5's smart_DDP): a fallback
            elif (
                name == "tqdm"
                and self.distributed
                and keyword(call, "disable") is None
                and id(call) not in guarded
            ):
                self.add(call, "DDP118")
            elif name == "bincount" and unbounded_bincount(call) and self.reaches_collective(call):
                self.add(call, "DDP120", what="torch.bincount without minlength")
        self.samplers()
        for i, text in enumerate(self.code_lines(), 1):
            if "torch.distributed.launch" in text:
                self.add(ast.Pass(lineno=i), "DDP113", what="torch.distributed.launch")
        self.rank_constants()
        for node, code, fields in key_edits(self.tree):
            self.add(node, code, **fields)
        self.unused_modules()
        self.last_epoch()
        self.unsampled_loaders()
        bodies = (owner.body for owner, _ in self.scopes())
        for call, what, line in cpu_tensors_in_collectives(self.tree, bodies):
            self.add(call, "DDP128", what=what, line=line)

    def local_rank_flag_used(self, names: set[str]) -> bool:
        """Whether a --local_rank argument here is the one the script goes by: not where
        LOCAL_RANK is read from the environment, nor where its value is never read here and
        a helper joins the group (DINO's ``init_distributed_mode(args)``, MAE, timm)."""
        if any(env_key(n) == "LOCAL_RANK" for n in ast.walk(self.tree)):
            return False
        read = {n.attr for n in ast.walk(self.tree) if isinstance(n, ast.Attribute)}
        return "local_rank" in read or not any(n.startswith("init_dist") for n in names)

    def loads_with_a_chosen_device(self) -> set[int]:
        """torch.load without map_location on one side of an ``if`` whose other side loads
        with one: the author chose (pytorch/examples' ``if args.gpu is None``)."""
        out = set()
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.If) or not node.orelse:
                continue
            sides = [
                [
                    c
                    for s in side
                    for c in ast.walk(s)
                    if isinstance(c, ast.Call) and dotted(c.func) == "torch.load"
                ]  # fmt: skip
                for side in (node.body, node.orelse)
            ]
            for one, other in (sides, sides[::-1]):
                if any(keyword(c, "map_location") is not None for c in other):
                    out.update(id(c) for c in one)
        return out

    def unsampled_loaders(self) -> None:
        """DDP125: a DataLoader with no sampler that a loop with a backward() iterates."""
        if not self.distributed:
            return
        loaders = {  # name: its DataLoader(...) call, with neither sampler nor batch_sampler
            name: value
            for node in ast.walk(self.tree)
            if isinstance(node, ast.stmt)
            for name, value in pairs(node)
            if isinstance(value, ast.Call)
            and last_name(value) == "DataLoader"
            and len(value.args) < 4  # DataLoader(data, batch_size, shuffle, sampler, ...)
            and keyword(value, "sampler") is None
            and keyword(value, "batch_sampler") is None
            and not sharded(value.args[0] if value.args else keyword(value, "dataset"))
        }
        handed = {  # Fabric's setup_dataloaders, Accelerate's prepare: they add the sampler
            name
            for c in self.every
            if last_name(c) in ("setup_dataloaders", "prepare", "prepare_data_loader")
            for a in c.args
            for name in names_in(a)
        }
        loaders = {name: call for name, call in loaders.items() if name not in handed}
        for loop in (n for n in ast.walk(self.tree) if isinstance(n, ast.For)):
            if not any(last_name(c) == "backward" for c in calls_in(loop)):
                continue
            for name in sorted(names_in(loop.iter) & set(loaders)):
                self.add(loaders[name], "DDP125", name=name)

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

    def rank_constants(self) -> None:
        """DDP117: RANK set to a constant, unless only where no launcher set it."""
        fallback = {  # `if "RANK" not in os.environ: os.environ["RANK"] = "0"`: a world of one
            id(sub)
            for node in ast.walk(self.tree)
            if isinstance(node, ast.If) and "environ" in ast.unparse(node.test)
            and any(isinstance(op, ast.NotIn) for c in ast.walk(node.test)
                    if isinstance(c, ast.Compare) for op in c.ops)
            for stmt in node.body
            for sub in ast.walk(stmt)
        }  # fmt: skip
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if any(env_key(t) == "RANK" for t in node.targets) and id(node) not in fallback:
                    self.add(node, "DDP117")

    def samplers(self) -> None:
        """DDP103: a shuffling DistributedSampler that never hears of the epoch."""
        epochs = {
            dotted(c.func.value)
            for c in self.every
            if last_name(c) == "set_epoch" and isinstance(c.func, ast.Attribute)
        }
        named = {  # each DistributedSampler(...) -> the name (or self.x) it is bound to, also
            id(sub): dotted(target)  # through `... if ddp else None`
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if dotted(target)
            for sub in ast.walk(node.value)
            if isinstance(sub, ast.Call) and last_name(sub) == "DistributedSampler"
        }
        held = {  # loader -> its sampler: a name, or the DistributedSampler(...) made in it
            dotted(target): sampler
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and last_name(node.value) == "DataLoader"
            and (sampler := keyword(node.value, "sampler")) is not None
            for target in node.targets
            if dotted(target)
        }  # fmt: skip
        inline = {  # made in the DataLoader call, also through `... if ddp else None`
            id(sub): loader
            for loader, s in held.items()
            for sub in ast.walk(s)
            if isinstance(sub, ast.Call) and last_name(sub) == "DistributedSampler"
        }
        named = {at: name for at, name in named.items() if at not in inline}  # not the loader's
        told = {at for at, loader in inline.items() if f"{loader}.sampler" in epochs}
        epochs |= {dotted(s) for e in epochs if e.endswith(".sampler")
                   and isinstance(s := held.get(e[: -len(".sampler")]), ast.Name | ast.Attribute)
                   } - {""}  # fmt: skip
        # a loader or a name this file cannot resolve (a helper's parameter, a loop over
        # samplers, samplers["train"], loaders["val"].sampler): it may be any of them
        lenient = any(e not in named.values() and e[: -len(".sampler")] not in held for e in epochs)
        for call in self.every:
            shuffle = keyword(call, "shuffle")
            if last_name(call) != "DistributedSampler" or (
                isinstance(shuffle, ast.Constant) and shuffle.value is False
            ):
                continue  # an evaluation sampler: one order is the point
            name = named.get(id(call))
            evaluation = EVALUATION.search(name or inline.get(id(call), ""))
            if id(call) in told or name in epochs or lenient or evaluation:
                continue  # an evaluation's (test_sampler): its order changes nothing
            if name is None and (loader := inline.get(id(call))):
                self.add(call, "DDP103", name=f"of {loader}", fix=f"{loader}.sampler")
            else:
                self.add(call, "DDP103", name=name or "(made in the DataLoader call)",
                         fix=name or "loader.sampler")  # fmt: skip

    def unused_modules(self) -> None:
        """DDP119: a layer built in ``__init__`` that no other method reads."""
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            init = methods.get("__init__")
            if init is None or "forward" not in methods:
                continue
            used = {n for m in methods.values() if m is not init for n in names_in(m)}
            used |= {  # frozen in __init__ (`self.teacher.requires_grad_(False)`): no gradient
                dotted(c.func.value)  # type: ignore[attr-defined]
                for c in ast.walk(init)
                if isinstance(c, ast.Call)
                and last_name(c) == "requires_grad_"
                and isinstance(c.func, ast.Attribute)
            }
            for stmt in ast.walk(init):
                if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)):
                    continue
                kind = dotted(stmt.value.func)
                if not kind.startswith(("nn.", "torch.nn.")) or PARAMETER_FREE.fullmatch(
                    kind.rsplit(".", 1)[-1]
                ):
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
            saves = [c for c in calls_in(loop) if dotted(c.func) == "torch.save" or self.saver(c)]
            if not saves or not all(under_modulo(loop, s) for s in saves):
                continue
            later = any("save" in last_name(c) for s in self.after(loop) for c in calls_in(s))
            if not later:
                self.add(saves[0], "DDP123")

    def never_synced(self) -> None:
        """DDP126: every ``backward()`` of the file inside ``with ... no_sync():``."""
        synced_off = {
            id(call)
            for node in ast.walk(self.tree)
            if isinstance(node, ast.With)
            and any(
                isinstance(item.context_expr, ast.Call)
                and last_name(item.context_expr) == "no_sync"
                for item in node.items
            )
            for call in calls_in(node)
        }
        backwards = [c for c in self.every if last_name(c) == "backward"]
        if backwards and all(id(c) in synced_off for c in backwards):
            self.add(backwards[0], "DDP126")

    def read_before_written(self, owner: ast.AST, scope: Scope) -> None:
        """DDP127: rank 0 saves a file, then other ranks load it with nothing between that
        waits for the write (a barrier, or any collective rank 0 joins after it)."""
        saved: dict[str, ast.expr] = {}  # the path as written -> the rank test of its save
        for stmt in self.statements(owner):
            for call in self.own_calls(stmt):
                if self.waits(call):
                    saved.clear()
                    continue
                kind = dotted(call.func)
                if kind not in ("torch.save", "torch.load"):
                    continue
                where = call.args[kind == "torch.save"] if len(call.args) > (
                    kind == "torch.save") else keyword(call, "f")  # fmt: skip
                guard = self.guard(call, owner, scope)
                if where is None:
                    continue
                if kind == "torch.save" and guard is not None:
                    saved[ast.unparse(where)] = guard
                elif kind == "torch.load" and (test := saved.get(ast.unparse(where))) is not None:
                    if guard is None or complementary(guard, test):  # every rank, the others
                        self.add(call, "DDP127", path=ast.unparse(where))

    def waits(self, call: ast.Call) -> bool:
        """A call every rank waits in: a collective, DDP's constructor (a broadcast),
        Accelerate's ``wait_for_everyone``, or a function of this file that runs one
        (detectron2's ``synchronize()``)."""
        if is_collective(call) or last_name(call) in ("DDP", "DistributedDataParallel",
                                                      "wait_for_everyone"):  # fmt: skip
            return True
        helper = self.functions.get(call)
        return helper is not None and any(
            is_collective(c) for stmt in helper.body for c in calls_in(stmt)
        )

    def saver(self, call: ast.Call) -> bool:
        """A call of this file's function (or method) that itself calls torch.save: the
        official series' ``self._save_snapshot(epoch)``."""
        helper = self.functions.get(call)
        return helper is not None and any(
            dotted(c.func) == "torch.save" for c in ast.walk(helper) if isinstance(c, ast.Call)
        )


def lint_source(source: str, path: str = "<string>") -> list[LintFinding]:
    """Every finding in one file's source (a SyntaxError is the caller's to report)."""
    return Linter(path, source).run()


def lint_paths(paths: Iterable[str | Path]) -> tuple[list[LintFinding], list[str]]:
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
    for empty in [p for p in map(Path, paths) if p.is_dir() and not expand([p])]:
        print(f"ddp-tutorial lint: no Python file in {empty}: nothing checked there", file=err)
    if not expand(paths):
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
    elif not errors:  # said on stderr: a clean run's stdout stays empty for scripts
        print(f"no findings in {len(expand(paths))} file(s)", file=err)
    return 2 if errors else 1 if findings else 0
