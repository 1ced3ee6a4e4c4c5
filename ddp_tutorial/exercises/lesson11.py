"""Lesson 11's exercises: a comm hook that compresses the gradients to bf16; a mixed-precision step.

``11_amp_step``: the learner's ``amp_step`` (autocast, a GradScaler, ``no_sync`` accumulation)
runs one float16 step on every rank, which is compared with float32 on the global batch, then a
step with an inf in one rank's gradient, which every rank must skip.
``11_bf16_hook``: the learner writes the hook torch ships as ``default_hooks.bf16_compress_hook``.
``run`` trains two copies of one model side by side on every rank: plain DDP, and DDP with the
learner's hook; it records both gradients and what the hook handed to ``dist.all_reduce``
(dtype, bytes). The judge names the first mistake: nothing sent, float32 sent, the sum instead
of the mean, ranks that disagree, or gradients further from DDP's than bf16's rounding.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.spies import is_async, spying

AMP_LR, AMP_SCALE, AMP_TOL = 0.1, 1024.0, 2e-2  # SGD; the scaler's first scale; float16 vs 32
# step 0: 4 micro-batches in float16; step 1 (an inf, skipped): 2 in bfloat16 - an answer that
# fits one call (no_sync on micro-batch 0 alone, float16 whatever the dtype) shows in the other
AMP_MICRO, AMP_DTYPES = (4, 2), (torch.float16, torch.bfloat16)
# samples per rank and step: micro-batches of 3 and 6, so that a loss divided by len(x) (3) is
# not taken for one divided by the world size (2)
AMP_PER_RANK = 12

STEPS = 2  # two steps: a hook must work again once DDP has rebuilt its buckets
TOLERANCE = 1e-2  # max |grad - DDP's grad| / max |DDP's grad|: bf16 keeps 8 significant bits
LATE_S = 0.5  # rank 1 starts the hooked backward this late: rank 0's sum cannot arrive sooner


def ready_for_ddp(ctx: Context) -> None:
    """DDP's constructor imports torch._dynamo before its first collective: seconds on a busy
    machine, and not the same seconds on every rank. Imported here, then the ranks meet in
    torchrun's store (no collective timeout there), so a slow import cannot pass for a hang."""
    import torch._dynamo  # noqa: F401

    from ddp_tutorial.exercises.runner import meet  # not at the top: the runner imports us

    meet(ctx, "dynamo-imported")


def grads(model: nn.Module) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def run_hook(module: ModuleType, ctx: Context) -> Record:
    """Plain DDP and DDP with the learner's hook, the same model and data; what each computed."""
    ready_for_ddp(ctx)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    plain, hooked = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    alone = copy.deepcopy(base)  # this rank's own gradients, nothing averaged
    buckets: list[int] = []  # the hook's calls, one per bucket, in this step

    # per call: (whether the Future the hook returned had its sum, when the hook was entered)
    done_at_return: list[tuple[bool, float]] = []

    @functools.wraps(module.bf16_compress_hook)  # DDP checks the learner's signature
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buckets.append(1)
        entered = time.monotonic()  # one clock for every process of this machine
        future = module.bf16_compress_hook(state, bucket)
        done_at_return.append((bool(getattr(future, "done", lambda: False)()), entered))
        return future

    hooked.register_comm_hook(None, hook)
    sent: list[tuple[str, int, bool]] = []

    def note(_: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensor = args[0] if args else kwargs["tensor"]
        size = tensor.numel() * tensor.element_size()
        sent.append((str(tensor.dtype).removeprefix("torch."), size, is_async(args, kwargs)))

    g = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own data
    record: Record = {"plain": [], "hooked": [], "alone": [], "sent": [], "returned": [],
                      "buckets": [], "started": []}  # fmt: skip
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        for name, model in (("plain", plain), ("hooked", hooked), ("alone", alone)):
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if name == "hooked":  # what the learner's hook hands to the backend
                if ctx.rank == 1:  # so rank 0's hook cannot have the sum before it returns
                    time.sleep(LATE_S)
                record["started"].append(time.monotonic())
                with spying(("all_reduce",), note, module):
                    loss.backward()
            else:
                loss.backward()
            record[name].append(grads(model))
        record["sent"].append(list(sent))
        record["buckets"].append(len(buckets))
        record["returned"].append(list(done_at_return))
        sent.clear()
        buckets.clear()
        done_at_return.clear()
    record["bytes_fp32"] = 4 * sum(p.numel() for p in base.parameters())
    return record


def _waited_inside(records: list[Record], step: int) -> str | None:
    """Rank 0's hook returned a Future already complete although it began before rank 1's
    backward (LATE_S late on purpose): its sum could not be there unless the hook waited. A
    host that delayed rank 0 by LATE_S: no verdict."""
    late = records[1]["started"][step] if len(records) > 1 else 0.0
    if not any(done and entered < late for done, entered in records[0]["returned"][step]):
        return None
    return (f"rank 0's hook returned in step {step} with the sum already in, though rank 1 "
            f"started its backward {LATE_S:g} s late on purpose: the hook waited inside "
            "(work.wait(), or .wait() on its future) and backward stopped at the bucket until "
            "the sum arrived - return work.get_future().then(fn) without waiting; DDP waits on "
            "it after backward")  # fmt: skip


def judge_hook(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        for step in range(STEPS):
            sent = rec["sent"][step]
            if not sent:
                return (f"rank {rank}'s hook sent nothing in step {step}: it must "
                        "dist.all_reduce the bucket (without it each rank keeps its own "
                        "gradients and the replicas drift apart)")  # fmt: skip
            dtypes = sorted({d for d, _, _ in sent})
            if dtypes != ["bfloat16"]:
                return (f"rank {rank}'s hook sent {', '.join(dtypes)}: cast the bucket to "
                        "torch.bfloat16 before the all_reduce (half the bytes)")  # fmt: skip
            if len(sent) > rec["buckets"][step]:
                return (f"rank {rank}'s hook made {len(sent)} all_reduces for "
                        f"{rec['buckets'][step]} bucket(s) in step {step}: one per bucket - "
                        "send bucket.buffer(), whole (its gradients one by one are many small "
                        "sends)")  # fmt: skip
            total = sum(b for _, b, _ in sent)
            if 2 * total != rec["bytes_fp32"]:
                return (f"rank {rank}'s hook sent {total} bytes in step {step}, not half of "
                        f"the {rec['bytes_fp32']} float32 bytes of the gradients: send each "
                        "bucket once, whole")  # fmt: skip
            if not all(async_op for _, _, async_op in sent):
                return (f"rank {rank}'s hook waited for its all_reduce (no async_op=True): "
                        "backward stops at every bucket until the sum has arrived - pass "
                        "async_op=True and chain .then(fn) on work.get_future(), so that DDP "
                        "overlaps the sending with the rest of backward")  # fmt: skip
            want, got = torch.tensor(rec["plain"][step]), torch.tensor(rec["hooked"][step])
            scale = want.abs().max().item()
            n = len(records)
            own = torch.tensor(rec["alone"][step]) / n
            if n > 1 and (got - own).abs().max().item() <= TOLERANCE * scale:
                return (f"rank {rank}'s gradients are its own divided by {n}: the bucket was "
                        "copied back before the sum arrived - chain .then(fn) on the "
                        "all_reduce's own future (work.get_future()), not on a Future that is "
                        "already complete")  # fmt: skip
            if n > 1 and (got - want / n).abs().max().item() <= TOLERANCE * scale:
                return (f"rank {rank}'s gradients are DDP's divided by {n}: the world size "
                        "divided them twice - once, before (or after) the sum")  # fmt: skip
            if (got - n * want).abs().max().item() <= TOLERANCE * n * scale:
                return (f"rank {rank}'s gradients are {n} times DDP's: divide by the world "
                        "size (DDP averages the gradients, all_reduce sums them)")  # fmt: skip
            gap = (got - want).abs().max().item() / scale
            if gap > TOLERANCE:
                return (f"rank {rank}'s gradients differ from DDP's by {gap:.2g} of the largest "
                        f"(more than bf16's rounding, {TOLERANCE:g}) in step {step}: copy the "
                        "all-reduced sum back into the bucket and return it")  # fmt: skip
            if rank == 0 and (mistake := _waited_inside(records, step)):
                return mistake
    hooked = [rec["hooked"] for rec in records]
    if any(h != hooked[0] for h in hooked):
        return "the ranks ended with different gradients: every rank must use the same sum"
    return None


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


def run_amp(module: ModuleType, ctx: Context) -> Record:
    """Step 0: the learner's float16 step against float32 on the global batch; step 1: an inf
    in rank 1's first micro-batch gradient (inside no_sync). DDP's all_reduces are counted."""
    ready_for_ddp(ctx)
    model = DDP(amp_model())
    watch = _Watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=AMP_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_SCALE)
    record: Record = {"allreduces": [], "allreduce_after": [], "dtypes": []}
    calls: list[str] = []  # the learner's clip_grad_norm_ and unscale_ calls, in order

    def step(n: int) -> None:
        x, y = amp_batch(n, ctx.world_size)
        mine = slice(AMP_PER_RANK * ctx.rank, AMP_PER_RANK * (ctx.rank + 1))
        k = AMP_MICRO[n]
        micro = list(zip(x[mine].chunk(k), y[mine].chunk(k), strict=True))
        watch.reset()
        with noting_clips(scaler, module, calls):
            module.amp_step(model, micro, optimizer, scaler, AMP_DTYPES[n])
        record["allreduces"].append(len(watch.after))
        record["allreduce_after"].append(list(watch.after))
        record["dtypes"].append(sorted(watch.dtypes))

    before = _flat(model)
    step(0)
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
    grads: list[int] = []

    def first_call_inf(grad: torch.Tensor) -> torch.Tensor:
        """Rank 1's first micro-batch (inside no_sync: nothing sent yet) gets an inf."""
        grads.append(1)
        return grad.clone().fill_(float("inf")) if len(grads) == 1 else grad

    weight = model.module[0].weight
    hook = weight.register_hook(first_call_inf) if ctx.rank == 1 else None
    before, scale = _flat(model), scaler.get_scale()
    step(1)
    record["scale_kept"] = scaler.get_scale() >= scale  # update() halves it after a skip
    if hook is not None:
        hook.remove()
    after = _flat(model)
    record.update(
        inf_moved=not torch.equal(before, after),
        finite=bool(torch.isfinite(after).all()),
        weights=after.tolist(),
    )
    return record


def judge_amp(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        if not rec["finite"]:
            return (f"rank {rank}'s weights became inf after a step with an inf gradient: "
                    "step through the scaler, scaler.step(optimizer), which skips it")  # fmt: skip
        if rec["ratio"] == 0:
            return ("the weights never moved: after the micro-batches, scaler.step(optimizer), "
                    "then scaler.update()")  # fmt: skip
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
    if rec["gap"] > AMP_TOL:
        return (f"the step differs from float32's on the global batch by {rec['gap']:.2g} of "
                f"its largest element (float16 rounding stays below {AMP_TOL:g})")  # fmt: skip
    if rec["scale_kept"]:
        return ("after the step with an inf the scale did not halve: scaler.update() with no "
                "argument lowers it after a skipped step (update(new_scale) sets it)")  # fmt: skip
    return None


AMP_ERRORS = (  # GradScaler's own errors, for both scaler exercises (06 and 11)
    ("but _scale is None", "backward() did not run on scaler.scale(loss): the scaler scales "
     "the loss itself, so that it knows what to unscale (fp16: small gradients stay above 0)"),
    ("No inf checks were recorded prior to update", "scaler.update() found no "
     "scaler.step(optimizer) before it in this step: first scaler.step(optimizer) - not "
     "optimizer.step(): it unscales the gradients and skips a step with inf or nan - then "
     "scaler.update()"),
    ("step() has already been called since the last update()", "scaler.step(optimizer) twice "
     "without scaler.update() between: call scaler.update() after every scaler.step"),
    ("unscale_() is being called after step()", "this rank's scaler was not updated after "
     "its last scaler.step(optimizer): every step, on every rank, scaler.step(optimizer), then "
     "scaler.update() - update() before step(), or on rank 0 only, leaves the step unfinished"),
    ("unscale_() has already been called on this optimizer since the last update()",
     "scaler.unscale_(optimizer) twice in one step, or a step without scaler.update(): call "
     "unscale_ once, before clipping, and scaler.update() after every scaler.step"),
)  # fmt: skip

ERRORS = (
    ("Expected a proper Tensor but got None", "the function given to .then() returned None: "
     "return the bucket's tensor from it (DDP copies what the Future holds into the "
     "gradients)"),
    ("isPyObject()", "the hook returned all_reduce's own Future, whose value is a list [tensor], "
     "not the bucket's tensor: chain .then(fn) and return the bucket from fn"),
    ("Communication hook", "DDP refused the hook's signature (it reads the annotations at run "
     "time: no `from __future__ import annotations` in this file): keep "
     "`(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]`"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="11_amp_step", lesson="11", run=run_amp, judge=judge_amp,
        title="a mixed-precision step with accumulation: autocast, GradScaler, no_sync",
        teaches='lesson 11, "1 · Mixed precision under DDP"', errors=AMP_ERRORS,
        proves=(
            "the forward in the dtype asked for (float16, then bfloat16), one all_reduce on the "
            "last micro-batch of 4 and of 2, the inf step skipped by "
            "the scaler and its scale halved, the step equal to float32's on the global batch, "
            "the same on every rank"
        ),
    ),
    Exercise(
        name="11_bf16_hook", lesson="11", run=run_hook, judge=judge_hook,
        title="a comm hook that sends the gradients as bfloat16",
        teaches='lesson 11, "3 · Communication hooks: fewer bytes on the wire"', errors=ERRORS,
        proves=(
            "each bucket sent once, as bfloat16, asynchronously; the gradients equal DDP's within"
            " bfloat16's rounding, on every rank"
        ),
    ),
]  # fmt: skip
