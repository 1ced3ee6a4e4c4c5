"""What DistributedDataParallel does, one experiment at a time, recorded per rank.

    torchrun --standalone --nproc-per-node 2 scripts/demos/ddp_anatomy.py

One launch runs every experiment of lesson 04 (each launch costs seconds of
start-up, so they share one): the broadcast at construction, the bucketed
all_reduce in backward with the order of its events (gradient ready, bucket
sent, bucket done), replicas after N steps, ``no_sync`` accumulation, unused
parameters, BatchNorm vs SyncBatchNorm, BatchNorm where SyncBatchNorm cannot run
(per-process statistics measured against one process, buffers averaged, GroupNorm and
LayerNorm), which buffer-sync spelling syncs when,
``device_ids``, and three pitfalls (the section above ``exp_pitfalls``):
BatchNorm against the one-process reference, reentrant activation
checkpointing, two forwards before one backward. Each rank writes what it saw
to ``--out``; the notebook compares the ranks and checks the claims.
``--only NAME`` runs a subset (the tests use it).

The lines the lesson teaches are the functions right below the imports
(``wrap_model``, ``accumulate``, ``average_buffers``): the lesson shows them as
they stand here, and every rank records their source, so that the notebook can
assert that the lines it shows are the ones that ran.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import statistics
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ddp_tutorial.distributed import DistInfo, wrap
from ddp_tutorial.lessons.anatomy import (
    IN_FEATURES,
    NUM_CLASSES,
    CommCounter,
    StepTimeline,
    UnusedBranch,
    bn_model,
    counting_allreduce_hook,
    deep_mlp,
    first_line,
    flat_grads,
    flat_params,
    global_batch,
    run_sections,
    sgd_step,
    shard,
    time_steps,
    timed_allreduce_hook,
    tiny_model,
    token_batches,
    token_model,
)
from ddp_tutorial.models import SmallCNN

EXPERIMENTS = ("taught", "wrap", "no_sync", "unused", "batchnorm", "bn_cpu", "buffers",
               "device_ids", "pitfalls", "loss_norm")  # fmt: skip


# -- The lines lesson 04 teaches. Its cells show these three functions as they stand here --


def wrap_model(model: nn.Module, device: torch.device, local_rank: int, **options: Any) -> DDP:
    """The DDP line of scripts/minimal_ddp.py: this rank's device first, then the wrapper."""
    model = model.to(device)  # 1. the model on this rank's device, BEFORE wrapping
    device_ids = [local_rank] if device.type == "cuda" else None  # a CPU model takes none
    return DDP(model, device_ids=device_ids, **options)  # 2. broadcasts rank 0's weights


def accumulate(model: DDP, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Backward over k micro-batches with one all_reduce: .grad as for one batch of all of them."""
    k = len(micro_batches)
    for x, y in micro_batches[:-1]:
        with model.no_sync():  # forward AND backward in here: the gradients add up, unsent
            (F.cross_entropy(model(x), y) / k).backward()  # / k: the mean over the whole batch
    x, y = micro_batches[-1]
    (F.cross_entropy(model(x), y) / k).backward()  # outside: one all_reduce of the sum


def average_buffers(model: nn.Module) -> None:
    """Every rank's BatchNorm statistics replaced by their mean over the ranks.

    Call it on every rank (it is a collective) before evaluating or saving.
    """
    world = dist.get_world_size()
    for buffer in model.buffers():
        if buffer.is_floating_point():  # running_mean, running_var; not num_batches_tracked
            dist.all_reduce(buffer)  # SUM over the ranks, in place
            buffer /= world


def global_token_loss(logits: torch.Tensor, labels: torch.Tensor, n_global: torch.Tensor,
                      world: int) -> torch.Tensor:  # fmt: skip
    """A sum over this micro-batch's tokens / the step's count over every rank, x world."""
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")  # -100 out
    return total * world / n_global


TAUGHT = (wrap_model, accumulate, average_buffers, global_token_loss)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to compare")
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (all ranks)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=100, help="rank r initialises with seed+r")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.001, help="small: many buckets")
    parser.add_argument("--timing-steps", type=int, default=10, help="steps per timing block")
    parser.add_argument("--timing-rounds", type=int, default=6, help="interleaved timing rounds")
    parser.add_argument("--bn-steps", type=int, default=100, help="steps of the BatchNorm runs")
    parser.add_argument("--bn-batches", type=int, nargs="+", default=[4, 32],
                        help="per-process batch sizes of the BatchNorm runs")  # fmt: skip
    parser.add_argument("--only", nargs="*", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    return parser.parse_args()


def local_batch(step: int, args: argparse.Namespace, info: DistInfo) -> list[torch.Tensor]:
    """This rank's shard of the step's global batch, on this rank's device."""
    x, y = global_batch(step, args.batch_size)
    return [shard(t, info.rank, info.world_size).to(info.device) for t in (x, y)]


def exp_wrap(args: argparse.Namespace, info: DistInfo) -> dict:
    """Broadcast at construction; averaged, bucketed gradients; identical replicas."""
    model = tiny_model(args.seed + info.rank)  # every rank starts from a DIFFERENT init
    before = flat_params(model)
    plain = model  # kept only to check below that the wrapper holds this very object
    model = wrap_model(model, info.device, info.local_rank, bucket_cap_mb=args.bucket_cap_mb)
    after_wrap = flat_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    # Step 0 in slow motion: this rank's own gradient vs what DDP hands the optimizer.
    x, y = local_batch(0, args, info)
    local = copy.deepcopy(model.module)  # same weights, no DDP: a purely local gradient
    F.cross_entropy(local(x), y).backward()
    timeline = StepTimeline()  # counts the bucket all_reduces and notes when things happen
    timeline.watch(model.module)
    model.register_comm_hook(timeline, timed_allreduce_hook)
    calls_per_step, numels_per_step, losses, timelines = [], [], [], {}
    for step in range(args.steps):
        x, y = local_batch(step, args, info)
        timeline.reset()
        opt.zero_grad(set_to_none=True)
        timeline.mark("forward")
        loss = F.cross_entropy(model(x), y)  # 3. forward through the wrapper
        timeline.mark("backward")
        loss.backward()  # 4. all_reduce per bucket, launched while backward still runs
        timeline.mark("optimizer.step")
        if step == 0:
            ddp_grad = flat_grads(model)
        opt.step()
        timeline.mark("done")
        losses.append(loss.item())
        calls_per_step.append(timeline.calls)
        numels_per_step.append(sum(timeline.numels))
        if step in (0, args.steps - 1):
            timelines[step] = timeline.record()

    # The same tiny model with DDP's default 25 MB buckets: one all_reduce per step, also
    # once the first step (one bucket whatever the cap) has had DDP rebuild them.
    big = wrap(tiny_model(args.seed), info.device)
    big_counter, big_opt = CommCounter(), torch.optim.SGD(big.parameters(), lr=args.lr)
    big.register_comm_hook(big_counter, counting_allreduce_hook)
    default_calls = []
    for step in range(2):
        big_counter.reset()
        sgd_step(big, *local_batch(step, args, info), big_opt)
        default_calls.append(big_counter.calls)
    return {
        "params_before_wrap": before,
        "params_after_wrap": after_wrap,
        "local_grad_step0": flat_grads(local),
        "ddp_grad_step0": ddp_grad,
        "params_after_steps": flat_params(model),
        "num_params": before.numel(),
        "losses": losses,
        "allreduce_calls_per_step": calls_per_step,
        "allreduce_numel_per_step": numels_per_step,
        "bucket_numels_last_step": list(timeline.numels),
        "timelines": timelines,
        "allreduce_calls_default_buckets": default_calls,  # steps 0 and 1
        "module_is_wrapped_model": model.module is plain,
    }


def exp_no_sync(args: argparse.Namespace, info: DistInfo) -> dict:
    """Two micro-batches under ``no_sync`` == one batch twice the size, fewer all_reduces.

    Also what happens when the forward bypasses the wrapper (``model.module(x)``).
    """
    x, y = local_batch(0, args, info)
    half = x.shape[0] // 2
    micro = [(x[:half], y[:half]), (x[half:], y[half:])]
    base = tiny_model(args.seed)
    results = {}
    names = ("one_big_batch", "accumulate_no_sync", "accumulate_naive", "backward_only_in_no_sync",
             "bypass_wrapper")  # fmt: skip
    for name in names:
        ddp = wrap(copy.deepcopy(base), info.device)  # default buckets: one all_reduce per sync
        counter = CommCounter()
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        if name == "one_big_batch":
            F.cross_entropy(ddp(x), y).backward()
        elif name == "accumulate_no_sync":
            accumulate(ddp, micro)  # the first under no_sync, the last syncs the sum
        elif name == "accumulate_naive":  # without no_sync: every micro-batch is all-reduced
            for mx, my in micro:
                F.cross_entropy(ddp(mx), my).div(2).backward()
        elif name == "backward_only_in_no_sync":  # the first forward outside it: too late
            first = F.cross_entropy(ddp(micro[0][0]), micro[0][1]).div(2)
            with ddp.no_sync():
                first.backward()
            F.cross_entropy(ddp(micro[1][0]), micro[1][1]).div(2).backward()
        else:  # a forward that bypasses the wrapper: model.module(x) instead of model(x)
            F.cross_entropy(ddp.module(x), y).backward()
        results[name] = {"grad": flat_grads(ddp), "allreduce_calls": counter.calls}
    return results


def exp_unused(args: argparse.Namespace, info: DistInfo) -> dict:
    """A parameter that never gets a gradient: the error, the two fixes, the cost, the overlap."""
    x, y = local_batch(0, args, info)
    out: dict = {}
    ddp = wrap(UnusedBranch(), info.device)
    try:
        for iteration in range(2):  # noqa: B007 (reported below)
            F.cross_entropy(ddp(x), y).backward()
        out["error"] = None
    except RuntimeError as exc:  # raised on the NEXT iteration, on every rank
        out["error"], out["error_iteration"] = str(exc), iteration
    for flag in ("find_unused_parameters", "static_graph"):
        ddp = wrap(UnusedBranch(), info.device, **{flag: True})
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        out[flag] = [sgd_step(ddp, x, y, opt) for _ in range(3)]
        out[f"{flag}_aux_grad"] = ddp.module.aux.weight.grad  # stays None: never used

    # The cost on a model that does NOT need it (seed 000 turns it on always).
    # Same model, same data, interleaved blocks so that machine noise hits both.
    models = {
        flag: wrap(deep_mlp(args.seed), info.device, find_unused_parameters=flag)
        for flag in (False, True)
    }
    opts = {flag: torch.optim.SGD(m.parameters(), lr=1e-3) for flag, m in models.items()}
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []  # one per round: median step with the flag / median step without
    for _round in range(args.timing_rounds):
        block = {}
        for flag, model in models.items():
            block[flag] = time_steps(
                lambda m=model, f=flag: sgd_step(m, x, y, opts[f]), args.timing_steps
            )
            times[flag] += block[flag]
        ratios.append(statistics.median(block[True]) / statistics.median(block[False]))
    out["step_ms_default"] = 1e3 * statistics.median(times[False])
    out["step_ms_find_unused"] = 1e3 * statistics.median(times[True])
    out["ratio_per_round"] = ratios
    out["same_result_with_and_without"] = torch.equal(
        flat_params(models[False]), flat_params(models[True])
    )
    # ... and its extra all_reduce per step (which parameters were used): counted by the
    # profiler, since DDP's reducer calls the process group from C++ (a comm hook sees buckets)
    calls = {}
    for flag, model in models.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sgd_step(model, x, y, opts[flag])
        calls[flag] = sum(e.name == "c10d::allreduce_" for e in prof.events())
    out["allreduces_per_step"] = {"default": calls[False], "find_unused": calls[True]}

    # The flag does not turn off the overlap: with small buckets, a bucket still leaves
    # while backward is running (the second of two steps is recorded).
    model = wrap(tiny_model(args.seed), info.device, find_unused_parameters=True,
                 bucket_cap_mb=args.bucket_cap_mb)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    timeline = StepTimeline()
    timeline.watch(model.module)
    model.register_comm_hook(timeline, timed_allreduce_hook)
    for _step in range(2):
        timeline.reset()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        timeline.mark("optimizer.step")
        opt.step()
    out["find_unused_timeline"] = timeline.record()
    return out


def bn_batch(args: argparse.Namespace, info: DistInfo) -> torch.Tensor:
    """Images whose brightness depends on the rank: each rank's data looks different."""
    gen = torch.Generator().manual_seed(info.rank)
    return (torch.randn(8, 1, 8, 8, generator=gen) + 2.0 * info.rank).to(info.device)


def exp_batchnorm(args: argparse.Namespace, info: DistInfo) -> dict:
    """BatchNorm statistics are per rank; SyncBatchNorm computes them over all ranks."""
    out: dict = {}
    ddp = wrap(
        SmallCNN(1, 3), info.device
    )  # broadcast_buffers=True: rank 0's stats at each forward
    for _ in range(2):
        ddp(bn_batch(args, info)).sum().backward()
    out["bn_running_mean"] = ddp.module.features[1].running_mean

    # Seed 001: convert BEFORE wrapping (DDP must see the SyncBatchNorm layers).
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(SmallCNN(1, 3))
    out["converted_types"] = sorted(
        {type(m).__name__ for m in sync.modules() if "Norm" in type(m).__name__}
    )
    try:
        ddp = wrap(sync, info.device)
        for _ in range(2):
            ddp(bn_batch(args, info)).sum().backward()
        out["syncbn_running_mean"] = ddp.module.features[1].running_mean
        out["syncbn_error"] = None
        out["syncbn_collectives"] = syncbn_collectives(info)
    except (ValueError, RuntimeError) as exc:  # CPU/gloo: SyncBatchNorm needs GPUs
        out["syncbn_error"] = first_line(exc)
    return out


def exp_taught(args: argparse.Namespace, info: DistInfo) -> dict:
    """The source of the lines the lesson shows, as this rank ran them."""
    return {fn.__name__: inspect.getsource(fn).rstrip("\n") for fn in TAUGHT}


def norm_net(norm: str, seed: int, hidden: int = 16) -> nn.Module:
    """Linear -> a normalisation layer -> ReLU -> Linear, initialised from ``seed`` only."""
    torch.manual_seed(seed)
    layer = {"BatchNorm1d": nn.BatchNorm1d(hidden), "GroupNorm": nn.GroupNorm(4, hidden),
             "LayerNorm": nn.LayerNorm(hidden)}[norm]  # fmt: skip
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), layer, nn.ReLU(),
                         nn.Linear(hidden, NUM_CLASSES))  # fmt: skip


def train_norm(model: nn.Module, per_process: int, steps: int, rank: int, world: int,
               device: torch.device) -> list:  # fmt: skip
    """``steps`` SGD steps on this process's shard of each global batch; its losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = (shard(t, rank, world).to(device) for t in global_batch(step, per_process * world))
        losses.append(sgd_step(model, x, y, opt))
    return losses


def evaluate(model: nn.Module, device: torch.device) -> dict:
    """Loss and accuracy on 1024 held-out samples, in eval mode (running statistics)."""
    x, y = (t.to(device) for t in global_batch(10_000, 1024))
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    return {"loss": F.cross_entropy(out, y).item(), "accuracy": (out.argmax(1) == y).float()
            .mean().item()}  # fmt: skip


def norm_buffers(model: nn.Module) -> dict:
    return {name: b.detach().cpu().reshape(-1).tolist() for name, b in model.named_buffers()}


def exp_bn_cpu(args: argparse.Namespace, info: DistInfo) -> dict:
    """BatchNorm without SyncBatchNorm: per-process statistics against one process on the
    global batch (loss, accuracy), the buffers before and after averaging, GroupNorm and
    LayerNorm (no batch statistics: DDP equals one process)."""
    runs: dict[str, dict] = {}
    out: dict = {"runs": runs, "steps": args.bn_steps}
    norms = [("BatchNorm1d", b) for b in args.bn_batches]
    norms += [("GroupNorm", args.bn_batches[0]), ("LayerNorm", args.bn_batches[0])]
    for norm, per_process in norms:
        model = wrap_model(norm_net(norm, args.seed), info.device, info.local_rank)
        losses = train_norm(
            model, per_process, args.bn_steps, info.rank, info.world_size, info.device
        )
        shown = norm == "BatchNorm1d" and per_process == args.bn_batches[0]  # its buffers
        if shown:
            own = copy.deepcopy(list(model.module.buffers()))  # each rank's, as training left them
            out["buffers_after_training"] = norm_buffers(model.module)
            out["eval_own_buffers"] = evaluate(model.module, info.device)
            model.eval()
            with torch.no_grad():
                model(global_batch(0, 2)[0].to(info.device))  # a forward through the wrapper
            out["buffers_after_wrapper_forward"] = norm_buffers(model.module)  # rank 0's
            for buffer, mine in zip(model.module.buffers(), own, strict=True):
                buffer.copy_(mine)  # back to this rank's own
            with torch.no_grad():  # a second one: the forward before it had no gradients
                model(global_batch(1, 2)[0].to(info.device))
            out["buffers_after_second_forward"] = norm_buffers(model.module)  # still its own
            model.train()  # then the fix:
        average_buffers(model.module)  # every run is evaluated with the ranks' mean statistics
        if shown:
            out["buffers_averaged"] = norm_buffers(model.module)
        one = norm_net(norm, args.seed).to(info.device)  # one process, the whole global batch
        global_size = per_process * info.world_size
        one_losses = train_norm(one, global_size, args.bn_steps, 0, 1, info.device)
        runs[f"{norm}, {per_process} per process"] = {
            "norm": norm, "per_process": per_process, "ddp_losses": losses,
            "one_losses": one_losses, "ddp_params": flat_params(model),
            "one_params": flat_params(one), "ddp_eval": evaluate(model.module, info.device),
            "one_eval": evaluate(one, info.device),
        }  # fmt: skip
    return out


def exp_buffers(args: argparse.Namespace, info: DistInfo) -> dict:
    """Which spelling syncs BatchNorm's buffers when: at construction, before each forward.

    Every rank gives its model a rank-local ``running_mean`` (``rank + 1``),
    wraps it, and reads the buffer; then sets it rank-local again and runs one
    forward in eval mode (BatchNorm then leaves its statistics alone, so any
    change is DDP's copy of rank 0's buffers). The FutureWarning of the
    constructor, if any, is recorded too.
    """
    accepts = inspect.signature(DDP.__init__).parameters
    spellings: dict[str, dict] = {
        "default": {},
        "broadcast_buffers=False": {"broadcast_buffers": False},
        "forward_sync_buffers=False": {"forward_sync_buffers": False},
        "model = DDP(model); model.broadcast_buffers = False": {},  # the template's way
    }
    x, _ = local_batch(0, args, info)
    out: dict = {}
    for name, options in spellings.items():
        if any(option not in accepts for option in options):
            out[name] = None  # an older torch without this keyword
            continue
        model = bn_model(args.seed).to(info.device)
        buffer = model[1].running_mean
        buffer.fill_(info.rank + 1.0)  # rank-local: 1.0 on rank 0, 2.0 on rank 1, ...
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrap(model, info.device, **options)
        if name.startswith("model = DDP(model)"):
            ddp.broadcast_buffers = False  # a property: sets forward_sync_buffers on torch 2.13+
        after_init = buffer[0].item()
        buffer.fill_(info.rank + 1.0)
        ddp.eval()  # BatchNorm in eval mode does not update its running statistics
        ddp(x)
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        out[name] = {"after_init": after_init, "after_forward": buffer[0].item(),
                     "future_warning": future[0] if future else None}  # fmt: skip
    out["broadcast_before"] = broadcast_before(bn_model(args.seed), x, info.device)
    out["step_collectives"] = step_collectives(bn_model(args.seed), x, info.device)
    return out


def step_collectives(model: nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, int]:
    """The collectives of one steady training step of a BatchNorm model under DDP's defaults,
    counted by the profiler: the third step (the second rebuilds the buckets and broadcasts
    their new order, two broadcasts more)."""
    ddp = wrap(model.to(device), device)
    for _ in range(2):
        ddp(x).sum().backward()
    with torch.profiler.profile() as prof:
        ddp(x).sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("c10d::")]
    return {name: names.count(name) for name in sorted(set(names))}


def broadcast_before(model: nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, bool]:
    """Before which forwards DDP will copy rank 0's buffers (its own answer, asked just before
    each): a training loop, 3 micro-batches accumulated under no_sync, an evaluation under
    no_grad, then one with gradients on (no backward), which counts as a training forward."""
    ddp = wrap(model.to(device), device)
    seen: dict[str, bool] = {}

    def forward(name: str, grad: bool = True, sync: bool = True, backward: bool = True) -> None:
        seen[name] = ddp.will_sync_module_buffers()
        with torch.set_grad_enabled(grad), contextlib.nullcontext() if sync else ddp.no_sync():
            out = ddp(x)
            if grad and backward:
                out.sum().backward()

    forward("step 1")
    forward("step 2")
    forward("micro-batch 1, no_sync", sync=False)
    forward("micro-batch 2, no_sync", sync=False)
    forward("micro-batch 3, synced")
    forward("the step after")
    forward("evaluation 1, no_grad", grad=False)
    forward("evaluation 2, no_grad", grad=False)
    forward("training after the evaluation")
    forward("evaluation 3, gradients on", backward=False)
    forward("evaluation 4, no_grad", grad=False)
    return seen


def syncbn_collectives(info: DistInfo, channels: int = 4) -> dict:
    """A bare SyncBatchNorm on ranks with different batch sizes: its collectives, its statistics.

    Rank r gets ``2(r+1)`` rows whose per-channel mean is exactly ``3r``, so
    the mean over all rows (what SyncBatchNorm must use) differs from the
    average of the ranks' means (what an all_reduce of means would give).
    ``momentum=1`` makes the running mean equal to the batch mean it used.
    The ``torch.distributed`` functions it calls are recorded per phase.
    """
    counts = [2 * (r + 1) for r in range(info.world_size)]
    gen = torch.Generator().manual_seed(0)
    data = []
    for r, n in enumerate(counts):
        d = torch.randn(n, channels, generator=gen)
        data.append(d - d.mean(0) + 3.0 * r)
    layer = nn.SyncBatchNorm(channels, momentum=1.0).to(info.device)
    x = data[info.rank].to(info.device).requires_grad_(True)
    names = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce")
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    calls: dict[str, list[str]] = {"forward": [], "backward": []}
    phase = ["forward"]

    def spy(name: str):
        def call(*a, **k):
            calls[phase[0]].append(name)
            return originals[name](*a, **k)

        return call

    try:
        for n in originals:
            setattr(dist, n, spy(n))
        out = layer(x)
        phase[0] = "backward"
        out.pow(2).sum().backward()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    everything = torch.cat(data)
    return {"counts": counts, "forward": calls["forward"], "backward": calls["backward"],
            "running_mean": layer.running_mean.cpu(), "global_mean": everything.mean(0),
            "mean_of_rank_means": torch.stack([d.mean(0) for d in data]).mean(0)}  # fmt: skip


def exp_device_ids(args: argparse.Namespace, info: DistInfo) -> dict:
    """``device_ids`` names the ONE GPU of a GPU module; a CPU module takes none."""
    out: dict = {"device": str(info.device)}
    model = tiny_model(args.seed)
    if info.device.type == "cuda":
        ddp = wrap(model, info.device)
        x, _ = local_batch(0, args, info)
        out["device_ids"] = ddp.device_ids
        out["output_device"] = str(ddp(x).device)
    else:
        try:
            DDP(model, device_ids=[info.local_rank])  # the GPU recipe applied to a CPU module
            out["cpu_device_ids_error"] = None
        except ValueError as exc:
            out["cpu_device_ids_error"] = first_line(exc)
    return out


# -- Lesson 04's pitfalls: reentrant checkpointing with find_unused_parameters, and two
# forwards before one backward. The lesson shows Checkpointed and two_forwards as they stand.


class Checkpointed(nn.Module):
    """An MLP whose middle block is recomputed in backward (activation checkpointing)."""

    def __init__(self, seed: int, use_reentrant: bool | None, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(IN_FEATURES, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, NUM_CLASSES)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if self.use_reentrant is None:  # not passed: torch warns, then picks use_reentrant=True
            h = checkpoint(self.block, h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)  # saves memory
        return self.head(h)


CHECKPOINT_CASES = {
    "reentrant + find_unused_parameters": (True, {"find_unused_parameters": True}),
    "use_reentrant not passed + find_unused_parameters": (None, {"find_unused_parameters": True}),
    "use_reentrant=False + find_unused_parameters": (False, {"find_unused_parameters": True}),
    "reentrant + static_graph": (True, {"static_graph": True}),
}


def checkpointing(
    seed: int, x: torch.Tensor, y: torch.Tensor, device: torch.device, steps: int = 3
) -> dict[str, Any]:
    """Each of :data:`CHECKPOINT_CASES` trained ``steps`` steps: its error or its gradients."""
    out: dict[str, Any] = {}
    for name, (reentrant, options) in CHECKPOINT_CASES.items():
        ddp = wrap(Checkpointed(seed, reentrant), device, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:  # kept in the record, not printed
            warnings.simplefilter("always")
            try:
                for _ in range(steps):
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(ddp(x), y).backward()
                    grad = flat_grads(ddp)
                    opt.step()
                out[name] = {"error": None, "grad": grad}
            except RuntimeError as exc:  # raised in backward, on every rank alike
                out[name] = {"error": first_line(exc, lines=20), "grad": None}
        checkpoint_warnings = [str(w.message) for w in caught if "use_reentrant" in str(w.message)]
        out[name]["warning"] = checkpoint_warnings[0] if checkpoint_warnings else None
    return out


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option that stops the buffer copy before each forward, in this torch's spelling.

    ``forward_sync_buffers=False`` where this torch has it (2.13+; it still
    copies rank 0's buffers once, at construction: what you want here), else
    ``broadcast_buffers=False`` (which 2.14.1 deprecates with a FutureWarning
    and which, unlike the new name, also skips the copy at construction).
    """
    params = inspect.signature(DDP.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


def two_forwards(
    seed: int, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """Two halves of the batch through a BatchNorm model, one backward: three ways.

    ``two forwards``: the GAN pattern, buffers synced before each forward (default).
    ``no buffer sync``: the same computation without the buffer copy
    (:func:`no_forward_buffer_sync`).
    ``one combined forward``: both halves in one call — BatchNorm then
    normalises them *together*, a different computation.
    """
    half = x.shape[0] // 2
    parts = [(x[:half], y[:half]), (x[half:], y[half:])]
    out: dict[str, Any] = {}
    for name in ("two forwards", "no buffer sync", "one combined forward"):
        options = no_forward_buffer_sync() if name == "no buffer sync" else {}
        ddp = wrap(bn_model(seed), device, **options)
        try:
            if name == "one combined forward":
                loss = F.cross_entropy(ddp(x), y, reduction="sum") / 2
            else:
                loss = sum(F.cross_entropy(ddp(px), py, reduction="sum") for px, py in parts) / 2
            loss.backward()
            out[name] = {"error": None, "grad": flat_grads(ddp)}
        except RuntimeError as exc:  # torch 2.6 up to the fix: the buffer copy was in place
            out[name] = {"error": first_line(exc, lines=3), "grad": None}
    return out


def version_bumps(seed: int, x: torch.Tensor, device: torch.device) -> dict[str, list[int]]:
    """How much one forward advances each buffer's version counter, plain and under DDP.

    The counter is what autograd's "modified by an inplace operation" check reads. BatchNorm's
    own update of its statistics advances it; DDP's copy of rank 0's buffers before the forward
    adds to that unless the copy keeps the counters (the fix, PR #175851).
    """
    out = {}
    for name in ("plain", "ddp"):
        model = bn_model(seed).to(device)
        model = wrap(model, device) if name == "ddp" else model
        before = [b._version for b in model.buffers()]
        model(x)
        out[name] = [b._version - v for b, v in zip(model.buffers(), before, strict=True)]
    return out


def exp_pitfalls(args: argparse.Namespace, info: DistInfo) -> dict:
    """BatchNorm vs the one-process reference; checkpointing; two forwards, one backward."""
    ddp = wrap(bn_model(args.seed), info.device)  # same init everywhere: compare with one process
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    for step in range(args.steps):
        sgd_step(ddp, *local_batch(step, args, info), opt)
    x, y = local_batch(0, args, info)
    return {
        "bn_params_after_steps": flat_params(ddp),
        "checkpointing": checkpointing(args.seed, x, y, info.device),
        "two_forwards": two_forwards(args.seed, x, y, info.device),
        "version_bumps": version_bumps(args.seed, x, info.device),
    }


def exp_loss_norm(args: argparse.Namespace, info: DistInfo, k: int = 3) -> dict:
    """k micro-batches of variable-length sequences per rank under no_sync: a mean per
    micro-batch against the global token count (``global_token_loss``)."""
    batches = [
        (x.to(info.device), y.to(info.device)) for x, y in token_batches(info.rank, k, args.seed)
    ]
    n_global = sum((y != -100).sum() for _, y in batches).float()  # this rank's tokens ...
    local = int(n_global)
    dist.all_reduce(n_global)  # ... every rank's: the step's count, known before its forwards
    out: dict[str, Any] = {"local_tokens": local, "global_tokens": int(n_global)}
    for name in ("mean per micro-batch", "global token count"):
        ddp = wrap_model(token_model(args.seed), info.device, info.local_rank)
        for i, (x, y) in enumerate(batches):
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                logits = ddp(x)
                if name == "mean per micro-batch":  # the usual line: a mean over this batch
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / k
                else:
                    loss = global_token_loss(logits, y, n_global, info.world_size)
                loss.backward()
        out[name] = flat_grads(ddp).tolist()
    return out


@record
def main() -> None:
    args = parse_args()
    experiments = {
        "taught": exp_taught,
        "wrap": exp_wrap,
        "no_sync": exp_no_sync,
        "unused": exp_unused,
        "batchnorm": exp_batchnorm,
        "bn_cpu": exp_bn_cpu,
        "buffers": exp_buffers,
        "device_ids": exp_device_ids,
        "pitfalls": exp_pitfalls,
        "loss_norm": exp_loss_norm,
    }
    run_sections(experiments, args, args.out)


if __name__ == "__main__":
    main()
