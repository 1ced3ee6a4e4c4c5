"""Lesson 11's exercise: a communication hook that compresses the gradients to bf16.

``11_bf16_hook``: the learner writes the hook torch ships as ``default_hooks.bf16_compress_hook``.
``run`` trains two copies of one model side by side on every rank: plain DDP, and DDP with the
learner's hook; it records both gradients and what the hook handed to ``dist.all_reduce``
(dtype, bytes). The judge names the first mistake: nothing sent, float32 sent, the sum instead
of the mean, ranks that disagree, or gradients further from DDP's than bf16's rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.core import Context, Exercise, Record

STEPS = 2  # two steps: a hook must work again once DDP has rebuilt its buckets
TOLERANCE = 1e-2  # max |grad - DDP's grad| / max |DDP's grad|: bf16 keeps 8 significant bits


def grads(model: nn.Module) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def run_hook(module: ModuleType, ctx: Context) -> Record:
    """Plain DDP and DDP with the learner's hook, the same model and data; what each computed."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    plain, hooked = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    hooked.register_comm_hook(None, module.bf16_compress_hook)
    sent: list[tuple[str, int]] = []
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(
            (str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size())
        )
        return original(tensor, *args, **kwargs)

    g = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own data
    record: Record = {"plain": [], "hooked": [], "sent": [], "returned": []}
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        for name, model in (("plain", plain), ("hooked", hooked)):
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            step: Callable[[], None] = loss.backward
            if name == "hooked":
                dist.all_reduce = counted  # what the learner's hook hands to the backend
                try:
                    step()
                finally:
                    dist.all_reduce = original
            else:
                step()
            record[name].append(grads(model))
        record["sent"].append(list(sent))
        sent.clear()
    record["bytes_fp32"] = 4 * sum(p.numel() for p in base.parameters())
    return record


def judge_hook(records: list[Record]) -> str | None:
    for rank, rec in enumerate(records):
        for step in range(STEPS):
            sent = rec["sent"][step]
            if not sent:
                return (f"rank {rank}'s hook sent nothing in step {step}: it must "
                        "dist.all_reduce the bucket (without it each rank keeps its own "
                        "gradients and the replicas drift apart)")  # fmt: skip
            dtypes = sorted({d for d, _ in sent})
            if dtypes != ["bfloat16"]:
                return (f"rank {rank}'s hook sent {', '.join(dtypes)}: cast the bucket to "
                        "torch.bfloat16 before the all_reduce (half the bytes)")  # fmt: skip
            total = sum(b for _, b in sent)
            if 2 * total != rec["bytes_fp32"]:
                return (f"rank {rank}'s hook sent {total} bytes in step {step}, not half of "
                        f"the {rec['bytes_fp32']} float32 bytes of the gradients: send each "
                        "bucket once, whole")  # fmt: skip
            want, got = torch.tensor(rec["plain"][step]), torch.tensor(rec["hooked"][step])
            scale = want.abs().max().item()
            n = len(records)
            if (got - n * want).abs().max().item() <= TOLERANCE * n * scale:
                return (f"rank {rank}'s gradients are {n} times DDP's: divide by the world "
                        "size (DDP averages the gradients, all_reduce sums them)")  # fmt: skip
            gap = (got - want).abs().max().item() / scale
            if gap > TOLERANCE:
                return (f"rank {rank}'s gradients differ from DDP's by {gap:.2g} of the largest "
                        f"(more than bf16's rounding, {TOLERANCE:g}) in step {step}: copy the "
                        "all-reduced sum back into the bucket and return it")  # fmt: skip
    hooked = [rec["hooked"] for rec in records]
    if any(h != hooked[0] for h in hooked):
        return "the ranks ended with different gradients: every rank must use the same sum"
    return None


ERRORS = (
    ("Communication hook", "DDP refused the hook's signature (it reads the annotations at run "
     "time: no `from __future__ import annotations` in this file): keep "
     "`(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]`"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="11_bf16_hook", lesson="11", run=run_hook, judge=judge_hook,
        title="a comm hook that sends the gradients as bfloat16",
        teaches='lesson 11, "3 · Communication hooks: fewer bytes on the wire"', errors=ERRORS,
    ),
]  # fmt: skip
