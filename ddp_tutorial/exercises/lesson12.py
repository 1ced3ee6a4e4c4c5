"""Lesson 12's exercises, the capstone: your own DDP.

``12_my_ddp_hooks``: rank 0's weights broadcast to every rank, and a hook on every parameter
that averages its gradient over the ranks as soon as backward has accumulated it.
``12_my_ddp_buckets`` (its judge in ``lesson12_buckets``): the same, the way DDP's reducer
does it, with buckets; both run here (``run_mine``).

Each ``run`` trains the same small MLP for a few SGD steps three ways on every rank — with the
learner's code, with ``torch.nn.parallel.DistributedDataParallel``, and with the usual wrong
answers (the gradient summed, not averaged; each rank alone) — and records how far the
learner's weights are from each, plus what the learner's code called and when: every
``dist.all_reduce`` (blocking or not), every ``wait()`` on what it returned, and every
gradient backward accumulated (hooks of the check's own, registered after the learner's).
The judges name the first mistake; the step time against DDP's (the fastest of the timed
steps, each) is said on a pass, and fails only when gross.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ddp_tutorial.exercises.core import DIVIDED_BY_2, Context, Exercise, Record
from ddp_tutorial.exercises.own_ddp import (
    BUCKET_CAP_BYTES,
    LR,
    SECOND_CAP_BYTES,
    STEPS,
    flat_weights,
    make_model,
    quickest_steps,
    references,
    train,
)
from ddp_tutorial.exercises.tracing import Trace, coverage, traced_all_reduce
from ddp_tutorial.settings import machine_load

NOT_A_TENSOR = -2  # in a layout: an entry of self.buckets that is no parameter nor its index
TOL = 1e-5  # max |w - w_DDP|: float rounding is ~1e-7 here; a wrong answer is ~1e-2 away
GROSS_SLOWDOWN = 20.0  # a step this many times DDP's is named; anything less is information
BUSY_LOAD_PER_CORE = 2.0  # above this 1-minute load per core, step times are not judged


HOOKED_TWICE = "hooks registered more than once"


def busy_host() -> bool:
    """Whether the host is so loaded that a sub-millisecond step measures its run queue: each
    bucket's wait hands over to gloo's thread and back, each hand-over waiting for a core (a
    reference answer measured 37x DDP's beside a test suite, 1.2x on a quiet host)."""
    load, cores = machine_load()
    return load > BUSY_LOAD_PER_CORE * cores


def hooks_on(params: list[torch.Tensor], post_only: bool = False) -> int:
    """The most hooks any one parameter has: post-accumulate ones (and tensor hooks)."""
    return max((len(getattr(p, "_post_accumulate_grad_hooks", None) or ())
                + (0 if post_only else len(getattr(p, "_backward_hooks", None) or ()))
                for p in params), default=0)  # fmt: skip


def run_mine(module: ModuleType, ctx: Context, bucketed: bool) -> Record:
    """Build the learner's DDP on this rank's own model, train it, compare with the references."""
    model = make_model(ctx.rank)
    params = list(model.parameters())
    trace = Trace(params)
    with traced_all_reduce(trace, module):
        if bucketed:
            mine = module.BucketedDDP(model, BUCKET_CAP_BYTES)
            buckets = _bucket_layout(mine, params)  # as built (DDP's own rebuild is allowed)
            timed, finish = mine.finish_gradient_sync, _finish_and_look(mine, trace)
            if (hooked := hooks_on(params, post_only=True)) > 1:  # each counts a grad again
                raise RuntimeError(f"{HOOKED_TWICE}: {hooked} on one parameter")
        else:
            module.broadcast_parameters(model)
            module.add_gradient_hooks(model)
            mine, finish, buckets = None, lambda: None, None
            timed = finish
        start = flat_weights(model)
        unwaited_broadcasts = trace.broadcasts_waited.count(False)  # when training begins
        copies = trace.copies  # at construction: what copied rank 0's weights, if anything
        hooks = hooks_on(params)
        for p in params:  # after the learner's hooks: these run once theirs have
            p.register_post_accumulate_grad_hook(
                lambda _p: setattr(trace, "grads", trace.grads + 1)
            )
        seconds = train(model, ctx.rank, LR, finish, trace)
    ref = references(ctx.rank, ctx.world_size)
    second = _layout_at(module, ctx.rank) if bucketed else None  # the cap read (helper 175)

    def far(other: torch.Tensor) -> float:
        return (flat_weights(model) - other).abs().max().item()

    record = {
        **_started_from(start, ctx.world_size),
        "nparams": len(params),
        "nbytes": [p.numel() * p.element_size() for p in params],
        "buckets": buckets,
        "buckets_at_second_cap": second,
        "events": list(trace.events),
        "touched": list(trace.touched),
        "same_front": trace.same_front,
        "unwaited_broadcasts": unwaited_broadcasts,
        "copies_at_start": copies,
        "hooks_per_param": hooks,
        "moved_weights": trace.moved_weights,
        "ops": sorted({e["op"] for e in trace.events if e["kind"] == "all_reduce"}),
        "from_ddp": far(ref["ddp"]),
        "from_summed": far(ref["summed"]),
        "from_halved": far(ref["halved"]),
        "from_alone": far(ref["alone"]),
        "from_own_over_world": far(ref["own_over_world"]),
    }
    # the weights are compared: now more steps of both, for the times alone (without the
    # check's look at the buckets: the learner's step only)
    record["mine_s"], record["ddp_s"] = quickest_steps(
        model, timed, ref["ddp_model"], ctx.rank, (seconds, ref["ddp_seconds"])
    )
    record["busy_host"] = busy_host()
    return record


def _started_from(start: torch.Tensor, world: int) -> Record:
    """Whether the weights training began from are rank 0's, and whose they are if any."""
    ranks = [r for r in range(world) if torch.equal(start, flat_weights(make_model(r)))]
    return {"start_is_rank0": ranks[:1] == [0], "start_from": ranks[0] if ranks else None}


def _bucket_layout(mine: Any, params: list[torch.Tensor]) -> list[list[int]] | str:
    """The learner's buckets as lists of parameter indexes (-1: a tensor not of the model;
    NOT_A_TENSOR: neither a tensor nor an index - helper 175's buckets of indexes were right),
    or their repr when they are not a list of lists."""
    index = {id(p): i for i, p in enumerate(params)}
    found = getattr(mine, "buckets", None)

    def place(p: object) -> int:
        if isinstance(p, torch.Tensor):
            return index.get(id(p), -1)
        return p if isinstance(p, int) and 0 <= p < len(params) else NOT_A_TENSOR

    try:
        return [[place(p) for p in b] for b in found]  # type: ignore[union-attr]
    except TypeError:
        return repr(found)


def _layout_at(module: ModuleType, rank: int) -> list[list[int]] | str:
    """The learner's buckets at SECOND_CAP_BYTES, on a model of its own (its broadcast and
    hooks run on it, never trained): buckets written in for this check's cap show here."""
    model = make_model(rank)
    return _bucket_layout(module.BucketedDDP(model, SECOND_CAP_BYTES), list(model.parameters()))


def _finish_and_look(mine: Any, trace: Trace) -> Callable[[], None]:
    """The learner's finish_gradient_sync, then a look at each bucket's gradients: two that
    begin with the same numbers were both copied from the front of the bucket's flat tensor
    (an offset that never advanced)."""

    def finish() -> None:
        mine.finish_gradient_sync()
        for bucket in getattr(mine, "buckets", None) or []:
            grads = [p.grad.reshape(-1) for p in bucket
                     if isinstance(p, torch.Tensor) and p.grad is not None]  # fmt: skip
            for i, a in enumerate(grads):
                for b in grads[i + 1 :]:
                    k = min(a.numel(), b.numel())
                    trace.same_front |= bool(k) and torch.equal(a[:k], b[:k])

    return finish


def run_hooks(module: ModuleType, ctx: Context) -> Record:
    return run_mine(module, ctx, bucketed=False)


def judge_start(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        if any(e["kind"] == "reduce" for e in rec["events"]):  # helper 148: read as "no hook"
            return (
                "dist.reduce leaves the sum on its dst rank alone: every rank needs the "
                "mean in its own p.grad before its step - dist.all_reduce, one collective "
                '(not a reduce and a broadcast: two) (lesson 01, "The collectives")'
            )
        if not rec["start_is_rank0"] and rec.get("start_from") not in (None, rank):
            return (f"every rank started from rank {rec['start_from']}'s weights, not rank 0's: "
                    "src is the rank that sends - dist.broadcast(p, src=0) "
                    '(lesson 04, "1 · The broadcast at construction")')  # fmt: skip
        if rec.get("unwaited_broadcasts"):  # a race: named whether or not it won this time
            this_run = ("they had arrived, by luck" if rec["start_is_rank0"] else "rank "
                        f"{rank} started from its own random weights")  # fmt: skip
            return (f"rank {rank}'s {rec['unwaited_broadcasts']} dist.broadcast(..., "
                    "async_op=True) were never waited on: nothing held training back until "
                    f"the weights had arrived (this run: {this_run}) - call .wait() on "
                    "each Work before the first forward (or leave async_op out: broadcast "
                    'returns once the weights are there) (lesson 04, "1 · The broadcast at '
                    'construction")')  # fmt: skip
        averaged = [e for e in rec["events"] if e["kind"] == "all_reduce" and e["step"] == -1]
        if not rec["start_is_rank0"] and averaged:  # helper 156: called "its own weights"
            return (f"rank {rank} started from the ranks' weights all_reduced (summed or "
                    "averaged), not from rank 0's: broadcast copies rank 0's, dist.broadcast("
                    'p, src=0) (lesson 04, "1 · The broadcast at construction")')  # fmt: skip
        if not rec["start_is_rank0"]:
            return (
                f"rank {rank} started from its own random weights, not rank 0's: broadcast "
                "every parameter from rank 0 before training (what DDP(model) does at "
                "construction), in place - into p itself (p.data, or p under torch.no_grad()), "
                "not into a copy such as p.clone() - or the replicas train apart from step 0 "
                '(lesson 04, "1 · The broadcast at construction")'
            )
    copied = any(rec.get("copies_at_start", 1) for rec in records) or any(
        e["kind"] == "all_reduce" and e["step"] == -1 for rec in records for e in rec["events"]
    )
    if not copied:  # every rank started from rank 0's weights: the check's seeds did (h. 167)
        return ("every rank started from rank 0's weights with no collective to copy them: "
                "here only because this check builds the ranks' models alike from a seed (a "
                "model loaded, or initialised otherwise, starts apart) - dist.broadcast(p, "
                "src=0) for every parameter, what DDP(model) does "
                '(lesson 04, "1 · The broadcast at construction")')  # fmt: skip
    return None


def judge_weights(records: list[Record], hint: str = "") -> str | None:
    """The weights after STEPS steps, against DDP's and the usual wrong answers' (``hint``:
    what else to look at, when the gradients were not what DDP's are)."""
    for rank, rec in enumerate(records):
        if rec["from_ddp"] <= TOL:
            continue
        if rec["from_summed"] <= TOL:
            return (
                f"rank {rank}'s weights are those of gradients SUMMED over the ranks, not "
                "averaged: divide the all_reduced gradient by the world size (a flat copy: "
                "before copying it back into p.grad - the copy divided after changes nothing) "
                '(lesson 04, "2 · Gradients are averaged, bucket by bucket")'
            )
        if rec.get("from_halved", TOL + 1) <= TOL:
            return (
                f"rank {rank}'s weights are those of the mean divided by the world size once "
                "more: the gradient was divided twice - once after the all_reduce (sum, then "
                "/ world_size) is the mean "
                '(lesson 04, "2 · Gradients are averaged, bucket by bucket")'
            )
        if rec["from_alone"] <= TOL:
            return (
                f"rank {rank} trained on its own gradients alone: nothing was averaged "
                "over the ranks (is the hook registered on every parameter? does it "
                f"write the result back into p.grad?{hint}) "
                '(lesson 12, "Your turn")'
            )
        if rec.get("from_own_over_world", TOL + 1) <= TOL:
            return (f"rank {rank}'s weights are those of its own gradient divided by the world "
                    "size: the sum of the ranks' gradients never reached p.grad - it went into a "
                    "copy (or a flat tensor rebuilt from p.grad after the all_reduce) that was "
                    "not copied back; all_reduce p.grad itself, or copy the reduced tensor back "
                    '(lesson 12, "Your turn")')  # fmt: skip
        if other := [op for op in rec.get("ops", ()) if op not in ("SUM", "AVG")]:
            return (f"rank {rank} all_reduced with op={other[0]}: not the mean of the "
                    "gradients (MAX and MIN keep one rank's number, PRODUCT multiplies them) - "
                    "the default op, SUM, then divide by the world size "
                    '(lesson 12, "Your turn")')  # fmt: skip
        if rec.get("moved_weights"):
            return (f"on rank {rank} the weights themselves changed before optimizer.step(): "
                    "the averaged gradient was written into the parameter (p.data, p.copy_), "
                    "not into p.grad - p.grad.copy_(...) there, and the optimizer moves the "
                    'weights (lesson 12, "Your turn")')  # fmt: skip
        return (
            f"after {STEPS} SGD steps rank {rank}'s weights are {rec['from_ddp']:.2g} away "
            f"from DistributedDataParallel's (allowed: {TOL:g}): each p.grad must hold the "
            f"mean of the ranks' gradients when optimizer.step() runs{hint}"
        )
    return None


def judge_hooks(records: list[Record]) -> str | None:
    mistake = judge_start(records)
    if mistake:
        return mistake
    for rank, rec in enumerate(records):
        during = [e for e in rec["events"] if e["kind"] == "all_reduce"]
        if not during and rec["from_ddp"] <= TOL:  # helper 156: all_gather, then a mean
            return (
                f"rank {rank} averaged the gradients right, without dist.all_reduce: this "
                "exercise asks for one all_reduce per gradient, the collective DDP calls "
                "(an all_gather sends every rank's copy to every rank, N times the memory)"
            )
        if not during:
            return (
                f"rank {rank} called no dist.all_reduce in backward: register the hook on "
                "every parameter (p.register_post_accumulate_grad_hook(hook)); in it, "
                "dist.all_reduce(p.grad) "
                '(lesson 12, "Your turn")'
            )
        targets = [e["target"] for e in during if e["step"] == 0]
        if any(t.startswith("param") for t in targets):
            return (
                f"rank {rank} all_reduced a parameter itself, not its gradient: in the hook, "
                "dist.all_reduce(p.grad), then divide p.grad by the world size "
                '(lesson 12, "Your turn")'
            )
        if len(targets) > 1 and len(set(targets)) == 1 and targets[0] != "other":  # one grad
            return (
                f"every hook on rank {rank} reduced the same tensor ({targets[0]}, "
                f"{len(targets)} times): the hook reads the loop's variable `p`, which holds "
                "the last parameter by the time backward runs - use the tensor the hook is "
                "given (def hook(param): ... param.grad) "
                '(lesson 12, "Your turn")'
            )
        if mistake := coverage(targets, rec["nparams"], rec.get("hooks_per_param", 0)):
            return f'rank {rank}: {mistake} (lesson 12, "Your turn")'
        if len(targets) > rec["nparams"]:
            return (f"rank {rank} called all_reduce {len(targets)} times in one backward for "
                    f"{rec['nparams']} gradients: some were reduced more than once - is a hook "
                    "registered twice (model.modules() yields a parameter once for every module "
                    'that holds it)? (lesson 12, "Your turn")')  # fmt: skip
        if rec.get("touched"):  # a race: the weights would be right or wrong by luck
            return (f"on rank {rank}, p.grad was changed (divided?) after its all_reduce(..., "
                    "async_op=True) and before the .wait() on what it returned: gloo reads and "
                    "writes it in the background, so the mean depends on which came first - "
                    "wait, then divide (or call all_reduce without async_op) "
                    '(lesson 12, "Your turn")')  # fmt: skip
        first = next((e for e in rec["events"] if e["kind"] == "step" and e["unwaited"]), None)
        if first:
            return (
                f"on rank {rank}, {first['unwaited']} all_reduce(s) with async_op=True in step "
                f"{first['step']} were never waited on before optimizer.step(): an async "
                "all_reduce may still be writing into the "
                "gradient - in this first version, call dist.all_reduce(p.grad) without "
                "async_op (it returns once the sum is there); waiting comes with the buckets "
                '(lesson 12, "Your turn")'
            )
    return judge_weights(records)


EXERCISES = [
    Exercise(
        name="12_my_ddp_hooks", lesson="12", run=run_hooks, judge=judge_hooks,
        hidden=((DIVIDED_BY_2, "the gradient is divided by 2, this check's number of ranks: "
                 "on 4 or 8 GPUs it would be 2x or 4x DDP's - divide by dist.get_world_size() "
                 "(`world`)"),
                (r"\bdst\s*=\s*1\b", "rank 0 sends its weights to rank 1 only: on 4 ranks, "
                 "ranks 2 and 3 keep their own - dist.broadcast(p, src=0) reaches every rank"),
                (r"LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE counts the processes of one machine: "
                 "on 2 machines the gradient would be divided by half the world - divide by "
                 "dist.get_world_size()"),
                (r"\.modules\(\)[^\n]*\n[^\n]*recurse\s*=\s*False", "parameters taken module "
                 "by module: one shared by two modules (tied input and output embeddings) is "
                 "hooked twice and reduced twice - model.parameters() lists each once"),),  # h. 171
        errors=(("'NoneType' object has no attribute 'register", "p.grad is None until "
                 "backward has computed it: register the hook on the parameter itself, "
                 "p.register_post_accumulate_grad_hook(hook), which runs once p.grad is set"),
                ("hook returned", "a gradient hook returned a value (torch: 'expected "
                 "Variable, but hook returned ...'): a post-accumulate-grad hook must return "
                 "None, it works on param.grad in place - a lambda returns what its expression "
                 "makes, so write the hook with def, and use the parameter it is given, not "
                 "the loop's p"),),
        when_hung=((r"broadcast\([^)\n]*\bsrc\s*=\s*(?:dist\.get_rank\(\)|rank\b)",
                    "every rank called dist.broadcast with itself as src: each one waits to "
                    "send and none receives - src is the same rank on every rank, the one whose "
                    "weights all start from: dist.broadcast(p, src=0)"),),
        title="your own DDP, 1: broadcast rank 0's weights, average each gradient from a hook",
        teaches='lesson 12, "Your turn": the broadcast at construction, a hook per parameter; '
        'lesson 04, "What DDP does with them: construction, forward, backward"',
        proves="rank 0's weights broadcast first; each gradient all_reduced once in backward; "
        "the weights after the steps equal DistributedDataParallel's",
    ),
]  # fmt: skip
