"""Lesson 00's exercise: a single-process loop turned into DDP (a script, as torchrun runs it).

``00_convert_loop``: the learner's script writes ``model.pt`` and a report per process (the
samples it trained on, per epoch; its rank; whether it wrote). Rank 0 reads them all and trains
the reference, one process on the global batch, to compare the weights with.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.core import Context, Exercise, Record, ranks_written_as

SAMPLES, BATCH, EPOCHS, LR = 256, 16, 2, 0.05  # the stub's defaults
# The check launches with --seed 1, not the stub's 0: DistributedSampler's own default seed is 0,
# so a sampler built without seed=args.seed would pass at the default and shuffle differently
# from the script at any other seed.
SEED = 1


def order(epoch: int, seed: int = SEED) -> list[int]:
    """The samples in the order one process draws them in ``epoch`` (RandomSampler's randperm,
    seeded as the stub seeds it): DistributedSampler(seed=args.seed) deals out the same order."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def reference_weights(
    world_size: int, lr: float = LR, orders: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """What one process trains with the global batch (lesson 00's proof: the same weights);
    or, given ``orders`` (the samples of each epoch, in order), one process on those alone in
    batches of BATCH: what rank 0 trains when its gradients are never averaged."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(EPOCHS):
        order_ = orders[epoch] if orders else order(epoch)
        step = BATCH if orders else BATCH * world_size
        for i in range(0, len(order_), step):
            batch = torch.tensor(order_[i : i + step])
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()


def run_convert(_: ModuleType | None, ctx: Context) -> Record:
    """On rank 0: every process's report, the saved keys, and the gap to the reference."""
    if ctx.rank != 0:
        return {}
    reports = [json.loads(p.read_text()) for p in sorted(ctx.out.glob("report-*.json"))]
    ddp = [json.loads(p.read_text()) for p in sorted(ctx.out.glob("ddp-*.json"))]
    record: Record = {"reports": reports, "saved": None, "ddp": ddp}
    if not (ctx.out / "model.pt").is_file():
        return record
    try:
        state = torch.load(ctx.out / "model.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # a pickled object (the module itself): weights_only refuses
        return {**record, "saved": [], "saved_object": True}
    except Exception as exc:  # torn by two writers: the reports name who wrote
        return {**record, "saved": [], "saved_torn": f"{type(exc).__name__}: {exc}"[:200]}
    record["saved"] = sorted(state)
    plain = {k.removeprefix("module."): v for k, v in state.items()}
    want = reference_weights(ctx.world_size)
    record["want_keys"] = sorted(want)
    if set(plain) == set(want):
        record["gap"] = max((plain[k] - want[k]).abs().max().item() for k in want)
        # --batch-size taken as global, times world_size per process: world_size^2 x 16; and
        # the learning rate scaled by the world size, a rule lesson 00 does not apply
        n = ctx.world_size
        # or --batch-size divided by world_size (a global batch kept at 16: a global batch
        # that does not grow with the processes, so training slows down and changes)
        others = {"batch_x_world": reference_weights(n * n),
                  "batch_over_world": reference_weights(1),
                  "lr_x_world": reference_weights(n, LR * n),
                  "lr_over_world": reference_weights(n, LR / n),
                  "lr_sqrt_world": reference_weights(n, LR * n**0.5),
                  # a loss summed over the batch (reduction="sum"): gradients BATCH times the mean
                  "loss_summed": reference_weights(n, LR * BATCH)}  # fmt: skip
        zero = [r for r in reports if r.get("rank") == 0 and len(r.get("seen", [])) == EPOCHS]
        if n > 1 and zero:  # rank 0 alone on its own samples: gradients never averaged
            others["alone"] = reference_weights(1, orders=zero[0]["seen"])
        for name, other in others.items():
            record[f"gap_{name}"] = max((plain[k] - other[k]).abs().max().item() for k in other)
    return record


def _judge_orders(reports: list[Record]) -> str | None:
    """Each epoch's samples on each rank, against the DistributedSampler's for --seed."""
    n = len(reports)
    for epoch in range(EPOCHS):
        stale = [r["rank"] for r in reports if epoch and r["seen"][epoch] == r["seen"][0]]
        if 0 < len(stale) < n:  # the others reshuffled: their shares now overlap this one's
            return (f"rank {stale[0]} trained epoch {epoch} in epoch 0's order while the others "
                    "reshuffled: every rank calls sampler.set_epoch(epoch), not only rank 0 "
                    "(the shares then overlap)")  # fmt: skip
        shards = [r["seen"][epoch] for r in reports]
        if all(r["seen"][epoch] == order(epoch + r["rank"])[r["rank"] :: n] for r in reports):
            return (f"in epoch {epoch} each rank shuffled an order of its own, from a seed or an "
                    "epoch number of its own (seed=args.seed + rank, or set_epoch(epoch + "
                    "rank)?): the shares then overlap and miss samples - the same seed on every "
                    "rank, and sampler.set_epoch(epoch), one number on every rank")  # fmt: skip
        if len(set(shards[0]) & set(shards[1])) == len(shards[0]) < SAMPLES:
            return (f"rank 1 trained on the same {len(shards[0])} samples as rank 0: a "
                    "DistributedSampler that was told the same rank on both - rank=LOCAL_RANK "
                    "(0 on every machine: this check runs each process as a machine of its "
                    "own) or a number; leave rank= out: it is the global rank by "
                    "default")  # fmt: skip
        if len(set(shards[0]) & set(shards[1])) == len(shards[0]):
            return ("rank 1 trained on the same samples as rank 0: the DataLoader has no "
                    "DistributedSampler (each process must get its own share)")  # fmt: skip
        every = sorted(i for shard in shards for i in shard)
        if len(set(every)) < len(every):
            return (f"in epoch {epoch} the ranks' shares overlap (and miss other samples): "
                    "every rank must shuffle alike - DistributedSampler(..., seed=args.seed), "
                    "the same seed on every rank")  # fmt: skip
        if every != list(range(SAMPLES)):
            return f"epoch {epoch} did not train every sample exactly once across the processes"
    for r in reports:
        if r["seen"][0] == list(range(r["rank"], SAMPLES, n)):
            return (
                f"rank {r['rank']} took its samples unshuffled, in index order: "
                "DistributedSampler(shuffle=False) - keep its default, shuffle=True"
            )
        if r["seen"][0] == r["seen"][1]:
            return (f"rank {r['rank']} saw its samples in the same order in every epoch: call "
                    "sampler.set_epoch(epoch) at the start of each epoch")  # fmt: skip
    for epoch in range(EPOCHS):
        if any(r["seen"][epoch] != order(epoch)[r["rank"] :: n] for r in reports):
            if all(r["seen"][epoch] == order(epoch, 2 * SEED)[r["rank"] :: n] for r in reports):
                return (f"epoch {epoch} was shuffled as set_epoch(args.seed + epoch) shuffles "
                        "it: the sampler adds its own seed (seed=args.seed) to the number "
                        "set_epoch gives it - call sampler.set_epoch(epoch)")  # fmt: skip
            return (
                f"in epoch {epoch} the processes did not get the samples one process "
                f"draws (the script ran with --seed {SEED}): build the DistributedSampler "
                "with seed=args.seed, the same on every rank; call sampler.set_epoch(epoch)"
            )
    return None


def _judge_saved(first: Record, n: int) -> str | None:
    """What rank 0 saved: a state_dict of the plain model, with one process's weights."""
    if first.get("saved_torn"):
        return (f"model.pt does not load ({first['saved_torn']}): only rank 0 writes it, "
                "through a temporary file and a rename")  # fmt: skip
    if first.get("saved_object"):
        return ("model.pt holds a pickled object, not a state_dict: torch.load(..., "
                "weights_only=True) refuses it - save model.module.state_dict()")  # fmt: skip
    if any(k.startswith("module.") for k in first["saved"]):
        return ("the saved keys start with 'module.' (DDP's wrapper): save "
                "model.module.state_dict(), the plain model inside")  # fmt: skip
    if "gap" not in first:
        return (f"the saved keys are {first['saved'][:3]}..., the plain model's "
                f"{first['want_keys'][:3]}...: save model.module.state_dict() as it is "
                "(no prefix to strip by hand)")  # fmt: skip
    if first["gap_batch_x_world"] <= 1e-5:
        return (f"the weights are those of a global batch of {n * n * BATCH}, not {n * BATCH}: "
                "--batch-size is per process - keep batch_size=args.batch_size (2 processes "
                "x 16 train what 1 x 32 trains)")  # fmt: skip
    if n > 1 and first.get("gap_batch_over_world", 1.0) <= 1e-5:
        return (f"the weights are those of a global batch of {BATCH}, not {n * BATCH}: "
                "--batch-size is per process - keep batch_size=args.batch_size, not divided by "
                f"the world size ({n} processes x {BATCH} train what 1 x {n * BATCH} trains; "
                "a global batch kept fixed trains something else, with fewer samples per "
                "process and step)")  # fmt: skip
    if first.get("gap_lr_over_world", 1.0) <= 1e-5:
        return (f"the weights are those of a learning rate of --lr / {n}: the loss (or the "
                "rate) was divided by the world size, but DDP's backward averages the gradients "
                "over the ranks already - divide neither "
                '(lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
    if first["gap_lr_x_world"] <= 1e-5:
        return (f"the weights are those of a learning rate {n} times --lr (or of a loss times "
                f"{n}, or of gradients summed over the ranks and not averaged: an all_reduce of "
                "each .grad on top of DDP's backward, which averaged them already - drop it; or "
                "instead of DDP, without dividing by the world size): this lesson keeps "
                "--lr as it is, to train exactly what one process trains on the global batch; "
                "a rate changes with a global batch that grows "
                '(lesson 02, "The global batch and the learning rate")')  # fmt: skip
    if first.get("gap_alone", 1.0) <= 1e-5:
        return _alone(first.get("ddp", []))
    if n > 1 and first.get("gap_lr_sqrt_world", 1.0) <= 1e-5:
        return (f"the weights are those of --lr x sqrt({n}): a rule for a global batch that "
                "grows on purpose (lesson 02, \"The global batch and the learning rate\"); "
                "this lesson keeps --lr as it is, to train exactly what one process trains on "
                "the global batch")  # fmt: skip
    if first.get("gap_loss_summed", 1.0) <= 1e-4:
        return (f"the weights are those of gradients {BATCH} times too large, a loss summed over "
                f"the batch of {BATCH} (reduction='sum'): keep cross_entropy's mean, as the "
                "single-process loop has it - DDP averages the ranks' mean gradients into the "
                "global batch's mean")  # fmt: skip
    if first["gap"] > 1e-5:
        return (f"the weights differ from one process on the global batch (by "
                f"{first['gap']:.2g}): wrap the model in DDP, so that backward() averages the "
                "gradients, and keep --batch-size per process")  # fmt: skip
    return None


def _alone(ddp: list[Record]) -> str:
    """Rank 0 trained as if alone: not wrapped, called past the wrapper, or under no_sync."""
    said = "rank 0's weights are those of rank 0 training alone on its own samples"
    if not any(d["built"] for d in ddp):
        return (
            f"{said}: its gradients were never averaged with the other processes' - wrap "
            "the model in DDP, model = DDP(model), so that backward() averages them"
        )
    if not any(d["forwards"] for d in ddp):
        return (f"{said}, though the model was wrapped: the forward went through "
                "model.module(x), which bypasses DDP - its forward is what makes the next "
                "backward average the gradients: call the wrapper, model(x)")  # fmt: skip
    return (f"{said}: its gradients were never averaged - run forward and backward outside "
            "`with model.no_sync():` except on the micro-batches of an accumulation (lesson "
            '04, "`no_sync()`: gradient accumulation without wasted all_reduces")')  # fmt: skip


def judge_convert(records: list[Record]) -> str | None:
    first, n = records[0], len(records)
    reports = first["reports"]
    if len(reports) != n:
        return f"{len(reports)} reports for {n} processes: keep the lines that write report-*.json"
    ranks, worlds = sorted(r["rank"] for r in reports), sorted({r["world_size"] for r in reports})
    if ranks != list(range(n)) or worlds != [n]:
        return (
            f"the processes reported ranks {ranks} of world sizes {worlds}, not 0..{n - 1} of "
            f"{n}: call dist.init_process_group and read RANK and WORLD_SIZE from torchrun's "
            "environment - not LOCAL_RANK or LOCAL_WORLD_SIZE, this machine's own: the check "
            "runs each process as if on a machine of its own, where they are 0 and 1"
        )
    reports.sort(key=lambda r: r["rank"])
    if mistake := _judge_orders(reports):
        return mistake
    writers = [r["rank"] for r in reports if r["wrote"]]
    if not writers:  # helper 158: a save of the learner's own, the template's `writer` False
        return ("no process said it wrote model.pt: the template's `if writer:` block saves it "
                "(atomically) and the report says who wrote - set `writer, state = rank == 0, "
                "model.module.state_dict()` rather than saving elsewhere")  # fmt: skip
    if len(writers) != 1:
        return (f"{len(writers)} processes wrote model.pt ({writers}): only rank 0 must save "
                "(`writer = rank == 0`, the template's line that decides, with rank from RANK "
                "- LOCAL_RANK is 0 on every machine); concurrent writers corrupt the "
                "file")  # fmt: skip
    if writers != [0]:
        return (f"rank {writers[0]} wrote model.pt: rank 0 writes it (`if rank == 0`), the one "
                "rank every job has, whatever its size")  # fmt: skip
    if first["saved"] is None:
        return "no model.pt was written"
    if mistake := _judge_saved(first, n):
        return mistake
    if not any(d["built"] for d in first.get("ddp", [])):  # helper 158: averaged by hand
        return ("the weights are right, but the model was never wrapped in DDP: gradients "
                "averaged by hand cost one collective per tensor, after backward - this "
                "conversion wraps it, model = DDP(model), which sends them in buckets during "
                'backward (lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
    if any(d.get("grads_reduced") for d in first.get("ddp", [])):  # helper 167
        return ("the weights are right, but each .grad was all_reduced again after DDP's "
                "backward, which had averaged them already: the mean of equal numbers is the "
                "same numbers, at the cost of one more collective per tensor and step - drop "
                'it (lesson 04, "2 · Gradients are averaged, bucket by bucket")')  # fmt: skip
    open_ = [rank for rank, r in enumerate(records) if r.get("left_group_open")]
    if open_:
        return (f"rank {open_[0]} left the process group open: every rank ends with "
                "dist.destroy_process_group()")  # fmt: skip
    return None


@contextmanager
def one_machine_each(ctx: Context) -> Iterator[None]:
    """Each process as if on a machine of its own (LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1): an
    answer that took its rank or world size from the LOCAL_ variables, the same as RANK and
    WORLD_SIZE on one machine, shows here as it would on two."""
    built: list[int] = []  # and whether the model was wrapped, and called through the wrapper
    init, forward, reduce = DDP.__init__, DDP.forward, dist.all_reduce
    wrapped: list[DDP] = []

    def noted_init(self: DDP, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        init(self, *args, **kwargs)
        wrapped.append(self)

    def noted_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:  # a wrapped model's grad?
        grads = [p.grad for m in wrapped for p in m.parameters() if p.grad is not None]
        built.extend([3] if any(tensor is g for g in grads) else [])
        return reduce(tensor, *args, **kwargs)

    def noted_forward(self: DDP, *args: Any, **kwargs: Any) -> Any:
        built.append(2)
        return forward(self, *args, **kwargs)

    with (mock.patch.dict(os.environ, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}),
          mock.patch.object(DDP, "__init__", noted_init),
          mock.patch.object(DDP, "forward", noted_forward),
          mock.patch.object(dist, "all_reduce", noted_reduce)):  # fmt: skip
        try:
            yield
        finally:
            use = {"built": built.count(1), "forwards": built.count(2),
                   "grads_reduced": built.count(3)}  # fmt: skip
            (ctx.out / f"ddp-{ctx.rank}.json").write_text(json.dumps(use))


# the GPU lines of the lesson's snippet, copied onto this CPU check (helper 147)
_CPU_BRANCH = ("this check runs on the CPU with gloo: take the CPU branch of the lesson's lines "
               '- dist.init_process_group("gloo"), DDP(model) without device_ids, no '
               "torch.cuda.set_device (on GPUs: nccl, torch.cuda.set_device(local_rank), "
               "DDP(model, device_ids=[local_rank]))")  # fmt: skip

ERRORS = (
    ("device_ids and output_device arguments only work", _CPU_BRANCH),
    ("ProcessGroupNCCL is only supported with GPUs", _CPU_BRANCH),
    ("Found no NVIDIA driver", _CPU_BRANCH),
    ("No CUDA GPUs are available", _CPU_BRANCH),  # a GPU machine: the check hides its GPUs
    ("model.pt.tmp", "two processes wrote model.pt at once (one renamed the other's temporary "
     "file away): only rank 0 must save (`if rank == 0`), with rank read from RANK in every "
     "process (a rank, world_size left at 0, 1 makes each process rank 0) - LOCAL_RANK is 0 "
     "on every machine"),
    ("Default process group has not been initialized", "a dist call before the process group "
     "exists: call dist.init_process_group first, in every process"),
    ("rank should be in the interval", "a DistributedSampler was given a rank outside "
     "0..num_replicas-1: num_replicas is the world size (WORLD_SIZE), not LOCAL_WORLD_SIZE, one "
     "machine's own (this check runs each process as a machine of its own) - or leave "
     "num_replicas= and rank= out: the sampler reads both from the process group"),
)  # fmt: skip

EXERCISES = [
    Exercise(
        name="00_convert_loop", lesson="00", kind="script", run=run_convert,
        judge=judge_convert, title="a single-process training loop, turned into DDP",
        args=("--seed", str(SEED)),
        teaches='lesson 00, "Every changed line, once"', collective_timeout_s=12.0, errors=ERRORS,
        around=one_machine_each,
        hidden=(  # helper 174: right for this check's 2 ranks and 256 samples only
            (ranks_written_as(2), "the number of ranks is written as 2, this check's: on 4 "
             "processes a DistributedSampler(num_replicas=2) refuses rank 2, and "
             "init_process_group(world_size=2) waits for ever - leave them out (torchrun's "
             "environment gives both) or pass dist.get_world_size()"),
            # the loader's, not the sampler's (helper 177: lesson 02 teaches that one)
            (r"DataLoader\([^()]*(?:\([^()]*\)[^()]*)*drop_last\s*=\s*True", "the "
             "DataLoader's drop_last=True drops each rank's last partial batch: 256 samples "
             "deal 128 per rank, 8 full batches of 16, so nothing was dropped here - with 250, "
             "each rank would skip 13 samples an epoch that the single process trains; this "
             "exercise asks for the single process's training (the template drops that batch "
             "by choice, for full batches) - leave the loader's drop_last off"),
        ),
        proves=(
            "every process reported its rank; each epoch dealt every sample once, in the "
            "DistributedSampler's order for --seed, a new order each epoch; the weights equal one"
            " process's on the global batch; rank 0 alone wrote model.pt, without 'module.'; the "
            "group was closed"
        ),
    ),
]  # fmt: skip
