"""The DDP training template: copy it, change the model and the data.

    torchrun --standalone --nproc-per-node 2 scripts/train.py             # CPU: 2 ranks, gloo
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 scripts/train.py --model resnet18 \\
        --amp --data cifar10 --data-dir data --batch-size 128 --num-workers 4 --checkpoint-dir ckpt

Every DDP step is written out below, numbered, in the order it happens on every rank; the
package holds what you should not rewrite (atomic save, safe load, the resumable sampler, exact
evaluation, the backend choice) and the recorder the lessons turn on with --out. Rerun with the
same --checkpoint-dir to resume from the newest snapshot, on any number of ranks. For a week on
a cluster: a crash restarts from the newest snapshot (torchrun --max-restarts, any node count);
SIGTERM or SIGUSR1 (preemption, a time limit near; torchrun forwards SIGUSR1 only if listed in
--signals-to-handle, as train.sbatch does) saves the current step and every rank exits
75 (EX_TEMPFAIL) - the ranks' status, not the job's: torchrun, signalled too, exits 1, so the
job script requeues (scripts/slurm/train.sbatch: scontrol requeue from its USR1 trap); and a
failed save or a loss gone inf/nan stops every rank at once, naming the cause.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before init: see lesson 09 (torch <= 2.14)
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ddp_tutorial import checkpoint, distributed, loop, settings, snapshots, stores
from ddp_tutorial.comm_hooks import comm_hook
from ddp_tutorial.data import distributed_evaluate
from ddp_tutorial.loop import REFERENCE_BATCH, lr_at, set_lr
from ddp_tutorial.models import build_model
from ddp_tutorial.numerics import amp_dtype, make_deterministic
from ddp_tutorial.preflight import check_run
from ddp_tutorial.real_data import DataError, build_datasets
from ddp_tutorial.recorder import Recorder
from ddp_tutorial.samplers import ResumableSampler
from ddp_tutorial.seeding import loader_generator, rank_seed, seed_everything, seed_worker
from ddp_tutorial.stopping import PREEMPTED_EXIT, StopCheck


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags: ddp_tutorial.loop.template_parser (add yours there), defaults filled in."""
    return loop.parse_template_args(argv)


def data_loader(args: argparse.Namespace, train_set: Any, rank: int, world_size: int,
                cuda: bool) -> tuple[ResumableSampler, DataLoader]:  # fmt: skip
    """Each rank reads its own shard (padded: every rank takes the same steps), with its
    own random streams: the same seed everywhere would augment every shard in lock-step."""
    seed_everything(rank_seed(args.seed, rank))  # after building the model: dropout too
    sampler = ResumableSampler(train_set, world_size, rank, seed=args.seed)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=cuda, drop_last=True,  # the sampler equalised the shards
                        # Not persistent: workers then take each epoch's seed (loop below), so a
                        # resume at an epoch's start is exact; mid-epoch their draws are not saved.
                        persistent_workers=False, worker_init_fn=seed_worker,
                        generator=loader_generator(args.seed, rank))  # fmt: skip
    return sampler, loader


@record  # a crash's traceback reaches torchrun's summary
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # 1. Who am I? torchrun gives every rank its identity in the environment.
    if "LOCAL_RANK" not in os.environ:  # only a launcher sets it (a Kubeflow pod has RANK)
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
    torch.backends.cudnn.benchmark = not args.deterministic  # GPUs: time conv algorithms once

    # 3. The device, then the process group. Bind the GPU first: without set_device
    #    every rank's first CUDA call lands on cuda:0 (seed 000's bug).
    store, attempt = stores.job_store(rank, world_size)  # this restart's keys, agreed by all nodes
    backend, why = distributed.job_backend(args.backend, rank, world_size, local_world, store=store)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if cuda := device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    if args.sync_bn and backend != "nccl":
        fail(f"--sync-bn needs GPUs with nccl (this run: {backend} on {device}); drop it on CPU")
    dist.init_process_group(  # device_id: nccl makes this GPU's communicator now
        backend, rank=rank, world_size=world_size, device_id=device if cuda else None,
        timeout=timedelta(seconds=max(args.timeout, settings.init_timeout_s())),  # slow starts
        store=store)  # fmt: skip
    try:
        train(args, rank, world_size, device, data, why, attempt)
        dist.barrier()  # on success, nobody tears down a connection a peer still uses
    finally:
        dist.destroy_process_group()  # on every exit path (seed 001 never calls it)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
          data: tuple[Any, Any, int], why: str, attempt: int) -> None:  # fmt: skip
    train_set, val_set, num_classes = data
    say = partial(print, flush=True) if rank == 0 else (lambda *a: None)  # flushed: SLURM buffers
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
    ddp.broadcast_buffers = False  # synced at construction, not before every forward (lesson 04)
    if args.comm_hook != "none":  # replaces the bucket all_reduce (lesson 11)
        ddp.register_comm_hook(*comm_hook(args.comm_hook))
    model = torch.compile(ddp, backend=args.compile) if args.compile else ddp  # after DDP
    # AdamW, no weight decay on biases and norm weights; fused: fp16 steps need no host sync
    optimizer = loop.build_optimizer(args.optimizer, ddp, peak_lr, args.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    amp = amp_dtype(device, args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16: scale losses
    # 6. The data: a shard per rank, a random stream per rank (data_loader above).
    sampler, loader = data_loader(args, train_set, rank, world_size, cuda)

    # 7. Resume from the newest snapshot, the one rank 0 sees, on any number of ranks.
    epoch, step, consumed, samples_seen, totals, history, resumed = 0, 0, 0, 0, [0.0, 0.0], [], None
    best = -1.0  # the best validation accuracy so far (best.pt)
    path = snapshots.resume_point(args.checkpoint_dir)  # rank 0 first clears killed saves' temps
    if path is not None:
        state = checkpoint.load_checkpoint(path, map_location=device)
        same_world = state["world_size"] == world_size
        where = snapshots.restore_training_state(state, ddp, optimizer, scaler, same_world)
        if not same_world:  # other ranks now: fresh random streams, still reproducible
            seed_everything(rank_seed(args.seed, rank, where["step"]))
        epoch, step, extra = where["epoch"], where["step"], state["extra"]
        consumed, samples_seen, history = extra["consumed"], extra["samples_seen"], extra["history"]
        totals = extra["loss_totals"] if rank == 0 else [0.0, 0.0]  # counted once, on rank 0
        best, resumed = extra["best"], {"epoch": epoch, "step": step, "consumed": consumed,
                                        "world": state["world_size"]}  # fmt: skip
        say(f"resumed from {path.name}: epoch {epoch}, step {step}, {consumed} samples into it "
            f"(written by {state['world_size']} ranks, now {world_size})")  # fmt: skip
        if changed := snapshots.schedule_changes(extra["config"], vars(args)):
            say(f"WARNING: resumed with {', '.join(changed)}: the LR schedule jumps at step {step}")
    loss_sum = torch.tensor(totals, dtype=torch.float64, device=device)  # [sum, steps]
    checks = StopCheck(device, save_minutes=args.save_minutes)  # signals, inf/nan, timed saves
    log = loop.TrainLog(rank, args.log_every, global_batch, args.grad_accum, args.tensorboard)

    def save(obj: Any, name: str) -> None:  # every rank calls it: one writer, one outcome
        error, target = None, Path(args.checkpoint_dir) / name
        if rank == 0:  # global rank 0 only (local_rank == 0 is one writer per NODE)
            try:  # atomically: temp file, fsync, rename; a killed save never leaves half a file
                checkpoint.atomic_save(obj, target)
                snapshots.prune_snapshots(args.checkpoint_dir, keep=2)
            except Exception as exc:  # disk full, quota: raised on every rank below, not a hang
                error = f"{type(exc).__name__}: {exc}"
        checkpoint.share_outcome(error, target)  # a broadcast: rank 0's error on every rank

    def save_snapshot() -> None:  # a collective: buffers averaged, RNG states gathered
        rec.pause()  # saving is not training
        verdict = checks.check(step, True, ddp.parameters())  # inf/nan: raises on every rank
        if args.checkpoint_dir is not None:
            distributed.average_buffers(ddp)
            global_totals = loss_sum.clone()
            dist.all_reduce(global_totals)
            extra = {"consumed": consumed, "samples_seen": samples_seen, "best": best,
                     "history": history, "loss_totals": global_totals.tolist(),
                     "config": vars(args)}  # fmt: skip
            state = snapshots.training_state(
                ddp, optimizer, epoch=epoch, step=step, scaler=scaler, extra=extra
            )
            save(state, snapshots.snapshot_path(".", step).name)
            checks.saved()
        if verdict.stop:  # preempted: the snapshot holds this step, the rerun resumes from it
            say(f"{verdict.signal}: saved step {step}, exit {PREEMPTED_EXIT}: rerun to resume")
            sys.exit(PREEMPTED_EXIT)

    def evaluate() -> None:  # one model on every rank (buffers averaged), each sample once
        nonlocal best
        mean = loss_sum.clone()
        dist.all_reduce(mean)  # every rank's batches: all_reduce, so every rank has the mean
        moved = distributed.average_buffers(ddp)  # BatchNorm statistics differ per rank
        rec.evaluated(epoch, step, ddp.module, moved)
        accuracy = distributed_evaluate(ddp, val_set, device=device, num_workers=args.num_workers,
                                        pin_memory=cuda).accuracy  # fmt: skip
        train_loss = (mean[0] / mean[1].clamp(min=1)).item()
        history.append({"epoch": epoch, "step": step, "train_loss": train_loss,
                        "val_accuracy": accuracy})  # fmt: skip
        say(f"epoch {epoch}: step {step}, loss {train_loss:.4f}, val accuracy {accuracy:.1%}")
        log.scalars(step, "val", accuracy=accuracy)
        if accuracy > best and args.checkpoint_dir:  # the same on every rank: a collective save
            best = accuracy
            save(ddp.module.state_dict(), "best.pt")

    rec = Recorder(args, rank, world_size, device, resumed, attempt)  # records only with --out
    total_samples = args.epochs * len(train_set)
    planned = len(sampler) // args.batch_size // args.grad_accum * args.epochs
    bar = tqdm(total=min(planned, args.max_steps or planned), initial=step, unit="step",
               disable=rank != 0 or args.no_progress, mininterval=5)  # fmt: skip
    stop, no_norm = False, torch.tensor(math.nan)
    while epoch < args.epochs and not stop:
        # 8. The loop. set_epoch: a new shuffle every epoch, the same on every rank.
        sampler.set_epoch(epoch, consumed)
        loader.generator.manual_seed(rank_seed(args.seed, rank, epoch, 1))  # workers' seeds
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
            set_lr(optimizer, lr, peak_lr)
            norm = no_norm
            if args.clip_grad:  # after all_reduce, so every rank clips the same gradients
                scaler.unscale_(optimizer)  # fp16: clip the true gradients, not scaled ones
                norm = nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_grad)
            scaler.step(optimizer)  # fp16: skipped on every rank if any gradient is inf/nan
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step, samples_seen = step + 1, samples_seen + global_batch
            loss_sum[1] += 1
            checks.observe(step, loss)  # on the device: the first step whose loss is inf/nan
            rec.step(step, loss.detach())  # (records only with --out)
            bar.update()
            if rec.steps == 1:  # compiled and warmed up: from now on a missing rank fails fast
                distributed.set_collective_timeout(args.timeout)
            log.step(step, loss.detach(), lr, norm)  # the log line: .item() every N steps only
            verdict = checks.check(step)  # every 10 steps: one tiny all_reduce (signals, nan)
            if args.eval_every and step % args.eval_every == 0:
                evaluate()
            if verdict.stop or verdict.save or args.save_every and step % args.save_every == 0:
                save_snapshot()
            if stop := args.max_steps is not None and step >= args.max_steps:
                break
        # 9. Metrics over every rank's batches (all_reduce: every rank has them), then
        #    one model: BatchNorm statistics differ per rank until they are averaged.
        rec.epoch_done(epoch, sampler, done * args.batch_size)  # --record-indices only
        if not history or history[-1]["step"] != step:  # not just evaluated (--eval-every)
            evaluate()
        if done == micro_batches:  # the epoch is complete (also when --max-steps ends on it)
            epoch, consumed = epoch + 1, 0
            loss_sum.zero_()
        save_snapshot()
    bar.close()

    # 10. The deliverable: the plain model (no "module." prefix), from global rank 0, atomically.
    if args.checkpoint_dir:
        save(ddp.module.state_dict(), "final.pt")
    metrics = rec.finish(step, history, global_batch, {"peak_lr": peak_lr, "config": vars(args)})
    say(f"done: {step} steps, train loss {metrics['train_loss']:.4f}, val accuracy "
        f"{metrics['val_accuracy']:.1%}, {metrics['samples_per_sec']:.0f} samples/s")  # fmt: skip
    log.close()


if __name__ == "__main__":
    main()
