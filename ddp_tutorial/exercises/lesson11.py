"""Lesson 11's first exercise: a mixed-precision step (autocast, a GradScaler, ``no_sync``).

``11_amp_step``: the learner's ``amp_step`` runs one float16 step on every rank, which is
compared with float32 on the global batch, then a step with an inf in one rank's gradient,
which every rank must skip; what it returns (the loss a loop logs) and whether backward ran
under autocast are read too. The comm-hook exercise is in ``lesson11_hook``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.noting import noted
from ddp_tutorial.exercises.spies import spying

AMP_LR, AMP_SCALE, AMP_TOL = 0.1, 1024.0, 2e-2  # SGD; the scaler's first scale; float16 vs 32
# step 0: 4 micro-batches in float16; step 1 (an inf, skipped): 2 in bfloat16 - an answer that
# fits one call (no_sync on micro-batch 0 alone, float16 whatever the dtype) shows in the other;
# step 2: 3 in bfloat16, no inf, its size against float32's (a bf16 backward left unscaled
# while scaler.step unscales shows only there: step 1's step is skipped)
AMP_MICRO, AMP_DTYPES = (4, 2, 3), (torch.float16, torch.bfloat16, torch.bfloat16)
# samples per rank and step: micro-batches of 3 and 6, so that a loss divided by len(x) (3) is
# not taken for one divided by the world size (2)
AMP_PER_RANK = 12


def ready_for_ddp(ctx: Context) -> None:
    """DDP's constructor imports torch._dynamo before its first collective: seconds on a busy
    machine, and not the same seconds on every rank. Imported here, then the ranks meet in
    torchrun's store (no collective timeout there), so a slow import cannot pass for a hang."""
    import torch._dynamo  # noqa: F401

    from ddp_tutorial.exercises.runner import meet  # not at the top: the runner imports us

    meet(ctx, "dynamo-imported")


def amp_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: AMP_PER_RANK samples per rank."""
    g, n = torch.Generator().manual_seed(100 + step), AMP_PER_RANK * world_size
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def amp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _flat(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach()


class _Watch:
    """What DDP did in one step: after how many forwards (micro-batches) each all_reduce ran,
    and the dtypes the first layer computed in."""

    def __init__(self, model: DDP) -> None:
        self.forwards, self.after, self.dtypes = 0, [], set()
        model.register_comm_hook(None, self._sent)
        model.module.register_forward_pre_hook(self._forward)
        model.module[0].register_forward_hook(lambda m, i, out: self.dtypes.add(str(out.dtype)))

    def _sent(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        self.after.append(self.forwards)  # which micro-batch's backward sent it
        return default_hooks.allreduce_hook(None, bucket)

    def _forward(self, module: nn.Module, inputs: Any) -> None:
        self.forwards += 1

    def reset(self) -> None:
        self.forwards, self.after, self.dtypes = 0, [], set()


@contextmanager
def noting_clips(scaler: torch.amp.GradScaler, module: ModuleType,
                 calls: list[str]) -> Iterator[None]:  # fmt: skip
    """The learner's ``clip_grad_norm_`` and ``scaler.unscale_`` calls, in order, in ``calls``
    (``scaler.step`` unscales too, when the learner has not)."""
    real = scaler.unscale_

    def unscale(optimizer: torch.optim.Optimizer) -> None:
        calls.append("unscale")
        real(optimizer)

    scaler.unscale_ = unscale  # type: ignore[method-assign]
    try:
        with spying(("clip_grad_norm_",), lambda *_: calls.append("clip"), module,
                    source=torch.nn.utils):  # fmt: skip
            yield
    finally:
        del scaler.unscale_  # the class's own again


def _watch_backward(model: nn.Module, ctx: Context, record: Record) -> list[bool]:
    """Whether autocast was on while backward ran (CPU: on this thread), one entry per
    backward; and, in ``record``, what step 0 must return: this rank's mean loss, float32."""
    cast_backward: list[bool] = []
    model.module[2].weight.register_hook(
        lambda grad: cast_backward.append(torch.is_autocast_enabled("cpu"))
    )
    with torch.no_grad():
        x, y = amp_batch(0, ctx.world_size)
        mine = slice(AMP_PER_RANK * ctx.rank, AMP_PER_RANK * (ctx.rank + 1))
        record["loss"] = nn.functional.cross_entropy(amp_model()(x[mine]), y[mine]).item()
    return cast_backward


def run_amp(module: ModuleType, ctx: Context) -> Record:
    """Step 0: the learner's float16 step against float32 on the global batch; step 1: an inf
    in rank 1's first micro-batch gradient (inside no_sync). DDP's all_reduces are counted."""
    ready_for_ddp(ctx)
    model = DDP(amp_model())
    watch = _Watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=AMP_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_SCALE)
    record: Record = {"allreduces": [], "allreduce_after": [], "dtypes": [], "returned": [],
                      "zeroed": []}  # fmt: skip
    calls: list[str] = []  # the learner's clip_grad_norm_ and unscale_ calls, in order
    cast_backward = _watch_backward(model, ctx, record)
    zeroed: list[str] = []  # each zero_grad of a step (helper 134: one per micro-batch)
    for owner in (optimizer, model):
        owner.zero_grad = noted(owner.zero_grad, zeroed)  # type: ignore[method-assign]

    def step(n: int) -> None:
        x, y = amp_batch(n, ctx.world_size)
        mine = slice(AMP_PER_RANK * ctx.rank, AMP_PER_RANK * (ctx.rank + 1))
        k = AMP_MICRO[n]
        micro = list(zip(x[mine].chunk(k), y[mine].chunk(k), strict=True))
        watch.reset()
        zeroed.clear()
        with noting_clips(scaler, module, calls):
            returned = module.amp_step(model, micro, optimizer, scaler, AMP_DTYPES[n])
        record["zeroed"].append(len(zeroed))
        record["returned"].append(returned if isinstance(returned, float | int) else repr(returned))
        record["allreduces"].append(len(watch.after))
        record["allreduce_after"].append(list(watch.after))
        record["dtypes"].append(sorted(watch.dtypes))

    before = _flat(model)
    step(0)
    record["skipped_0"] = scaler.get_scale() < AMP_SCALE  # no inf was put in step 0
    reference = amp_model()  # float32, one process, the global batch
    x, y = amp_batch(0, ctx.world_size)
    nn.functional.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        want = torch.cat([-AMP_LR * p.grad.reshape(-1) for p in reference.parameters()])
    got = _flat(model) - before
    record["ratio"] = (got.norm() / want.norm()).item()
    record["gap"] = ((got - want).abs().max() / want.abs().max()).item()
    record["clipped_scaled"] = "clip" in calls and calls.index("clip") < (
        calls.index("unscale") if "unscale" in calls else len(calls)
    )
    hook = model.module[0].weight.register_hook(_inf_first()) if ctx.rank == 1 else None
    before, scale = _flat(model), scaler.get_scale()
    step(1)
    record["scale_kept"] = scaler.get_scale() >= scale  # update() halves it after a skip
    if hook is not None:
        hook.remove()
    after = _flat(model)
    record.update(
        bf16_ratio=_next_step_ratio(model, step, ctx.world_size),  # after `after`: step 2
        cast_backward=any(cast_backward),
        inf_moved=not torch.equal(before, after),
        finite=bool(torch.isfinite(after).all()),
        weights=after.tolist(),
    )
    return record


def _inf_first() -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook: rank 1's first micro-batch (inside no_sync: nothing sent yet) gets an
    inf; the later calls pass through."""
    calls: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad.clone().fill_(float("inf")) if len(calls) == 1 else grad

    return hook


def _next_step_ratio(model: DDP, step: Callable[[int], None], world: int) -> float:
    """Step 2 (bfloat16, no inf) against float32's SGD step on its global batch: size ratio."""
    reference = amp_model()
    reference.load_state_dict(model.module.state_dict())
    before = _flat(model)
    step(2)
    x, y = amp_batch(2, world)
    nn.functional.cross_entropy(reference(x), y).backward()
    want = torch.cat([-AMP_LR * p.grad.reshape(-1) for p in reference.parameters()])
    return ((_flat(model) - before).norm() / want.norm()).item()


def judge_amp(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        if not rec["finite"]:
            return (f"rank {rank}'s weights became inf after a step with an inf gradient: "
                    "step through the scaler, scaler.step(optimizer), which skips it - in "
                    "bfloat16 too: bf16 needs no scaling, but its step must still skip an "
                    "inf, and the scaler given here does both")  # fmt: skip
        if rec["ratio"] == 0 and rec.get("skipped_0"):
            return ("step 0 was skipped: the scaler found an inf in float16 gradients that held "
                    "none - the loss was scaled twice (scaler.scale(scaler.scale(loss)), or "
                    "times scaler.get_scale()), and they overflowed: scale it once")  # fmt: skip
        if rec["ratio"] == 0:
            return ("the weights never moved: after the micro-batches, scaler.step(optimizer), "
                    "then scaler.update()")  # fmt: skip
        if any(
            z >= k > 1 for z, k in zip(rec.get("zeroed", []), AMP_MICRO, strict=False)
        ):  # one a batch
            return ("zero_grad ran in every micro-batch: the gradients of the ones before were "
                    "thrown away (an inf in one of them too) - zero once a step, before the "
                    "first micro-batch or after scaler.step")  # fmt: skip
        k, after = AMP_MICRO[0], rec["allreduce_after"][0]
        if k not in after and len(after) > 1:
            return (f"DDP all-reduced in the backward of micro-batches "
                    f"{', '.join(map(str, after))} of {k}, not the last: model.no_sync() on "
                    "every micro-batch but the last (not around the last one), so that one "
                    "all_reduce carries their sum")  # fmt: skip
        if rec["allreduces"][0] != 1:
            return (f"DDP all-reduced {rec['allreduces'][0]} times in one step of {k} "
                    "micro-batches: all but the last run under model.no_sync(), so that one "
                    "all_reduce carries their sum")  # fmt: skip
        if rec["allreduce_after"][0] != [k]:
            return (f"DDP's all_reduce ran in the backward of micro-batch "
                    f"{rec['allreduce_after'][0][0]} of {k}, not the last: model.no_sync() on "
                    "every micro-batch but the last, so that the last one's all_reduce carries "
                    "the sum of them all")  # fmt: skip
        for n, dtype in enumerate(AMP_DTYPES):
            want = str(dtype).removeprefix("torch.")
            if rec["dtypes"][n] != [str(dtype)]:
                return (f"the forward of step {n} ran in {', '.join(rec['dtypes'][n]) or 'nothing'}"
                        f", not in the {want} asked for: forward and loss under "
                        "torch.autocast(x.device.type, dtype=dtype)")  # fmt: skip
        if rec["allreduces"][1] != 1:
            return (f"DDP all-reduced {rec['allreduces'][1]} times in step 1, of "
                    f"{AMP_MICRO[1]} micro-batches: all but the last under model.no_sync() - "
                    "whatever their number")  # fmt: skip
        if rec["inf_moved"]:
            return (f"rank {rank} stepped although rank 1's gradient held an inf: the scaler "
                    "must see the gradients after DDP's all_reduce: one scaler.step, after the "
                    "last micro-batch")  # fmt: skip
        if mistake := _judge_step(rec):
            return mistake
    if any(rec["weights"] != records[0]["weights"] for rec in records):
        return "the ranks ended with different weights: every rank must step alike"
    return None


def _judge_step(rec: Record) -> str | None:
    """The step's size against float32's on the global batch, and the scale after the skip."""
    if rec["clipped_scaled"]:
        return (f"clip_grad_norm_ saw the scaled gradients ({AMP_SCALE:g} times too large): call "
                "scaler.unscale_(optimizer) before clipping "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if abs(rec["ratio"] / AMP_MICRO[0] - 1) < 0.1:
        return (f"the step was {rec['ratio']:.2g} times float32's on the global batch: "
                "divide each micro-batch's loss by their number (accum)")  # fmt: skip
    if abs(rec["ratio"] * AMP_MICRO[0] - 1) < 0.1:
        return (f"the step was {rec['ratio']:.2g} times float32's on the global batch: the loss "
                "was divided by accum twice - the loop divides it already (`loss / accum`, "
                "above your lines): scale that loss as it is")  # fmt: skip
    if abs(rec["ratio"] * AMP_PER_RANK / AMP_MICRO[0] - 1) < 0.1:
        return (f"the step was {rec['ratio']:.2g} times float32's on the global batch: the loss "
                "was divided by len(x) too - cross_entropy averages over the micro-batch's "
                "samples already (reduction='mean'): divide by accum only")  # fmt: skip
    if abs(rec["ratio"] * 2 - 1) < 0.1:
        return (f"the step was {rec['ratio']:.2g} times float32's on the global batch: the loss "
                "was divided once too often - by accum only (DDP averages over the ranks "
                "already: not by the world size too)")  # fmt: skip
    if abs(rec["ratio"] * AMP_SCALE - 1) < 0.1:  # helper 162: scaler.scale(loss) not kept
        return (f"the step was 1/{AMP_SCALE:g} of float32's on the global batch: backward ran on "
                "the unscaled loss, and scaler.step divided the gradients by the scale all the "
                "same - backward on the scaled loss: to_backward = scaler.scale(loss)")  # fmt: skip
    if rec["gap"] > AMP_TOL:
        return (f"the step differs from float32's on the global batch by {rec['gap']:.2g} of "
                f"its largest element (float16 rounding stays below {AMP_TOL:g})")  # fmt: skip
    if rec["scale_kept"]:
        return ("after the step with an inf the scale did not halve: scaler.update() after "
                "every scaler.step, whatever the dtype, with no argument - it lowers the scale "
                "after a skipped step (update(new_scale) sets it)")  # fmt: skip
    if abs(rec.get("bf16_ratio", 1.0) - 1) > 0.1:  # step 2: bf16, no inf
        return (f"the bfloat16 step was {rec['bf16_ratio']:.2g} times float32's on the global "
                "batch: scaler.step divides the gradients by the scale, so backward must run "
                "on scaler.scale(loss) in every dtype (bf16 needs no scaling, but a scaler "
                "that steps unscales what it assumes it scaled)")  # fmt: skip
    return _judge_returned(rec)


def _judge_returned(rec: Record) -> str | None:
    """The loss amp_step returns (what a loop logs), and backward outside autocast."""
    got, want = rec["returned"][0], rec["loss"]
    if not isinstance(got, float | int):
        return f"amp_step returned {got}, not the step's loss (a float)"
    if abs(got - AMP_SCALE * want) < 0.05 * AMP_SCALE * want:
        return (f"amp_step returned {got:.4g}, the loss times the scale ({AMP_SCALE:g}): log the "
                "loss itself; only backward() gets scaler.scale(loss)")  # fmt: skip
    if abs(got - want) > 0.05 * want:
        return (f"amp_step returned {got:.4g}; the step's loss is {want:.4g}: the sum of each "
                "micro-batch's loss / accum, their mean")  # fmt: skip
    if rec.get("cast_backward"):
        return ("backward() ran inside torch.autocast: the numbers come out the same here, but "
                "autocast wraps the forward and the loss only - backward runs outside the "
                "block (torch's AMP docs), in the dtypes autocast chose for each op of the "
                "forward")  # fmt: skip
    return None


AMP_ERRORS = (  # GradScaler's own errors, for both scaler exercises (06 and 11)
    ("but _scale is None", "backward() did not run on scaler.scale(loss): the scaler scales "
     "the loss itself, so that it knows what to unscale (fp16: small gradients stay above 0)"),
    ("No inf checks were recorded prior to update", "scaler.update() found no "
     "scaler.step(optimizer) before it in this step (also on a rank whose step sits under "
     "`if rank == 0`: every rank steps and updates its own scaler): first "
     "scaler.step(optimizer) - not optimizer.step(): it unscales the gradients and skips a "
     "step with inf or nan - then scaler.update()"),
    ("No inf checks were recorded for this optimizer", "scaler.step(optimizer) ran before "
     "any backward had put a gradient in: the scaler had no gradient to check for inf - step "
     "once, after the last micro-batch's scaler.scale(loss).backward()"),
    ("step() has already been called since the last update()", "scaler.step(optimizer) twice "
     "without scaler.update() between: call scaler.update() after every scaler.step"),
    ("unscale_() is being called after step()", "scaler.unscale_(optimizer) ran after a "
     "scaler.step(optimizer) with no scaler.update() between: the scaler was not updated after "
     "its last step (update() before step(), or on rank 0 only), or unscale_ came after the "
     "step - every step, on every rank, scaler.step(optimizer), then scaler.update(), and "
     "unscale_ only before the step (before clipping)"),
    ("unscale_() has already been called on this optimizer since the last update()",
     "scaler.unscale_(optimizer) twice in one step, or a step without scaler.update(): call "
     "unscale_ once, before clipping, and scaler.update() after every scaler.step"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="11_amp_step", lesson="11", run=run_amp, judge=judge_amp,
        hidden=((r"autocast\(\s*(?:device_type\s*=\s*)?[\"']cpu[\"']", "autocast(\"cpu\", ...) "
                 "casts only what runs on the CPU: on a GPU the forward stays in float32, no "
                 "mixed precision at all - name the tensors' device type, x.device.type"),),
        title="a mixed-precision step with accumulation: autocast, GradScaler, no_sync",
        teaches='lesson 11, "1 · Mixed precision under DDP"',
        errors=(*AMP_ERRORS, ("backward through the graph a second time", "backward ran twice "
                "on one micro-batch's graph: a backward of your own and the stub's "
                "`to_backward.backward()` - assign to_backward (scaler.scale(loss) for float16) "
                "and let that line run it")),  # helper 158: torch's raw error  # fmt: skip
        proves=(
            "the forward in the dtype asked for (float16, then bfloat16), one all_reduce on the "
            "last micro-batch of 4 and of 2, the inf step skipped by "
            "the scaler and its scale halved, the step equal to float32's on the global batch, "
            "the same on every rank"
        ),
    ),
]  # fmt: skip
