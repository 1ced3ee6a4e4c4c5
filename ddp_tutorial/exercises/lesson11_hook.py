"""Lesson 11's second exercise: a comm hook that compresses the gradients to bf16.

``11_bf16_hook``: the learner writes the hook torch ships as ``default_hooks.bf16_compress_hook``.
``run`` trains two copies of one model side by side on every rank: plain DDP, and DDP with the
learner's hook; it records both gradients, what the hook handed to ``dist.all_reduce`` (dtype,
bytes) and the dtype of DDP's buckets as the hook got and left them. The judge names the
first mistake: nothing sent, float32 sent, DDP's own bucket changed, the sum instead of the
mean, ranks that disagree, or gradients further from DDP's than bf16's rounding.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.core import DIVIDED_BY_2, Context, Exercise, Record, one_line
from ddp_tutorial.exercises.lesson11 import ready_for_ddp
from ddp_tutorial.exercises.spies import is_async, spying

STEPS = 2  # two steps: a hook must work again once DDP has rebuilt its buckets
TOLERANCE = 1e-2  # max |grad - DDP's grad| / max |DDP's grad|: bf16 keeps 8 significant bits
LATE_S = 0.5  # rank 1 starts the hooked backward this late: rank 0's sum cannot arrive sooner


class Reordered(nn.Module):
    """Two layers registered last-first: DDP's first buckets (``BUCKET_MB``: two of them) follow
    the registration order, the ones it rebuilds after step 1 the order the gradients came in:
    other sizes at the same index (helper 169: a send buffer kept per bucket index passed)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = nn.Linear(64, 4)
        self.first = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


BUCKET_MB = 0.001  # 1,048 bytes: the first layer's 4,352 and the last's 1,040 bytes apart


def grads(model: nn.Module) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def _watched(module: ModuleType, buckets: list[int], handed: set[str], valued: set[str],
             done_at_return: list[tuple[bool, float]]) -> Any:  # fmt: skip
    """The learner's hook, and what it did: one call per bucket, the bucket's dtype as it got
    and left it, the dtype of what its Future held, and whether that was done at return."""

    @functools.wraps(module.bf16_compress_hook)  # DDP checks the learner's signature
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buckets.append(1)
        handed.add(str(bucket.buffer().dtype).removeprefix("torch."))  # DDP's: float32
        entered = time.monotonic()  # one clock for every process of this machine
        future = module.bf16_compress_hook(state, bucket)
        handed.add(str(bucket.buffer().dtype).removeprefix("torch."))  # and left: float32
        done_at_return.append((bool(getattr(future, "done", lambda: False)()), entered))
        if isinstance(future, torch._C.Future):  # then() makes a torch._C.Future

            def look(done: torch.futures.Future) -> None:  # the dtype DDP gets, once done
                try:
                    value = done.value()
                except Exception:  # the learner's error: DDP reports it
                    return
                if isinstance(value, torch.Tensor):
                    valued.add(str(value.dtype).removeprefix("torch."))

            future.add_done_callback(look)  # the Future itself goes to DDP, unchanged
        return future

    return hook


def run_hook(module: ModuleType, ctx: Context) -> Record:
    """Plain DDP and DDP with the learner's hook, the same model and data; what each computed."""
    ready_for_ddp(ctx)
    torch.manual_seed(0)
    base = Reordered()
    # the hooked model on a group of its own (all the ranks): DDP hands the hook that group, and
    # an all_reduce on the default group instead is seen, however the call is written
    own_group = dist.new_group(list(range(ctx.world_size)))
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB)
    hooked = DDP(copy.deepcopy(base), process_group=own_group, bucket_cap_mb=BUCKET_MB)
    alone = copy.deepcopy(base)  # this rank's own gradients, nothing averaged
    buckets: list[int] = []  # the hook's calls, one per bucket, in this step
    handed: set[str] = set()  # the dtypes of DDP's buckets as the hook got and left them
    valued: set[str] = set()  # the dtypes of what the hooks' Futures held when done

    # per call: (whether the Future the hook returned had its sum, when the hook was entered)
    done_at_return: list[tuple[bool, float]] = []

    hook = _watched(module, buckets, handed, valued, done_at_return)
    hooked.register_comm_hook(own_group, hook)
    sent: list[tuple[str, int, bool]] = []
    touched: list[str] = []  # an all_reduce whose tensor the hook changed while it was in flight
    groups: list[bool] = []  # per all_reduce: on the group DDP handed the hook

    def note(_: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None]:
        tensor = args[0] if args else kwargs["tensor"]
        size = tensor.numel() * tensor.element_size()
        sent.append((str(tensor.dtype).removeprefix("torch."), size, is_async(args, kwargs)))
        groups.append(kwargs.get("group", args[2] if len(args) > 2 else None) is own_group)
        return lambda: None  # a noted Work: a change to its tensor before the sum is seen

    g = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own data
    record: Record = {"plain": [], "hooked": [], "alone": [], "sent": [], "returned": [],
                      "buckets": [], "started": [], "handed": [], "valued": []}  # fmt: skip
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        for name, model in (("plain", plain), ("hooked", hooked), ("alone", alone)):
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if name == "hooked":  # what the learner's hook hands to the backend
                if ctx.rank == 1:  # so rank 0's hook cannot have the sum before it returns
                    time.sleep(LATE_S)
                record["started"].append(time.monotonic())
                with spying(("all_reduce",), note, module, touched=touched):
                    loss.backward()
            else:
                loss.backward()
            record[name].append(grads(model))
        record["sent"].append(list(sent))
        record["buckets"].append(len(buckets))
        record["handed"].append(sorted(handed))
        record["valued"].append(sorted(valued))
        record["returned"].append(list(done_at_return))
        for seen in (handed, valued, sent, buckets, done_at_return):
            seen.clear()
    record["bytes_fp32"] = 4 * sum(p.numel() for p in base.parameters())
    record["own_group"] = all(groups)
    record["touched"] = touched
    record["no_state"] = _with_no_state(module, base)
    return record


def _with_no_state(module: ModuleType, base: nn.Module) -> str | None:
    """One step with the hook registered the usual way, ``register_comm_hook(None, hook)``:
    DDP then hands it None, not a group (helper 169: ``process_group.size()`` passed)."""
    ddp = DDP(copy.deepcopy(base))
    ddp.register_comm_hook(None, module.bf16_compress_hook)
    try:
        x, y = torch.randn(8, 16), torch.zeros(8, dtype=torch.long)
        nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as exc:  # the same on every rank: the same code, the same None
        return one_line(exc)
    return None


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


def _dtypes_kept(rec: Record, rank: int, step: int) -> str | None:
    """DDP's bucket left float32, and the sum handed back in float32 or bfloat16."""
    if rec.get("handed", [["float32"]] * STEPS)[step] != ["float32"]:
        return (f"rank {rank}'s hook left DDP's bucket {rec['handed'][step][0]} in step "
                f"{step}: it changed the bucket's own tensor (buffer.data = ...), which "
                "DDP keeps: its gradients stay in bfloat16 from then on - compress a "
                "copy (buffer.to(torch.bfloat16)) and copy the sum back into the float32 "
                "buffer")  # fmt: skip
    if odd := set(rec.get("valued", [[]] * STEPS)[step]) - {"float32", "bfloat16"}:
        return (f"rank {rank}'s hook handed DDP the sum as {odd.pop()}: cast it back to "
                "the bucket's own dtype (float32), or leave it bfloat16 - float16 keeps "
                "bfloat16's precision but not its range: gradients below about 6e-5 "
                "lose digits, below 6e-8 become 0")  # fmt: skip
    return None


def _raced_or_stateless(rec: Record, rank: int) -> str | None:
    """A race (right or wrong by luck, so named before the numbers), or a hook that fails when
    registered as torch's docs register it."""
    if rec.get("touched"):
        return (f"rank {rank}'s hook changed the tensor of its all_reduce while the sum was "
                "in flight (div_ after the call, say): the sum may or may not include the "
                "change - divide before the all_reduce, or in the .then callback")  # fmt: skip
    if rec.get("no_state"):
        return (f"registered as lesson 11 and torch's docs do, register_comm_hook(None, "
                f"hook), the hook raised {rec['no_state']}: DDP hands the hook that state, "
                "None - take group = process_group if process_group is not None "
                "else dist.group.WORLD, the world size from get_world_size(group)")  # fmt: skip
    return None


def judge_hook(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        if mistake := _raced_or_stateless(rec, rank):
            return mistake
        for step in range(STEPS):
            sent = rec["sent"][step]
            if not sent:
                return (f"rank {rank}'s hook sent nothing in step {step}: it must "
                        "dist.all_reduce the bucket (without it each rank keeps its own "
                        "gradients and the replicas drift apart)")  # fmt: skip
            if mistake := _dtypes_kept(rec, rank, step):
                return mistake
            if not rec.get("own_group", True):
                return DEFAULT_GROUP
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


DEFAULT_GROUP = (
    "the hook uses the default group (an all_reduce without group=, or the whole job's world "
    "size): DDP hands the hook the group the model was wrapped with, a subgroup in a larger "
    "job - all_reduce(..., group=group) and the size of that group (world_size, above your "
    "lines)"
)

ERRORS = (
    ("must match the size of tensor", "a bucket came with another size than before: DDP "
     "rebuilds its buckets after the first step (in the order the gradients came in), so a "
     "tensor kept from an earlier call, per bucket index, no longer fits - make the bfloat16 "
     "copy in each call (buffer.to(torch.bfloat16))"),  # helper 169
    ("Expected a proper Tensor but got None", "the function given to .then() returned None: "
     "return the bucket's tensor from it (DDP copies what the Future holds into the "
     "gradients)"),
    ("Unable to cast [", "the function given to .then() returned f.value(), a list [tensor] "
     "(an all_reduce's future holds one): return the bucket's tensor - copy f.value()[0] into "
     "the bucket and return the bucket"),
    ("isPyObject()", "the hook returned all_reduce's own Future, whose value is a list [tensor], "
     "not the bucket's tensor: chain .then(fn) and return the bucket from fn"),
    ("must return a torch.futures.Future", "the hook returned a tensor: DDP wants a Future "
     "of the bucket's tensor - return work.get_future().then(fn), fn returning the bucket"),
    ("Communication hook", "DDP refused the hook's signature (it reads the annotations at run "
     "time: no `from __future__ import annotations` in this file): keep "
     "`(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]`"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="11_bf16_hook", lesson="11", run=run_hook, judge=judge_hook,
        hidden=((DIVIDED_BY_2, "the bucket is divided by 2, this check's number of ranks: on "
                 "4 or 8 GPUs the gradients would be 2x or 4x DDP's - divide by world_size "
                 "(the process group's size)"),
                (r"get_world_size\(\)|WORLD_SIZE", DEFAULT_GROUP),
                (r"\bdefault_hooks\b|ddp_comm_hooks|\bbf16_compress_wrapper\b",
                 "passed, but torch's own hook did the work, not yours (default_hooks): "
                 "what a real script registers, but this exercise is writing it - the bfloat16 "
                 "copy "
                 "divided by world_size, dist.all_reduce(..., async_op=True), and "
                 ".get_future().then(fn) copying the sum back into the bucket")),
        title="a comm hook that sends the gradients as bfloat16",
        teaches='lesson 11, "3 · Communication hooks: fewer bytes on the wire"', errors=ERRORS,
        proves=(
            "each bucket sent once, as bfloat16, asynchronously; the gradients equal DDP's within"
            " bfloat16's rounding, on every rank"
        ),
    ),
]  # fmt: skip
