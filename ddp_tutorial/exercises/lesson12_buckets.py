"""Lesson 12's second exercise, ``12_my_ddp_buckets``: your own DDP, the way DDP's reducer
does it - the gradients grouped in buckets (in the order backward produces them), one
asynchronous all_reduce per bucket, launched from backward's hooks as soon as the bucket is
full, waited on before the optimizer step.

It runs as the first one does (``lesson12.run_mine``: the learner's code, DDP, the usual wrong
answers, and a trace of every all_reduce and wait); its judge adds the bucket layout, one
all_reduce per bucket and step, asynchronous and overlapped with backward, and the step time
against DDP's, said on a pass and failed only when gross.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ddp_tutorial.exercises.core import DIVIDED_BY_2, Context, Exercise, Record
from ddp_tutorial.exercises.lesson12 import (
    GROSS_SLOWDOWN,
    HOOKED_TWICE,
    NOT_A_TENSOR,
    TOL,
    judge_start,
    judge_weights,
    run_mine,
)
from ddp_tutorial.exercises.own_ddp import BUCKET_CAP_BYTES, SECOND_CAP_BYTES, STEPS


def expected_buckets(nbytes: list[int], cap: int = BUCKET_CAP_BYTES) -> list[list[int]]:
    """The parameters' indexes, bucketed DDP's way: walk them in reverse order of registration
    (the order backward produces their gradients), close a bucket once it holds ``cap`` bytes."""
    buckets, bucket, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        bucket.append(i)
        size += nbytes[i]
        if size >= cap:
            buckets.append(bucket)
            bucket, size = [], 0
    return buckets + ([bucket] if bucket else [])


def run_buckets(module: ModuleType, ctx: Context) -> Record:
    return run_mine(module, ctx, bucketed=True)


def per_step(rec: Record, kind: str) -> list[list[dict[str, Any]]]:
    return [
        [e for e in rec["events"] if e["kind"] == kind and e["step"] == s] for s in range(STEPS)
    ]


def _bucket_layout(got: object, want: list[list[int]], n: int) -> str | None:
    """The buckets the learner built, against DDP's rule (reverse order, closed at the cap)."""
    if not isinstance(got, list) or not got:
        return (
            f"self.buckets is {got!r}: it must hold the parameters in {len(want)} lists, "
            "the buckets "
            '(lesson 12, "Your turn")'
        )
    if any(i == NOT_A_TENSOR for b in got for i in b):
        return (f"self.buckets holds something other than parameters ({got}, -2: neither a "
                "parameter nor its index): keep the parameters themselves in each bucket, as "
                "the stub's type says (list[list[nn.Parameter]]) - the check reads your layout "
                "from them "
                '(lesson 12, "Your turn")')  # fmt: skip
    if sorted(i for b in got for i in b) != list(range(n)):
        return (
            f"your buckets hold the parameters {got} (by index, -1: not the model's): "
            f"every one of the model's {n} parameters must be in exactly one bucket "
            '(lesson 12, "Your turn")'
        )
    # the order inside a bucket is free, and so is the order of the list: the buckets go
    # as they fill, whatever their place in it (helper 117: a reversed list, the same buckets)
    if sorted(map(sorted, got)) != sorted(map(sorted, want)):
        if len(got) == n:
            return (
                f"{n} buckets of one parameter each: one all_reduce per parameter - close "
                f"a bucket only once it holds bucket_cap_bytes ({BUCKET_CAP_BYTES} B) "
                '(lesson 04, "The picture, from this run")'
            )
        if got and got[0] and got[0][0] == 0:
            return (
                f"your buckets {got} start from the first parameter registered: walk the "
                "parameters in REVERSE order of registration, DDP's rule for its first "
                "buckets (it assumes the layers run in the order they are defined, so that "
                f"backward produces the last one's gradients first) (expected {want}) "
                '(lesson 04, "The picture, from this run")'
            )
        return (
            f"your buckets are {got} (parameter indexes), expected {want}: walk the "
            "parameters in reverse, add each to the current bucket, and close it once it "
            f"holds at least bucket_cap_bytes ({BUCKET_CAP_BYTES} B) "
            '(lesson 04, "The picture, from this run")'
        )
    return None


def _at_second_cap(rec: Record) -> str | None:
    """The buckets built at SECOND_CAP_BYTES: a layout written in for this check's cap (helper
    175: three slices of the parameters passed) is the same at any cap."""
    got, want = rec["buckets_at_second_cap"], expected_buckets(rec["nbytes"], SECOND_CAP_BYTES)
    if isinstance(got, list) and sorted(map(sorted, got)) == sorted(map(sorted, want)):
        return None
    return (f"built again with bucket_cap_bytes={SECOND_CAP_BYTES}, your buckets are {got}, "
            f"expected {want} (with {BUCKET_CAP_BYTES}, this check's cap, they were right): "
            "size the buckets from the bucket_cap_bytes BucketedDDP is given, not from this "
            'check\'s layout (lesson 12, "Your turn")')  # fmt: skip


def _miscounted(rank: int, step: int, calls: int, buckets: int) -> str:
    """Not one all_reduce per bucket in a step: the likely cause by when and which way."""
    why = ("are the ready counts reset after each step?" if step else "a bucket goes when its "
           "last parameter is ready, counted in parameters (ready == len(bucket)), not in "
           "bytes: the last bucket never fills the cap" if calls < buckets
           else "was a bucket sent twice?")  # fmt: skip
    return (
        f"rank {rank} called all_reduce {calls} times in step {step}, for {buckets} "
        f'buckets: exactly one per bucket per step ({why}) (lesson 12, "Your turn")'
    )


def _bucket_traffic(rank: int, rec: Record, n: int, want: list[list[int]]) -> str | None:
    """One rank's all_reduces and waits, step by step: one per bucket, async, overlapped."""
    calls, waits, steps = (per_step(rec, k) for k in ("all_reduce", "wait", "step"))
    for s in range(STEPS):
        if len(calls[s]) == n and n != len(want):
            return (
                f"rank {rank} called all_reduce {n} times in step {s}, once per "
                f"parameter, for {len(want)} buckets: flatten each bucket's gradients "
                "into one tensor (torch.cat) and all_reduce that, once per bucket "
                '(lesson 04, "The picture, from this run")'
            )
        if len(calls[s]) != len(want):
            return _miscounted(rank, s, len(calls[s]), len(want))
        blocking = [c for c in calls[s] if not c["async_op"]]
        if blocking:
            return (
                f"rank {rank}'s all_reduce in step {s} blocked backward until it "
                "was done: call dist.all_reduce(flat, async_op=True), keep the Work "
                "it returns, and wait on it in finish_gradient_sync "
                '(lesson 11, "4 · Overlap, seen")'
            )
        if steps[s] and steps[s][0]["unwaited"]:
            return (
                f"on rank {rank}, {steps[s][0]['unwaited']} all_reduce(s) of step {s} "
                "were never waited on before optimizer.step(): an async all_reduce "
                "may still be writing into its tensor - call work.wait() on each in "
                "finish_gradient_sync, before reading the result "
                '(lesson 12, "Your turn")'
            )
        again = [rec["events"][w["id"]]["step"] for w in waits[s]]
        if any(step < s for step in again):
            return (f"rank {rank} waited in step {s} on an all_reduce of step {min(again)} "
                    "again: the list of pending Works still holds the old ones - empty it "
                    "once they are waited on, or every step waits on (and copies back) every "
                    'earlier bucket too (lesson 12, "Your turn")')  # fmt: skip
        early = [w for w in waits[s] if w["grads"] < n]
        if early:
            return (
                f"rank {rank} waited on an all_reduce while backward was still "
                "computing the earlier layers' gradients: that blocks backward until "
                "the bucket is sent - no overlap; wait in "
                "finish_gradient_sync, after backward "
                '(lesson 11, "4 · Overlap, seen")'
            )
        # the check's hooks run after the learner's: n - 1 counted = inside the last hook
        if calls[s][0]["grads"] >= n - 1:
            return (
                f"rank {rank} sent its first bucket in step {s} only once backward had "
                "produced every gradient: launch each bucket's "
                "all_reduce from the hook of its last gradient, while backward still "
                "computes the earlier layers' - that is the overlap "
                '(lesson 11, "4 · Overlap, seen")'
            )
    return None


def _flat_mistakes(records: list[Record]) -> str | None:
    """A bucket flattened from the wrong tensors, or copied back from the wrong place."""
    for rank, rec in enumerate(records):
        targets = [e["target"] for e in rec["events"] if e["kind"] == "all_reduce"]
        if any(t.startswith("param values") for t in targets):
            return (f"rank {rank} all_reduced a flat tensor of the parameters' values, not of "
                    "their gradients: flatten p.grad (torch.cat([p.grad.flatten() ...])), not "
                    'p (lesson 12, "Your turn")')  # fmt: skip
        if rec.get("same_front") and rec["from_ddp"] > TOL:
            return (f"on rank {rank}, gradients of one bucket all begin with the same numbers: "
                    "each was copied from the front of the bucket's flat tensor - advance the "
                    "offset by p.numel() after each copy, so that each parameter gets its own "
                    'slice (lesson 12, "Your turn")')  # fmt: skip
    return None


def judge_buckets(records: list[Record]) -> str | None:
    mistake = judge_start(records)
    if mistake:
        return mistake
    rec = records[0]
    want = expected_buckets(rec["nbytes"])
    n = rec["nparams"]
    got = rec["buckets"]
    mistake = _bucket_layout(got, want, n) or _at_second_cap(rec)
    if mistake:
        return mistake
    for rank, rec in enumerate(records):
        mistake = _bucket_traffic(rank, rec, n, want)
        if mistake:
            return mistake
        if rec.get("touched"):
            return (f"on rank {rank}, a bucket's flat tensor was changed (divided?) after its "
                    "all_reduce(..., async_op=True) and before its work.wait(): gloo reads and "
                    "writes it in the background, so the sum depends on which came first - "
                    'wait, then divide and copy back (lesson 12, "Your turn")')  # fmt: skip
    mistake = _flat_mistakes(records)
    if mistake:
        return mistake
    mistake = judge_weights(records, hint=READ_AFTER_WAIT)
    if mistake:
        return mistake
    ratio = max(r["mine_s"] / r["ddp_s"] for r in records)
    if ratio > GROSS_SLOWDOWN and not any(r.get("busy_host") for r in records):
        return (
            f"your step took {ratio:.0f}x DistributedDataParallel's (more than "
            f"{GROSS_SLOWDOWN:.0f}x): is every parameter all_reduced on its own, or "
            "something waited on in a loop? "
            '(lesson 11, "4 · Overlap, seen")'
        )
    return None


_NO_WORK = (
    "'NoneType' object has no attribute 'wait'",
    "dist.all_reduce returned None: without async_op=True it blocks backward until the bucket "
    "is sent (no overlap) and returns no Work to wait on - call dist.all_reduce(flat, "
    "async_op=True) and wait on what it returns in finish_gradient_sync",
)


READ_AFTER_WAIT = (
    "; is each bucket copied back only after its work.wait(), each piece into the p.grad it "
    "was flattened from (the order of the torch.cat, the same offsets)?"
)


# helper 171: a bucket sent when its last-listed parameter is ready, or when a count over all
# the gradients reaches the bucket's end, passed while the check's MLP ran in definition order
_EARLY = ("'NoneType' object has no attribute", "a gradient was still None when its bucket "
          "was flattened: either the bucket was sent before all of its gradients had arrived "
          "- count each bucket's own ready gradients and launch it at ready == len(bucket) (the "
          "check's MLP defines its layers out of the order it runs them, so neither a bucket's "
          "place in the list nor its last-listed parameter says when it is full) - or the "
          "hooks run before p.grad is set: a hook from p.register_hook is given the gradient "
          "before p.grad is set (flatten what it is given, or register "
          "p.register_post_accumulate_grad_hook, which runs once p.grad is set)")  # fmt: skip


# helper 148: a constructor that sized its buckets from p.grad, which is None before backward;
# and gradients of different shapes joined without flattening
_INIT_NONE = (("'NoneType' object has no attribute", "in __init__:"), "p.grad is None until "
              "the first backward, so the constructor cannot read it: size the buckets from "
              "the parameters themselves, p.numel() * p.element_size()")  # fmt: skip
_UNFLAT = ("Tensors must have same number of dimensions", "torch.cat joins tensors of one "
           "shape: a bucket's gradients have different shapes - flatten each first, "
           "torch.cat([p.grad.flatten() for p in bucket])")  # fmt: skip


_TWICE = (HOOKED_TWICE, "a parameter has its hook registered more than once, so each of its "
          "gradients is counted again and its bucket is launched before the others have "
          "arrived: register once per parameter - model.modules() yields a parameter once for "
          "every module that holds it; loop over model.parameters()")  # fmt: skip


# helper 171: the Works paired with the buckets by position, zip(self.pending, self.buckets);
# helper 175: an offset not reset per bucket, a slice's end without the offset, torch.split
_MISPAIRED = (
    "a bucket's sum did not fit the gradients it was copied into: copy each sum back into the "
    "parameters it was flattened from, in the same order and sizes - a slice flat[offset : "
    "offset + p.numel()] with the offset back at 0 for each bucket; and keep each Work with its "
    "flat tensor and its bucket (self.pending.append((work, flat, bucket))): the buckets are "
    "sent in the order they fill, which the check's MLP (its layers defined out of the order "
    "they run) makes neither their list's nor its reverse"
)

_NO_BUCKET = ("a parameter has no bucket: is every parameter in one - the last bucket closed "
              "after the walk, even below the cap - and bucket_of filled for each, keyed by the "
              "parameter itself (p.data is a new tensor at every access: a dict keyed by it "
              "finds nothing)?")  # fmt: skip


def timed(records: list[Record]) -> str:  # on a pass: the slowest rank's step against DDP's
    mine, ddp = max(((r["mine_s"], r["ddp_s"]) for r in records), key=lambda t: t[0] / t[1])
    return f"your step {mine * 1e3:.1f} ms, DDP's {ddp * 1e3:.1f} ms: {mine / ddp:.2f}x"


EXERCISES = [
    Exercise(
        name="12_my_ddp_buckets", lesson="12", run=run_buckets, judge=judge_buckets,
        hidden=((DIVIDED_BY_2, "the bucket is divided by 2, this check's number of ranks: on "
                 "4 or 8 GPUs the gradients would be 2x or 4x DDP's - divide by "
                 "self.world_size"),
                (r"numel\(\)\s*\*\s*4\b", "the bucket's bytes count 4 per element, a float32 "
                 "model's (this check's): a bf16 model's buckets would close at half of "
                 "bucket_cap_mb - p.numel() * p.element_size()"),),
        title="your own DDP, 2: buckets, one async all_reduce each, overlapping backward",
        teaches='lesson 12, "Your turn": buckets and overlap; lesson 04, "2 · Gradients are '
        'averaged, bucket by bucket"; lesson 11, "4 · Overlap, seen"',
        errors=(_TWICE, _NO_WORK, _INIT_NONE, _EARLY, _UNFLAT,
                ("is invalid for input of size", _MISPAIRED),
                ("split_with_sizes expects", _MISPAIRED),
                ("IndexError", _NO_BUCKET), ("KeyError", _NO_BUCKET)),
        proves="DDP's bucket layout, one async all_reduce per bucket sent during backward and "
        "waited on before the step; the weights equal DistributedDataParallel's",
        report=timed,
    ),
]  # fmt: skip
