"""The DDP training template: copy it, change the model and the data.

    torchrun --standalone --nproc-per-node 2 scripts/train.py             # CPU: 2 ranks, gloo
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 scripts/train.py --model resnet18 \\
        --amp --data cifar10 --data-dir data --batch-size 128 --num-workers 4 --checkpoint-dir ckpt

Every DDP step is written out below, numbered, in the order it happens on every rank; the
package holds what you should not rewrite (atomic save, safe load, the resumable sampler, exact
evaluation, the backend choice) and the recorder the lessons turn on with --out. Rerun with the
same --checkpoint-dir to resume from the newest snapshot, on any number of ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before init: see lesson 04 (torch <= 2.14)
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ddp_tutorial import checkpoint, distributed, settings, snapshots
from ddp_tutorial.comm_hooks import COMM_HOOKS, comm_hook
from ddp_tutorial.data import distributed_evaluate
from ddp_tutorial.models import MODEL_NAMES, build_model
from ddp_tutorial.numerics import amp_dtype, make_deterministic
from ddp_tutorial.preflight import check_run
from ddp_tutorial.real_data import DATA_KINDS, DataError, build_datasets
from ddp_tutorial.recorder import Recorder
from ddp_tutorial.samplers import ResumableSampler
from ddp_tutorial.seeding import loader_generator, rank_seed, seed_everything, seed_worker

REFERENCE_BATCH = 256  # --lr is the learning rate of a global batch of this size


def positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP training template (run it with torchrun).")
    add = p.add_argument
    add("--model", choices=MODEL_NAMES, default="cnn")
    add("--data", choices=DATA_KINDS, help="default: folder with --data-dir, else synthetic")
    add("--data-dir", help="folder: DIR/train/<class>/*.png|jpg + DIR/val/...; cifar10: root")
    add("--download", action="store_true", help="--data cifar10: download it (internet)")
    add("--image-size", type=positive, default=32, help="height = width, pixels")
    add("--num-classes", type=positive, default=10, help="synthetic data: classes")
    add("--num-samples", type=positive, default=8192, help="synthetic data: training samples")
    add("--num-val", type=positive, default=1000, help="synthetic data: validation samples")
    add("--epochs", type=positive, default=3)
    add("--batch-size", type=positive, default=32, help="PER RANK: global = this x ranks x accum")
    add("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, default=0.2, help="peak LR for a global batch of 256, scaled linearly")
    add("--warmup", type=float, default=0.05, help="fraction of training warming up, then cosine")
    add("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    add("--seed", type=int, default=0)
    add("--checkpoint-dir", help="snapshot-<step>.pt + final.pt; a rerun resumes from it")
    add("--save-every", type=int, default=0, help="steps between snapshots (0: epoch ends)")
    add("--max-steps", type=positive, help="stop early (the LR schedule still spans --epochs)")
    add("--log-every", type=positive, default=50, help="steps between loss prints (a host sync)")
    add("--amp", nargs="?", const="bf16", choices=["bf16", "fp16"], help="autocast: bf16 (a bare"
        " --amp), or fp16 with a GradScaler (GPUs without bf16: V100, T4)")  # fmt: skip
    add("--compile", nargs="?", const="inductor", help="torch.compile the DDP model (backend)")
    add("--comm-hook", choices=COMM_HOOKS, default="none", help="compress gradients on the wire")
    add("--sync-bn", action="store_true", help="SyncBatchNorm (GPUs with nccl only)")
    add("--pretrain", help="initial weights: a state_dict file (any device, any prefix)")
    add("--backend", help="auto (default), gloo or nccl")
    add("--deterministic", action="store_true", help="bitwise-reproducible kernels (slower)")
    add("--timeout", type=float, default=settings.timeout_s(default=600), help="seconds a "
        "collective may wait, a long rank-0 save included")  # fmt: skip
    add("--no-progress", action="store_true", help="no progress bar")
    lesson = p.add_argument_group("recording, for the lessons").add_argument
    lesson("--out", help="run directory: metrics.json, rank and attempt records")
    lesson("--record-steps", action="store_true", help="per-step loss/time (a sync per step)")
    lesson("--fail-at-step", type=int, help="fault injection (lesson 08): die after this step")
    lesson("--fail-rank", type=int, default=1, help="the rank that dies")
    args = p.parse_args(argv)
    if args.num_workers < 0 or args.save_every < 0 or args.timeout <= 0 or args.lr < 0:
        p.error("--num-workers, --save-every and --lr must be >= 0, --timeout > 0")
    if not 0 <= args.warmup < 1:
        p.error("--warmup is a fraction of training: 0 <= warmup < 1")
    return args


def data_loader(args: argparse.Namespace, train_set: Any, rank: int, world_size: int,
                cuda: bool) -> tuple[ResumableSampler, DataLoader]:  # fmt: skip
    """6. Each rank reads its own shard (padded: every rank takes the same steps), with its
    own random streams: the same seed everywhere would augment every shard in lock-step."""
    seed_everything(rank_seed(args.seed, rank))  # after building the model: dropout too
    sampler = ResumableSampler(train_set, world_size, rank, seed=args.seed)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=cuda, persistent_workers=args.num_workers > 0,
                        drop_last=True,  # no short last batch (the sampler equalised the shards)
                        worker_init_fn=seed_worker,  # and a generator: worker seeds differ per rank
                        generator=loader_generator(args.seed, rank))  # fmt: skip
    return sampler, loader


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to 0."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


@record  # a crash's traceback reaches torchrun's summary
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # 1. Who am I? torchrun gives every rank its identity in the environment.
    if "RANK" not in os.environ:
        sys.exit("train.py: start it with torchrun --standalone --nproc-per-node N train.py")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])

    def fail(message: str) -> NoReturn:  # every rank stops, one message per node
        if local_rank == 0:
            print(f"train.py: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    # 2. Data first: a bad folder or an impossible batch stops every rank in seconds.
    try:
        data = build_datasets(args)  # (train set, validation set, number of classes)
    except DataError as exc:
        fail(str(exc))
    if problem := check_run(args, world_size, len(data[0])):
        fail(problem)
    if args.deterministic:
        make_deterministic()  # before any CUDA work: cuBLAS reads its setting once

    # 3. The device, then the process group. Bind the GPU first: without set_device
    #    every rank's first CUDA call lands on cuda:0 (seed 000's bug).
    backend, why = distributed.job_backend(args.backend, rank, world_size, local_world)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if cuda := device.type == "cuda":
        torch.cuda.set_device(device)
    if args.sync_bn and backend != "nccl":
        fail(f"--sync-bn needs GPUs with nccl (this run: {backend} on {device}); drop it on CPU")
    dist.init_process_group(  # device_id: nccl makes this GPU's communicator now
        backend, rank=rank, world_size=world_size, device_id=device if cuda else None,
        timeout=timedelta(seconds=max(args.timeout, settings.init_timeout_s())),  # slow starts
        store=distributed.restart_safe_store(world_size))  # attempts kept apart  # fmt: skip
    distributed.set_collective_timeout(args.timeout)  # joined: a missing rank now fails fast
    try:
        train(args, rank, world_size, device, data, why)
        dist.barrier()  # on success, nobody tears down a connection a peer still uses
    finally:
        dist.destroy_process_group()  # on every exit path (seed 001 never calls it)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
          data: tuple[Any, Any, int], why: str) -> None:  # fmt: skip
    train_set, val_set, num_classes = data
    say = print if rank == 0 else (lambda *a, **k: None)
    global_batch = args.batch_size * world_size * args.grad_accum
    peak_lr = args.lr * global_batch / REFERENCE_BATCH
    say(f"{world_size} ranks ({why}); global batch {global_batch} = {args.batch_size} per rank x "
        f"{world_size} ranks x {args.grad_accum} accumulation; peak lr {args.lr} x {global_batch}"
        f"/{REFERENCE_BATCH} = {peak_lr:.4g}, {args.warmup:.0%} warm-up then cosine")  # fmt: skip

    # 4. The model: the same initial weights on every rank (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    model = build_model(args.model, num_classes, args.image_size)
    if args.pretrain:  # before wrapping; a file from DDP ("module.") or compile is fine
        checkpoint.load_model_state(model, args.pretrain, map_location="cpu")
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # 5. DDP: move to this rank's device first. Buffers are synced once here, not at every
    #    forward (a collective per step): they are averaged before evaluating and saving.
    cuda = device.type == "cuda"
    ddp = DDP(model.to(device), device_ids=[device.index] if cuda else None)
    ddp.broadcast_buffers = False  # (torch 2.14 also calls it forward_sync_buffers)
    if args.comm_hook != "none":  # replaces the bucket all_reduce (lesson 11)
        ddp.register_comm_hook(*comm_hook(args.comm_hook))
    model = torch.compile(ddp, backend=args.compile) if args.compile else ddp  # after DDP
    optimizer = torch.optim.SGD(ddp.parameters(), lr=peak_lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    amp = amp_dtype(device, args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16: scale losses
    sampler, loader = data_loader(args, train_set, rank, world_size, cuda)

    # 7. Resume from the newest snapshot, the one rank 0 sees, on any number of ranks.
    epoch, step, consumed, samples_seen, totals, history, resumed = 0, 0, 0, 0, [0.0, 0.0], [], None
    path = snapshots.agreed_latest_snapshot(args.checkpoint_dir)
    if path is not None:
        state = checkpoint.load_checkpoint(path, map_location=device)
        same_world = state["world_size"] == world_size
        where = snapshots.restore_training_state(state, ddp, optimizer, scaler, same_world)
        if not same_world:  # other ranks now: fresh random streams, still reproducible
            seed_everything(rank_seed(args.seed, rank, where["step"]))
        epoch, step, extra = where["epoch"], where["step"], state["extra"]
        consumed, samples_seen, history = extra["consumed"], extra["samples_seen"], extra["history"]
        totals = extra["loss_totals"] if rank == 0 else [0.0, 0.0]  # counted once, on rank 0
        resumed = {"epoch": epoch, "step": step, "consumed": consumed, "world": state["world_size"]}
        say(f"resumed from {path.name}: epoch {epoch}, step {step}, {consumed} samples into it "
            f"(written by {state['world_size']} ranks, now {world_size})")  # fmt: skip
    loss_sum = torch.tensor(totals, dtype=torch.float64, device=device)  # [sum, steps]

    def save_snapshot() -> None:  # a collective: buffers averaged, RNG states gathered
        if args.checkpoint_dir is None:
            return
        distributed.average_buffers(ddp)
        global_totals = loss_sum.clone()
        dist.all_reduce(global_totals)
        extra = {"consumed": consumed, "samples_seen": samples_seen, "history": history,
                 "loss_totals": global_totals.tolist(), "config": vars(args)}  # fmt: skip
        state = snapshots.training_state(
            ddp, optimizer, epoch=epoch, step=step, scaler=scaler, extra=extra
        )
        if rank == 0:  # global rank 0 only (local_rank 0 is one writer per node), atomically
            checkpoint.atomic_save(state, snapshots.snapshot_path(args.checkpoint_dir, step))
            snapshots.prune_snapshots(args.checkpoint_dir, keep=2)
        dist.barrier()  # the file is complete before anyone goes on (or resumes from it)

    rec = Recorder(args, rank, world_size, device, resumed)  # records only with --out
    total_samples = args.epochs * len(train_set)
    planned = len(sampler) // args.batch_size // args.grad_accum * args.epochs
    bar = tqdm(total=min(planned, args.max_steps or planned), initial=step, unit="step",
               disable=rank != 0 or args.no_progress, mininterval=5)  # fmt: skip
    stop = False
    while epoch < args.epochs and not stop:
        # 8. The loop. set_epoch: a new shuffle every epoch, the same on every rank.
        sampler.set_epoch(epoch, consumed)
        loader.generator.manual_seed(rank_seed(args.seed, rank, epoch, 1))
        micro_batches = len(loader) // args.grad_accum * args.grad_accum
        model.train()
        done = 0
        for i, (x, y) in zip(range(micro_batches), loader, strict=False):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = (i + 1) % args.grad_accum == 0
            with nullcontext() if last else ddp.no_sync():  # all_reduce on the last only
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=bool(amp)):
                    loss = loss_fn(model(x), y) / args.grad_accum  # mean over the micro-batches
                scaler.scale(loss).backward()  # DDP all_reduces buckets while backward runs
            loss_sum[0] += loss.detach()
            done, consumed = done + 1, consumed + args.batch_size * world_size
            if not last:
                continue
            lr = lr_at((samples_seen + global_batch) / total_samples, peak_lr, args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            scaler.step(optimizer)  # fp16: skipped on every rank if any gradient is inf/nan
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step, samples_seen = step + 1, samples_seen + global_batch
            loss_sum[1] += 1
            rec.step(step, loss.detach() * args.grad_accum)
            bar.update()
            if step % args.log_every == 0:  # .item() waits for the GPU: only every N steps
                say(f"step {step}: loss {loss.item() * args.grad_accum:.4f}, lr {lr:.4g}")
            if args.save_every and step % args.save_every == 0:
                save_snapshot()
            if stop := args.max_steps is not None and step >= args.max_steps:
                break
        # 9. Metrics over every rank's batches (all_reduce: every rank has them), then
        #    one model: BatchNorm statistics differ per rank until they are averaged.
        mean = loss_sum.clone()
        dist.all_reduce(mean)
        moved = distributed.average_buffers(ddp)
        rec.epoch_end(epoch, step, ddp.module, list(sampler)[: done * args.batch_size], moved)
        accuracy = distributed_evaluate(ddp, val_set, device=device).accuracy  # each sample once
        train_loss = (mean[0] / mean[1].clamp(min=1)).item()
        history.append({"epoch": epoch, "step": step, "train_loss": train_loss,
                        "val_accuracy": accuracy})  # fmt: skip
        say(f"epoch {epoch}: loss {train_loss:.4f}, val accuracy {accuracy:.1%}")
        if done == micro_batches:  # the epoch is complete (also when --max-steps ends on it)
            epoch, consumed = epoch + 1, 0
            loss_sum.zero_()
        save_snapshot()
    bar.close()

    # 10. The deliverable: the plain model (no "module." prefix), from global rank 0, atomically.
    if args.checkpoint_dir and rank == 0:
        checkpoint.atomic_save(ddp.module.state_dict(), Path(args.checkpoint_dir) / "final.pt")
    metrics = rec.finish(step, history, global_batch, {"peak_lr": peak_lr, "config": vars(args)})
    say(f"done: {step} steps, train loss {metrics['train_loss']:.4f}, val accuracy "
        f"{metrics['val_accuracy']:.1%}, {metrics['samples_per_sec']:.0f} samples/s")  # fmt: skip


if __name__ == "__main__":
    main()
