"""The DDP training template: copy it and ddp_kit.py (its sidecar) into your project, change
the model and the data (the flags of the built-in ones, --model, --data, --image-size, ..., then
do nothing). It trains a classifier: for a regression or multi-label classes, change loss_fn
and the data (float targets shaped like the model's output) and keep best.pt by --best-by
val_loss; another score: SCORES; samples of different lengths (sequences): COLLATE; a model
that returns a dict or a tuple: PREDICTION.
torch 2.10 or later (+ torchvision, numpy, tqdm) is all they need (slurm/train.sbatch: 2.12+).

    torchrun --standalone --nproc-per-node 2 train.py --checkpoint-dir checkpoints       # CPU: gloo
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 train.py --model resnet18 --amp \\
        --data cifar10 --data-dir data --batch-size 128 --num-workers 4 --checkpoint-dir checkpoints
    python train.py --max-steps 5          # a world of one: step through it in a debugger

Every DDP step is written out below, numbered, in the order it happens on every rank. Rerun
with the same --checkpoint-dir to resume from the newest snapshot, on any number of ranks
(a damaged one is renamed *.corrupt and the one before it used: --keep 2 or more).
What a scheduler sees: on SIGTERM or SIGUSR1 (torchrun forwards SIGUSR1 only when
--signals-to-handle lists it) once training has begun (during start-up a signal ends the ranks
as it would any process: nothing new to save) every rank saves the current step and exits 75,
but torchrun,
signalled too, re-raises the signal and exits 1: the job script requeues the job itself
(slurm/train.sbatch: scontrol requeue in its USR1 trap). A crash restarts from the newest
snapshot (torchrun --max-restarts); a loss gone inf/nan or a failed save stops every rank at
once and writes failed.json (so does data the evaluation cannot score, kit.DataError, once
training has begun: outputs it cannot score at all stop the start in seconds, with no file),
which makes every restart stop at once until you fix the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import operator
import os
import sys
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before init: see lesson 09 (torch <= 2.14)
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, default_collate
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ddp_kit.py, beside this file
import ddp_kit as kit  # noqa: E402

REFERENCE_BATCH = 256  # --lr is the learning rate of a global batch of this size
OPTIMIZERS = {"adamw": (3e-3, 0.05), "sgd": (0.2, 5e-4)}  # default --lr, --weight-decay
FAILED = "failed.json"  # why the last run stopped for good: a restart would only repeat it
HOOK = "ddp_tutorial.recorder"  # --out's module: the course's recorder, never in a copy
# The scores of an evaluation, each named once: +1 when higher is better, how it prints.
# Another score (a regression's MAE): a line here, one in scores_of, and its sum in
# kit.local_sums with its field in kit.EvalResult (kit.distributed_evaluate fills it).
# What a resume compares to say that the data changed under it (a warning, the run goes on).
DATA_FLAGS = ("data", "data_dir", "num_samples", "seed", "image_size")
VAL_FLAGS = ("data", "data_dir", "image_size", "num_val", "num_classes", "seed")  # synthetic: all
SCORES = {"val_loss": (-1, "{:.4f}"), "val_accuracy": (+1, "{:.1%}")}
# How samples become a batch, for training and evaluation alike: None stacks them (torch's
# default). Sequences: a function defined in this file that pads them; it may return the model
# (tokens, lengths) or a dict of tensors as inputs, and -100 marks targets that do not count
# (a step is the mean over every rank's counted targets: section 8; loss_fn: a mean).
COLLATE = None
# Where the model's scores hold the classes: 1, (B, C, ...) as cross_entropy takes them; -1,
# (B, ..., C) as a language model gives them, with a loss_fn that flattens both.
CLASS_DIM = 1
# What of the model's output is scored (class scores, a regression's values): None, the output
# itself; a model that returns a dict or a tuple: a function of it (lambda out: out["logits"]).
# loss_fn always receives the whole output. Both are tried on two samples before training.
PREDICTION = None


def positive(text: str, least: int = 1) -> int:
    if int(text) < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
    return int(text)


def count(text: str) -> int:  # 0 or more: 0 turns the thing off
    return positive(text, 0)


def seed(text: str) -> int:  # numpy's range (a ns timestamp overflows torch's manual_seed)
    if not 0 <= int(text) < 2**32:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 2**32, got {text}")
    return int(text)


def amount(text: str) -> float:  # nan, inf and negatives stop here, not deep inside torch
    if not 0 <= float(text) < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return float(text)


def parser() -> argparse.ArgumentParser:
    """The flags: add yours here."""
    p = argparse.ArgumentParser(description="DDP training template (start it with torchrun).")
    add = p.add_argument
    add("--model", choices=kit.MODEL_NAMES, default="cnn")
    add("--data", choices=kit.DATA_KINDS, help="default: folder with --data-dir, else synthetic")
    add("--data-dir", help="folder: DIR/train/<class>/*.png|jpg + DIR/val/...; cifar10: root")
    add("--download", action="store_true", help="--data cifar10: download it (one process)")
    add("--image-size", type=positive, default=32, help="height = width, pixels")
    add("--num-classes", type=positive, default=10, help="synthetic data: classes")
    add("--num-samples", type=positive, default=8192, help="synthetic data: training samples")
    add("--num-val", type=positive, default=1000, help="synthetic data: validation samples")
    add("--epochs", type=positive, default=3)
    add("--batch-size", type=positive, default=32, help="PER RANK: global = this x ranks x accum")
    add("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    add("--optimizer", choices=OPTIMIZERS, default="adamw", help="adamw, or sgd (momentum 0.9)")
    add(
        "--lr",
        type=amount,
        help=f"peak LR for a global batch of {REFERENCE_BATCH}, scaled to the run's: x k for "
        "sgd, x sqrt(k) for adamw (default: 3e-3 adamw, 0.2 sgd)",
    )
    add(
        "--weight-decay",
        type=amount,
        help="not on biases and norm weights (default: 0.05 adamw, 5e-4 sgd)",
    )
    add("--warmup", type=amount, default=0.05, help="fraction of training warming up, then cosine")
    add("--clip-grad", type=amount, default=1.0, help="max gradient norm, logged (0: off)")
    add(
        "--num-workers",
        type=count,
        default=0,
        help="DataLoader workers per rank (resumed "
        "mid-epoch: the same samples, but the rest of the epoch's random augmentation differs)",
    )
    add("--seed", type=seed, default=0)
    add("--checkpoint-dir", help="snapshot-<step>.pt, best.pt, final.pt; a rerun resumes from it")
    add("--best-by", choices=SCORES, default="val_accuracy",
        help="best.pt: the highest val accuracy, or the lowest val loss")  # fmt: skip
    add(
        "--save-every",
        type=count,
        default=0,
        help="snapshot at epoch ends, and every N steps if >0",
    )
    add("--save-minutes", type=amount, default=30, help="and a snapshot this often (0: off)")
    add("--keep", type=positive, default=2, help="snapshots kept (>= 2: one to fall back to)")
    add(
        "--eval-every",
        type=count,
        default=0,
        help="evaluate at epoch ends, and every N steps if >0",
    )
    add("--max-steps", type=positive, help="stop early (the LR schedule still spans --epochs)")
    add("--log-every", type=positive, default=50, help="steps between log lines (a host sync)")
    add("--tensorboard", help="rank 0 writes TensorBoard scalars to this folder")
    add(
        "--amp",
        nargs="?",
        const="bf16",
        choices=["bf16", "fp16"],
        help="autocast: bf16 (a bare"
        " --amp), or fp16 with a GradScaler (GPUs without bf16: V100, T4)",
    )
    add("--compile", nargs="?", const="inductor", help="torch.compile the DDP model (backend)")
    add(
        "--comm-hook",
        choices=kit.COMM_HOOKS,
        default="none",
        help="compress gradients on the "
        "wire (powersgd: a resume restarts its error feedback and its plain warm-up steps)",
    )
    add("--sync-bn", action="store_true", help="SyncBatchNorm (GPUs with nccl only)")
    add("--pretrain", help="initial weights: a state_dict (any device, module. stripped)")
    add("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    add(
        "--deterministic",
        action="store_true",
        help="bitwise-reproducible kernels (slower; "
        "CUDA has none for cross_entropy over (B, C, T...): flatten those to (N, C))",
    )
    add(
        "--timeout",
        type=amount,
        default=600,
        help="seconds a collective may wait once the "
        "first step ran (a long rank-0 save included); joining may take --init-timeout",
    )
    add("--init-timeout", type=amount, default=600, help="seconds every rank may take to join")
    add("--no-progress", action="store_true", help="no progress bar (none off a terminal)")
    add("--out", help="the course's records (needs the course's package): the one hook")
    for action in p._actions:  # --help shows every default
        shown = action.default is not None and action.default is not False  # 0 is shown
        if shown and action.default != argparse.SUPPRESS and "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, the optimizer's defaults filled in, checked; what is left goes to --out's hook."""
    p = parser()
    args, args.hook_argv = p.parse_known_args(argv)
    if args.hook_argv and not args.out:
        p.error(f"unrecognized arguments: {' '.join(args.hook_argv)}")
    lr, decay = OPTIMIZERS[args.optimizer]
    args.lr = lr if args.lr is None else args.lr
    args.weight_decay = decay if args.weight_decay is None else args.weight_decay
    for flag in ("timeout", "init_timeout"):  # torch waits in ns: 292 years overflow, at start
        if not 1 <= getattr(args, flag) <= 365 * 86400:  # under a second: fails inside gloo
            p.error(f"--{flag.replace('_', '-')} must be at least 1 and at most 31536000 (s)")
    args.data = args.data or ("folder" if args.data_dir else "synthetic")  # as the help says
    if not 0 <= args.warmup < 1:
        p.error("--warmup is a fraction of training: 0 <= warmup < 1")
    return args


def check_run(args: argparse.Namespace, world_size: int, train_size: int | None) -> str | None:
    """What makes this run impossible, naming the flag (None: it can run). Before the data
    (``train_size`` None) and again after: a bad setting stops every rank in seconds."""
    # the built-in data's flags (yours instead of kit.build_datasets: drop this check with them)
    if args.download and args.data != "cifar10":  # taken and ignored before: a mistyped --data?
        kind = args.data or ("folder" if args.data_dir else "synthetic")
        return f"--download fetches --data cifar10 only, not {kind} data: drop it, or add --data"
    if args.download and world_size > 1:  # every rank would download into the same files
        return (
            f"--download with {world_size} ranks: each would download into the same files "
            f"at once. Download once, with one process: torchrun --nproc-per-node 1 train.py "
            f"--data {args.data} --data-dir {args.data_dir} --download --max-steps 1; then "
            f"start this job without --download"
        )
    folders = (("--checkpoint-dir", args.checkpoint_dir), ("--out", args.out),
               ("--tensorboard", args.tensorboard))  # fmt: skip
    for name, path in folders:
        try:
            if path:  # made now: a file in the way fails before training, not at the save
                Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            what = "is a file" if Path(path).is_file() else exc.strerror
            return f"{name} {path}: {what}; give a directory this user can write to"
        if path and not os.access(path, os.W_OK):
            return f"{name} {path}: not writable by this user; give another directory"
    if args.compile and args.compile not in (known := torch.compiler.list_backends(())):
        return f"--compile {args.compile}: not a torch.compile backend; one of {', '.join(known)}"
    if args.pretrain and not Path(args.pretrain).is_file():
        return f"--pretrain {args.pretrain}: no such file"
    if args.out and importlib.util.find_spec(HOOK.split(".")[0]) is None:
        return ("--out is the course's recorder, from the course's package (not installed "
                "here): leave --out out in your own project")  # fmt: skip
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return "--tensorboard needs the tensorboard package: pip install tensorboard"
    if args.checkpoint_dir and (failed := Path(args.checkpoint_dir) / FAILED).is_file():
        try:
            why = json.loads(failed.read_text())["error"]
        except (ValueError, KeyError):  # not the template's (a hand-made or damaged file)
            why = "(the file says no more)"
        return (
            f"{failed} says the last run stopped for good: {why}. Fix that, delete the file, rerun"
        )
    if args.keep < 2:
        return ("--keep 1 leaves no snapshot to fall back to when the newest is damaged (a "
                "crash mid-write, a full disk): keep 2 or more")  # fmt: skip
    if train_size is None:
        return None
    per_rank = math.ceil(train_size / world_size)  # the sampler pads shards to equal size
    steps = per_rank // (args.batch_size * args.grad_accum) * args.epochs
    if steps == 0:
        return (
            f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than the "
            f"{per_rank} samples each of {world_size} ranks gets: no step could run. Lower "
            f"--batch-size or use more data than {train_size} samples"
        )
    last = min(steps, args.max_steps or steps)
    run = f"the run's {last} steps" + (" (--max-steps)" if last < steps else "")
    for flag, every in (("--save-every", args.save_every), ("--eval-every", args.eval_every)):
        if every > last:
            return f"{flag} {every} is beyond {run}: lower it, or 0"
    return None


def data_loader(
    args: argparse.Namespace, train_set: Any, rank: int, world_size: int, cuda: bool
) -> tuple[kit.ResumableSampler, DataLoader]:
    """Each rank reads its own shard (padded: every rank takes the same steps), with its
    own random streams: the same seed everywhere would augment every shard in lock-step."""
    kit.seed_everything(kit.rank_seed(args.seed, rank))  # after building the model: dropout too
    sampler = kit.ResumableSampler(train_set, world_size, rank, seed=args.seed)
    loader = DataLoader(
        train_set,
        args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=cuda,
        collate_fn=COLLATE,
        drop_last=True,  # the sampler equalised the shards
        # Not persistent: workers then take each epoch's seed (loop below), so a
        # resume at an epoch's start is exact; mid-epoch their draws are not saved.
        persistent_workers=False,
        multiprocessing_context=kit.worker_context(args.num_workers, train_set),
        worker_init_fn=kit.seed_worker,
        generator=kit.loader_generator(args.seed, rank),
    )
    return sampler, loader


@record  # a crash's traceback reaches torchrun's summary
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # 1. Who am I? torchrun gives every rank its identity in the environment.
    if "LOCAL_RANK" not in os.environ:  # only a launcher sets it (a Kubeflow pod has RANK)
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            sys.exit("train.py: start it with torchrun --standalone --nproc-per-node N train.py")
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="0",
        )  # a world of one
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])

    def fail(message: str, everywhere: bool = False) -> NoReturn:  # one message per node
        if local_rank == 0 or everywhere:
            print(f"train.py: error: {message}", file=sys.stderr, flush=True)
        else:  # local rank 0 fails the same check and says why: exiting first could let
            time.sleep(30)  # torchrun kill it before it printed (seen on a loaded host)
        sys.exit(2)

    # 2. Flags, then data: a bad folder or an impossible batch stops every rank in seconds.
    if problem := check_run(args, world_size, None):
        fail(problem)
    try:  # each rank checks its share of an image folder's files (a rank that finds one says so)
        # yours instead: (train set, val set, number of classes), samples (input, class index);
        # a regression's: (input, float target shaped like the output), and the output size
        data = kit.build_datasets(args, rank, world_size)  # (train set, val set, classes)
    except kit.DataError as exc:
        fail(str(exc), everywhere=True)
    if problem := check_run(args, world_size, len(data[0])):
        fail(problem)
    if not len(data[1]):  # found after an epoch otherwise, with nothing saved
        fail("the validation set is empty: the evaluations and best.pt need one (DIR/val/<class>/"
             " with --data-dir, --num-val with synthetic data)")  # fmt: skip
    try:  # one validation sample's target, collated as the evaluation will
        target = torch.as_tensor((COLLATE or default_collate)([data[1][0]])[1])
    except (KeyError, IndexError, TypeError) as exc:
        fail(f"a validation sample, collated, is not (inputs, target) ({exc!r}): return "
             "that pair from your Dataset, or from COLLATE (a dict: (s['x'], s['y']))")  # fmt: skip
    if args.best_by == "val_accuracy" and target.is_floating_point():
        fail(
            "--best-by val_accuracy counts classes, and these targets are floats (a "
            "regression, multi-label classes?): use --best-by val_loss, or make it the default "
            "in your copy"
        )
    if args.deterministic:
        kit.make_deterministic()  # before any CUDA work: cuBLAS reads its setting once
    torch.backends.cudnn.benchmark = not args.deterministic  # GPUs: time conv algorithms once

    # 3. The device, then the process group. Bind the GPU first: without set_device
    #    every rank's first CUDA call lands on cuda:0 (seed 002's stray contexts, lesson 03).
    store, attempt = kit.job_store(rank, world_size, args.init_timeout)  # this restart's keys
    try:  # every rank reaches the same verdict (the store): one line, no traceback
        backend, why = kit.agreed_backend(args.backend, rank, world_size, local_world, store)
    except kit.BackendError as exc:
        fail(str(exc))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if cuda := device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    try:  # bf16 on a GPU that only emulates it (V100, T4): a line now, not a traceback later
        kit.amp_dtype(device, args.amp)
    except ValueError as exc:
        fail(str(exc))
    if args.sync_bn and backend != "nccl":
        fail(f"--sync-bn needs GPUs with nccl (this run: {backend} on {device}); drop it on CPU")
    dist.init_process_group(  # device_id: nccl makes this GPU's communicator now
        backend,
        rank=rank,
        world_size=world_size,
        device_id=device if cuda else None,
        timeout=timedelta(seconds=max(args.timeout, args.init_timeout)),
        store=store,
    )
    held = None  # one job per --checkpoint-dir: rank 0 locks it before touching anything
    try:
        busy = None
        if rank == 0 and args.checkpoint_dir:
            try:
                held = kit.hold_folder(args.checkpoint_dir)
            except kit.FolderInUse as exc:
                busy = str(exc)
        if busy := kit.from_rank0(busy):  # no failed.json: the folder is the other job's
            fail(busy)
        sizes = torch.tensor([len(data[0]), len(data[1])], device=device)
        extremes = torch.stack([sizes, -sizes])  # the largest sizes, and the smallest
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # else: a hang at the first epoch's end
        if bool((extremes[0] != -extremes[1]).any()):
            (most_t, most_v), (least_t, least_v) = extremes[0].tolist(), (-extremes[1]).tolist()
            raise kit.DataError(
                f"the ranks' data sets differ in size (train {least_t} to "
                f"{most_t} samples, val {least_v} to {most_v}): every rank "
                "must build the same sets - is a node's copy out of date?"
            )
        train(args, rank, world_size, device, data, why, attempt)
        dist.barrier()  # on success, nobody tears down a connection a peer still uses
    except (kit.DivergedError, kit.CheckpointError, kit.DataError) as exc:  # a line, no traceback
        get_error_handler().record_exception(exc)  # torchrun's summary shows the traceback
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:  # plain python: no summary, print it
            traceback.print_exc()
        line = f"[rank{rank}]: train.py: error: {type(exc).__name__}: {exc}\n"
        sys.stderr.write(line)  # one write: print's text and newline can interleave across ranks
        sys.exit(1)
    finally:
        if held is not None:
            held.close()  # the lock: another job (or this one in the same process) may go on
        dist.destroy_process_group()  # on every exit path (seed 001 never calls it)


def train(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    device: torch.device,
    data: tuple[Any, Any, int],
    why: str,
    attempt: int,
) -> None:
    train_set, val_set, num_classes = data
    say = partial(print, flush=True) if rank == 0 else (lambda *a: None)  # flushed: SLURM buffers
    global_batch = args.batch_size * world_size * args.grad_accum
    # lesson 02's rule: a global batch k times the reference's takes lr x k (SGD), x sqrt(k) (AdamW)
    k = global_batch / REFERENCE_BATCH
    peak_lr = args.lr * (k if args.optimizer == "sgd" else math.sqrt(k))
    say(
        f"{ranks(world_size)} ({why}); global batch {global_batch} = "
        f"{args.batch_size} per rank x {ranks(world_size)} x {args.grad_accum} accumulation; "
        f"peak lr {args.lr} scaled for {global_batch}/{REFERENCE_BATCH} ({args.optimizer}) = "
        f"{peak_lr:.4g}, {args.warmup:.0%} warm-up then cosine"
    )
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt is None:
        say("WARNING: no --checkpoint-dir: nothing is saved (no snapshot, best.pt or final.pt)")

    # 4. The model: the same initial weights on every rank (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    model = kit.build_model(args.model, num_classes, args.image_size)  # yours: any nn.Module
    if args.pretrain:  # weights_only: a file that would run code is refused, not executed
        kit.load_model_state(model, args.pretrain, map_location="cpu")
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # 5. DDP: move to this rank's device first. Buffers are synced once here, not at every
    #    forward (a collective per step): they are averaged before evaluating and saving.
    #    Parameters that some steps leave unused (a head for some batches only): add
    #    find_unused_parameters=True (lesson 04), or DDP waits for their gradients.
    cuda = device.type == "cuda"
    ddp = DDP(model.to(device), device_ids=[device.index] if cuda else None)
    ddp.broadcast_buffers = False  # torch 2.13+: a property that sets forward_sync_buffers
    if args.comm_hook != "none":  # replaces the bucket all_reduce (lesson 11)
        ddp.register_comm_hook(*kit.comm_hook(args.comm_hook))
    model = torch.compile(ddp, backend=args.compile) if args.compile else ddp  # after DDP
    # AdamW, no weight decay on biases and norm weights; fused: fp16 steps need no host sync
    optimizer = kit.build_optimizer(args.optimizer, ddp, peak_lr, args.weight_decay)
    loss_fn = nn.CrossEntropyLoss().to(device)  # a mean; .to: class weights on the device
    scoring = {"loss_fn": loss_fn, "class_dim": CLASS_DIM, "prediction": PREDICTION}
    kit.check_scoring(ddp, val_set, device, COLLATE, **scoring)  # kit.DataError in seconds
    amp = kit.amp_dtype(device, args.amp)
    autocast = partial(torch.autocast, device.type, dtype=amp or torch.float32, enabled=bool(amp))
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16: scale losses
    # 6. The data: a shard per rank, a random stream per rank (data_loader above).
    sampler, loader = data_loader(args, train_set, rank, world_size, cuda)

    # 7. Resume from the newest snapshot, the one rank 0 sees, on any number of ranks.
    epoch, step, consumed, samples_seen, history, resumed = 0, 0, 0, 0, [], None
    since = 0  # where this world size took over the epoch (the sampler pads from there)
    totals, window = [0.0, 0.0], [0.0, 0.0]  # the epoch's [loss sum, targets]; the log line's
    best, owed = -math.inf, False  # the best score so far (best.pt, --best-by); owed: below
    rescored = []  # flags that changed the validation set: best.pt's score is not comparable
    try:  # weights_only: runs no code; a damaged newest snapshot: the one before it
        found = kit.load_resume_point(ckpt, map_location=device)
    except kit.CheckpointError as exc:  # a restart would only repeat it
        stopped_for_good(exc, ckpt, rank, step)
        raise
    if found is not None:
        path, state, passed_over = found
        for bad in passed_over:
            say(f"WARNING: {bad.name} could not be loaded: renamed {bad.name}.corrupt")
        same_world = state["world_size"] == world_size
        if (was := state["extra"]["config"].get("optimizer", args.optimizer)) != args.optimizer:
            raise kit.CheckpointError(
                f"{path} holds {was}'s state, which {args.optimizer} cannot continue: resume "
                f"with --optimizer {was}, or start a new --checkpoint-dir (--pretrain {path})"
            )
        try:
            where = kit.restore_training_state(state, ddp, optimizer, scaler, same_world)
        except kit.CheckpointError as exc:  # another model's snapshot: say which file
            raise kit.CheckpointError(f"{path}: {exc}") from exc
        optimizer.param_groups[0]["weight_decay"] = args.weight_decay  # the flag's, not the file's
        if not same_world:  # other ranks now: fresh random streams, still reproducible
            kit.seed_everything(kit.rank_seed(args.seed, rank, where["step"]))
        epoch, step, extra = where["epoch"], where["step"], state["extra"]
        consumed, samples_seen, history = extra["consumed"], extra["samples_seen"], extra["history"]
        since = extra.get("since", consumed) if same_world else consumed  # same: its own padding
        totals = extra.get("loss_sums", [0.0, 0.0]) if rank == 0 else [0.0, 0.0]  # once
        window = extra.get("log_window", [0.0, 0.0]) if rank == 0 else [0.0, 0.0]
        resumed = {"epoch": epoch, "step": step, "consumed": consumed, "world": state["world_size"]}
        say(
            f"resumed from {path.name}: epoch {epoch}, step {step}, {consumed} samples into it "
            f"(written by {ranks(state['world_size'])}, now {world_size})"
        )
        saved = extra["config"]
        changed = kit.schedule_changes(saved, vars(args))
        was = state["world_size"] * saved["batch_size"] * saved["grad_accum"]
        if was == global_batch:  # per-rank batch and accumulation count through it alone
            changed = [c for c in changed if not c.startswith(("--batch-size", "--grad-accum"))]
        elif not same_world:  # the global batch follows the ranks, and the peak LR follows it
            changed.append(f"{state['world_size']} -> {world_size} ranks (global batch {was} -> "
                           f"{global_batch})")  # fmt: skip
        if changed:
            say(f"WARNING: resumed with {', '.join(changed)}: the LR schedule jumps at step {step}")
        if decay := kit.schedule_changes(extra["config"], vars(args), ("weight_decay",)):
            say(f"WARNING: resumed with {decay[0]}: it applies from step {step} on")
        if args.pretrain:  # loaded into the model above, then replaced by the snapshot's
            say(f"NOTE: --pretrain {args.pretrain} is for a new run: this one goes on from "
                f"{path.name}'s weights")  # fmt: skip
        if consumed and args.num_workers:  # their generators are not in the snapshot
            say(
                "WARNING: a mid-epoch resume with --num-workers > 0: the same samples, other "
                "random augmentation for the rest of this epoch (exact again from the next)"
            )
        then = dict(extra["config"])  # older snapshots: data None, the default as a word now
        then["data"] = then.get("data") or ("folder" if then.get("data_dir") else "synthetic")
        if data := kit.schedule_changes(then, vars(args), DATA_FLAGS):
            say(f"WARNING: resumed with {', '.join(data)}: other samples or another order")
        checked = VAL_FLAGS if args.data == "synthetic" else VAL_FLAGS[:3]  # what the set is
        rescored = kit.schedule_changes(then, vars(args), checked)
        if consumed and extra.get("train_size", len(train_set)) != len(train_set):
            say(f"WARNING: {extra['train_size']} training samples then, {len(train_set)} now: "
                f"epoch {epoch}'s position points at other samples; it starts over")  # fmt: skip
            consumed = since = 0
            totals = [0.0, 0.0]  # the epoch's loss sums: begun again too
        best, owed = extra["best"], extra.get("eval_owed", False)
        if rescored:  # a score on another set: the next evaluation replaces best.pt
            best = -math.inf
            say(f"WARNING: resumed with {', '.join(rescored)}: another validation set, "
                "whose next evaluation replaces best.pt")  # fmt: skip
        if extra["config"].get("best_by", "val_accuracy") != args.best_by:  # another score
            best = -math.inf
            say(f"WARNING: --best-by {args.best_by} now: the next evaluation replaces best.pt")
        del found, state  # its tensors are in the model now: not a second copy on the GPU
    if ckpt and not rescored and (ckpt / "best.json").is_file():  # may be newer than snapshot
        try:
            held = json.loads((ckpt / "best.json").read_text())
        except ValueError:  # empty or cut short (a crash): the snapshot's best decides
            held = {}
        if not isinstance(held, dict) or not held:  # [] or 3 is no record either (helper 150)
            held = {}
            say("WARNING: best.json is damaged: the snapshot's best score decides over best.pt")
        if held.get("best_by", "val_accuracy") == args.best_by:  # older files: accuracy only
            best = max(best, held.get("score", held.get("val_accuracy", -math.inf)))
    best = kit.from_rank0(best)  # as rank 0 reads the folder: a save is a collective
    loss_sum = torch.tensor(totals, dtype=torch.float64, device=device)  # [sum, targets]
    checks = kit.StopCheck(device, save_minutes=args.save_minutes if ckpt else 0)
    log = kit.TrainLog(rank, args.log_every, global_batch, args.tensorboard, loss_sum, window,
                       purge_step=step + 1 if resumed else None)  # fmt: skip
    hook = instruments(args, rank, world_size, device, resumed, attempt)  # None without --out

    def save(obj: Any, name: str, note: dict[str, Any] | None = None) -> None:  # every rank
        error, target = None, ckpt / name
        if rank == 0:  # global rank 0 only (local_rank == 0 is one writer per NODE)
            try:  # atomically: temp file, fsync, rename; a killed save never leaves half a file
                kit.atomic_save(obj, target)
                if note is not None:  # what best.pt scored, for a resume from an older snapshot
                    write_json(target.with_suffix(".json"), note)
                kit.prune_snapshots(ckpt, keep=args.keep)
            except Exception as exc:  # disk full, quota: raised on every rank below, not a hang
                error = f"{type(exc).__name__}: {exc}"
        kit.share_outcome(error, target)  # a broadcast: rank 0's error on every rank

    def save_snapshot() -> None:  # a collective: buffers averaged, RNG states gathered
        verdict = checks.check(step, True, weights(ddp))  # inf/nan: raises on every rank
        if ckpt is not None:  # one model saved; each rank trains on with its own statistics
            own = kit.buffers_of(ddp)
            kit.average_buffers(ddp)
            global_totals = torch.cat([loss_sum, log.window(loss_sum)])
            dist.all_reduce(global_totals)  # every rank's: the epoch's, the log line's so far
            extra = {
                "consumed": consumed,
                "since": since,
                "train_size": len(train_set),  # a resume on another data set restarts the epoch
                "samples_seen": samples_seen,
                "best": best,
                "eval_owed": owed,  # this step's evaluation was stopped: the rerun's first act
                "history": history,
                "loss_sums": global_totals[:2].tolist(),  # the epoch's [loss sum, targets]
                "log_window": global_totals[2:].tolist(),  # since the last log line
                "config": {k: v for k, v in vars(args).items() if k != "hook_argv"},
            }
            state = kit.training_state(
                ddp, optimizer, epoch=epoch, step=step, scaler=scaler, extra=extra, own_buffers=own
            )
            save(state, kit.snapshot_path(".", step).name)  # the model: the averaged buffers
            kit.put_buffers(ddp, own)  # after: the state's tensors share storage with them
            checks.saved()
        if verdict.stop:  # preempted: the snapshot holds this step, the rerun resumes from it
            done = f"saved step {step}" if ckpt else "nothing saved (no --checkpoint-dir)"
            launcher = "TORCHELASTIC_ERROR_FILE" in os.environ  # plain python: this exit is all
            say(
                f"{verdict.signal}: {done}, exit {kit.PREEMPTED_EXIT} on every rank"
                + (" (torchrun, signalled too, exits 1)" if launcher else "")
                + ": rerun to resume"
            )
            if hook:  # (records only, with --out)
                hook.exiting(step, kit.PREEMPTED_EXIT)
            sys.exit(kit.PREEMPTED_EXIT)

    def evaluate() -> None:  # one model on every rank (buffers averaged), each sample once
        nonlocal best, owed
        if checks.check(step, True, weights(ddp)).stop:  # inf/nan raises: never scored
            owed = True  # the rerun's first act
            save_snapshot()  # preempted: save (and exit) before a long evaluation
        mean = loss_sum.clone()
        dist.all_reduce(mean)  # every rank's batches: all_reduce, so every rank has the mean
        moved = kit.average_buffers(ddp)  # BatchNorm statistics differ per rank
        if hook:
            hook.evaluated(epoch, step, ddp.module, moved)
        result = kit.distributed_evaluate(
            ddp,
            val_set,
            2 * args.batch_size,
            device,
            amp=amp,
            num_workers=args.num_workers,
            pin_memory=cuda,
            collate_fn=COLLATE,
            **scoring,  # loss_fn, CLASS_DIM, PREDICTION: as before training
            stop=lambda: checks.received is not None,  # a SIGTERM meanwhile: stop, save, exit
        )
        if result.interrupted:  # partial sums: scored nowhere, logged nowhere
            owed = True
            save_snapshot()  # exits: the lines below see whole evaluations only
        owed = False
        train_loss = (mean[0] / mean[1].clamp(min=1)).item()
        scores = scores_of(result)
        if math.isnan(scores[args.best_by]) and args.best_by == "val_accuracy":
            raise kit.DataError(
                "--best-by val_accuracy: this evaluation has no accuracy (targets that are not "
                "class indices, or no validation samples): use --best-by val_loss"
            )
        history.append({"epoch": epoch, "step": step, "train_loss": train_loss, **scores})
        say(f"epoch {epoch}: step {step}, loss {train_loss:.4f}, {described(scores)}")
        log.scalars(step, "val", **{name[4:]: v for name, v in scores.items() if v == v})
        score = SCORES[args.best_by][0] * scores[args.best_by]  # higher is better
        if score > best and ckpt:  # the same on every rank: a collective save
            best = score
            kept = {name: value for name, value in scores.items() if value == value}  # no nan
            note = {"step": step, "best_by": args.best_by, "score": best, **kept}
            save(ddp.module.state_dict(), "best.pt", note)

    def pause(what: Any, *args: Any) -> None:  # evaluating and saving are not training
        log.pause()
        if hook:
            hook.pause()
        what(*args)
        log.resume()

    # an epoch trains whole accumulation windows of full batches: the LR's epochs are those
    per_epoch = math.ceil(len(train_set) / world_size) // args.batch_size // args.grad_accum
    planned, per_epoch = per_epoch * args.epochs, per_epoch * global_batch  # steps; samples
    stop_at = partial(operator.le, args.max_steps or math.inf)  # stop_at(step): --max-steps done
    finished = stop_at(step) or epoch >= args.epochs
    bar = tqdm(
        total=min(planned, args.max_steps or planned),
        initial=step,
        unit="step",
        disable=rank != 0 or args.no_progress or not sys.stderr.isatty(),
        mininterval=5,
    )
    try:  # a failure below would fail each restart again: failed.json stops them
        if owed:  # the snapshot was saved inside an evaluation that a signal stopped: do it now
            pause(evaluate)
        stop, steps_here = finished, 0
        while not stop:
            # 8. The loop. set_epoch: a new shuffle every epoch, the same on every rank.
            sampler.set_epoch(epoch, consumed, since)
            loader.generator.manual_seed(kit.rank_seed(args.seed, rank, epoch, 1))  # workers
            micro_batches = len(loader) // args.grad_accum * args.grad_accum
            model.train()
            done, batches = 0, iter(loader)
            for _ in range(micro_batches // args.grad_accum):
                # The step's micro-batches first: its loss is the mean over every rank's counted
                # targets (lesson 04, "Tokens, not samples"), so their number comes before it.
                group = [next(batches) for _ in range(args.grad_accum)]  # inputs on the host
                targets = [kit.to_device(y, device) for _, y in group]
                counts = torch.stack([kit.counted_targets(y, loss_fn) for y in targets])
                total = counts.sum()
                counting = dist.all_reduce(total, async_op=True)  # while the first forward runs
                for i, ((x, _), y) in enumerate(zip(group, targets, strict=True)):
                    x, last = kit.to_device(x, device), i == args.grad_accum - 1
                    with nullcontext() if last else ddp.no_sync():  # all_reduce on the last only
                        with autocast():
                            mean = loss_fn(model(x), y)  # a mean over this micro-batch's targets
                        mean = torch.where(counts[i] > 0, mean, 0.0)  # all padding: 0 / 0 is nan
                        counting.wait()  # total: every rank's counted targets (sequences: tokens)
                        loss = mean * counts[i] * world_size / total.clamp(min=1)  # DDP: / world
                        scaler.scale(loss).backward()  # DDP all_reduces buckets during backward
                    loss_sum += torch.stack([mean.detach().double() * counts[i], counts[i]])
                    done, consumed = done + 1, consumed + args.batch_size * world_size
                into = min(1.0, consumed / per_epoch)  # of this epoch, after this step: any world
                half = 0.5 * args.grad_accum * args.batch_size * world_size / per_epoch
                # the step's middle: the last step does not train at lr 0 (a schedule's end)
                lr = kit.lr_at((epoch + max(0.0, into - half)) / args.epochs, peak_lr, args.warmup)
                kit.set_lr(optimizer, lr, peak_lr)
                norm = None
                if args.clip_grad:  # after all_reduce, so every rank clips the same gradients
                    scaler.unscale_(optimizer)  # fp16: clip the true gradients, not scaled ones
                    norm = nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_grad)
                scaler.step(optimizer)  # fp16: skipped on every rank if any gradient is inf/nan
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step, samples_seen, steps_here = (
                    step + 1,
                    samples_seen + global_batch,
                    steps_here + 1,
                )
                checks.observe(step, loss)  # on the device: the first inf/nan step
                if hook:  # (records only, with --out)
                    hook.step(step, mean.detach())
                if steps_here == 1:  # compiled and warmed up: a missing rank now fails fast
                    kit.set_collective_timeout(args.timeout)
                log.step(step, loss_sum, lr, norm)  # every --log-every: an all_reduce, a sync
                bar.update()
                verdict = checks.check(step)  # every 10 steps, fewer if slow: a tiny all_reduce
                if verdict.stop:  # preempted: save first, within torchrun's grace period
                    owed = bool(args.eval_every and step % args.eval_every == 0 or stop_at(step))
                    pause(save_snapshot)  # an evaluation due here: owed, the rerun's first act
                if args.eval_every and step % args.eval_every == 0:
                    pause(evaluate)
                due = verdict.save or args.save_every and step % args.save_every == 0
                if due and done < micro_batches and not stop_at(step):  # else: saved below
                    pause(save_snapshot)
                if stop := stop_at(step):
                    break
            # 9. Metrics over every rank's batches (all_reduce: every rank has them), then
            #    one model: BatchNorm statistics differ per rank until they are averaged.
            if hook:
                hook.epoch_done(epoch, sampler, done * args.batch_size)
            if not history or history[-1]["step"] != step:  # not just evaluated (--eval-every)
                pause(evaluate)
            if done == micro_batches:  # the epoch is complete (also when --max-steps ends on it)
                epoch, consumed, since = epoch + 1, 0, 0
                log.epoch_end(loss_sum)  # a --log-every window may span the epochs' border
                loss_sum.zero_()
            stop = stop or epoch >= args.epochs
            pause(save_snapshot)
        # 10. The deliverable: the plain model (no "module." prefix), from global rank 0,
        #     atomically; inside the guard, as every save is: a failure stops the restarts
        current = finished and kit.from_rank0(rank == 0 and holds(ckpt, ddp.module.state_dict()))
        if ckpt and not current:  # a finished run's rerun keeps its final.pt, if it is this model
            save(ddp.module.state_dict(), "final.pt")
    except (kit.DivergedError, kit.CheckpointError, kit.DataError) as exc:  # a restart would too
        stopped_for_good(exc, ckpt, rank, step)
        raise
    finally:
        bar.close()
        log.close()  # TensorBoard's scalars reach the disk on every exit path
    last = history[-1] if history else {"train_loss": math.nan}
    kept = [n for n in ("final.pt", "best.pt") if ckpt and (ckpt / n).is_file()]  # best: if scored
    say(
        f"{'nothing left to train: ' if finished else ''}done: {step} steps, train loss "
        f"{last['train_loss']:.4f}, {described(last)}, "
        + (f"saved in {ckpt}/ ({', '.join([*kept, 'snapshots'])})" if ckpt else "nothing saved")
    )
    if hook:
        hook.finish(step, history, global_batch, {"peak_lr": peak_lr, "config": vars(args)})


def weights(model: nn.Module) -> list[torch.Tensor]:
    """What must stay finite: the parameters and the norm layers' statistics (one bad batch
    can make BatchNorm's running variance inf while the loss stays finite: helper 150); not
    every buffer, since some are rightly not finite (a causal mask of -inf)."""
    stats = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in kit.NORM_STATISTICS]
    return [*model.parameters(), *stats]


def holds(ckpt: Path | None, state: dict[str, torch.Tensor]) -> bool:
    """Whether ckpt/final.pt holds exactly these weights: not missing, damaged, or older (a
    rerun stopped between its last snapshot and final.pt leaves the old one: helper 150)."""
    try:
        held = kit.load_checkpoint(ckpt / "final.pt") if ckpt else None
    except kit.CheckpointError:
        return False
    return (
        isinstance(held, dict)
        and held.keys() == state.keys()
        and all(
            held[k].shape == v.shape and bool((held[k] == v.cpu()).all()) for k, v in state.items()
        )
    )


def ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


def scores_of(result: kit.EvalResult) -> dict[str, float]:
    """The evaluation's scores by the names of SCORES (history, logs, best.json)."""
    return {"val_loss": result.loss, "val_accuracy": result.accuracy}


def described(record: dict[str, Any]) -> str:
    """'val loss 0.1234, val accuracy 93.1%': the scores a record holds (nan: no such score)."""
    held = [(name, form, record[name]) for name, (_, form) in SCORES.items() if name in record]
    shown = [f"{name.replace('_', ' ')} {form.format(v)}" for name, form, v in held if v == v]
    return ", ".join(shown) or "not evaluated"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written aside, then renamed over ``path``: a crash leaves the old file or the new one."""
    kit.atomic_write_text(path, json.dumps(data))  # fsyncs: the file's, then the folder's


def stopped_for_good(exc: Exception, ckpt: Path | None, rank: int, step: int) -> None:
    """failed.json: why the run stopped, so that every restart stops at once. Rank 0 writes it,
    and a rank whose own data failed (a file only its shard holds: the others see a peer gone)."""
    if (rank == 0 or isinstance(exc, kit.DataError)) and ckpt is not None:
        with contextlib.suppress(OSError):
            write_json(ckpt / FAILED, {"stopped_at_step": step, "error": str(exc)})  # error: why


def instruments(args: argparse.Namespace, *who: Any) -> Any:
    """The one optional hook: with --out, the course's recorder (records for its lessons; it
    never steers training). Without --out: None, the path a copy outside the course runs."""
    if not args.out:
        return None
    recorder = importlib.import_module(HOOK)  # the course's package
    return recorder.Recorder.from_template(args, *who)


if __name__ == "__main__":
    main()
