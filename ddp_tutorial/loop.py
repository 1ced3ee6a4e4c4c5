"""The template's loop parts that are not DDP: its flags, the optimizer, the LR schedule, the log.

``scripts/train.py`` keeps every DDP step in view and takes these from here
(add your own flags to :func:`template_parser`):

* :func:`parse_template_args` — the flags, their defaults per optimizer, checked;
* :func:`build_optimizer` — AdamW (or SGD) with weight decay on weight matrices and
  convolution kernels only: biases and normalisation weights are not decayed (they
  set scales and offsets; shrinking them towards 0 only hurts). Adam-family by
  default, as seed 001 — with valid ``betas``;
* :func:`lr_at` / :func:`set_lr` — linear warm-up, cosine decay, applied as a
  multiple of each parameter group's own base LR (a group with 10x the LR keeps it);
* :class:`TrainLog` — the line practitioners expect every ``--log-every`` steps
  (step, loss, LR, gradient norm, samples/s, GPU memory), flushed (SLURM buffers
  stdout), and optional TensorBoard scalars from rank 0 only.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch import nn

from ddp_tutorial import settings
from ddp_tutorial.comm_hooks import COMM_HOOKS
from ddp_tutorial.models import MODEL_NAMES
from ddp_tutorial.real_data import DATA_KINDS
from ddp_tutorial.recorder import Recorder

REFERENCE_BATCH = 256  # --lr is the learning rate of a global batch of this size
OPTIMIZERS = {"adamw": (3e-3, 0.05), "sgd": (0.2, 5e-4)}  # default --lr, --weight-decay


def positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def template_parser() -> argparse.ArgumentParser:
    """The template's flags; the lessons' own come from :meth:`Recorder.add_arguments`."""
    p = argparse.ArgumentParser(description="DDP training template (run it with torchrun).")
    add = p.add_argument
    add("--model", choices=MODEL_NAMES, default="cnn")
    add("--data", choices=DATA_KINDS, help="default: folder with --data-dir, else synthetic")
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
    add("--lr", type=float, help=f"peak LR for a global batch of {REFERENCE_BATCH}, scaled "
        "linearly (default: 3e-3 adamw, 0.2 sgd)")  # fmt: skip
    add("--weight-decay", type=float, help="not on biases and norm weights (default: 0.05 "
        "adamw, 5e-4 sgd)")  # fmt: skip
    add("--warmup", type=float, default=0.05, help="fraction of training warming up, then cosine")
    add("--clip-grad", type=float, default=1.0, help="max gradient norm, logged (0: off): one "
        "bad batch or an early LR spike cannot throw the weights far")  # fmt: skip
    add("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    add("--seed", type=int, default=0)
    add("--checkpoint-dir", help="snapshot-<step>.pt, best.pt, final.pt; a rerun resumes from it")
    add("--save-every", type=int, default=0, help="steps between snapshots (0: epoch ends)")
    add("--save-minutes", type=float, default=30, help="and a snapshot this often (0: off)")
    add("--eval-every", type=int, default=0, help="steps between evaluations (0: epoch ends)")
    add("--max-steps", type=positive, help="stop early (the LR schedule still spans --epochs)")
    add("--log-every", type=positive, default=50, help="steps between log lines (a host sync)")
    add("--tensorboard", help="rank 0 writes TensorBoard scalars to this folder")
    add("--amp", nargs="?", const="bf16", choices=["bf16", "fp16"], help="autocast: bf16 (a bare"
        " --amp), or fp16 with a GradScaler (GPUs without bf16: V100, T4)")  # fmt: skip
    add("--compile", nargs="?", const="inductor", help="torch.compile the DDP model (backend)")
    add("--comm-hook", choices=COMM_HOOKS, default="none", help="compress gradients on the wire "
        "(powersgd: a resume restarts its error feedback and its plain warm-up steps)")  # fmt: skip
    add("--sync-bn", action="store_true", help="SyncBatchNorm (GPUs with nccl only)")
    add("--pretrain", help="initial weights: a state_dict file (any device, any prefix)")
    add("--backend", help="auto (default), gloo or nccl")
    add("--deterministic", action="store_true", help="bitwise-reproducible kernels (slower; "
        "else cudnn.benchmark)")  # fmt: skip
    add("--timeout", type=float, default=settings.timeout_s(default=600), help="seconds a "
        "collective may wait once training runs, a long rank-0 save included")  # fmt: skip
    add("--no-progress", action="store_true", help="no progress bar")
    Recorder.add_arguments(p)  # --out, --record-steps, --record-indices, fault injection
    return p


def parse_template_args(argv: list[str] | None = None) -> argparse.Namespace:
    """:func:`template_parser`'s flags, with the optimizer's defaults filled in, checked."""
    p = template_parser()
    args = p.parse_args(argv)
    lr, decay = OPTIMIZERS[args.optimizer]
    args.lr = lr if args.lr is None else args.lr
    args.weight_decay = decay if args.weight_decay is None else args.weight_decay
    counts = (args.num_workers, args.save_every, args.eval_every, args.save_minutes)
    if min(*counts, args.lr, args.weight_decay, args.clip_grad) < 0 or args.timeout <= 0:
        p.error("--num-workers, --save-every, --eval-every, --save-minutes, --lr, --weight-decay "
                "and --clip-grad must be >= 0, --timeout > 0")  # fmt: skip
    if not 0 <= args.warmup < 1:
        p.error("--warmup is a fraction of training: 0 <= warmup < 1")
    return args


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.999) or SGD (momentum 0.9); no decay on biases and norm weights.

    ``fused`` (CPU and GPUs, torch 2.4+): one kernel for the whole update, and
    ``GradScaler.step`` hands it the inf/nan flag to skip a step on the device;
    an unfused optimizer makes the scaler read that flag on the host first — with
    ``--amp fp16`` on a GPU, a sync that stalls the queue every step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},  # biases, norms
    ]
    fused_or_default = True if fused else None
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=fused_or_default)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, fused=fused_or_default)
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to 0."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def set_lr(optimizer: torch.optim.Optimizer, lr: float, peak: float) -> None:
    """The schedule's ``lr`` times each group's own multiple of ``peak``.

    The multiple (``lr_scale``) is fixed at the first call from the group's LR
    at construction, and saved with the optimizer's state: a resume on another
    world size (another ``peak``) keeps every group's ratio.
    """
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("lr_scale", group["lr"] / peak if peak else 1.0) * lr


class TrainLog:
    """Rank 0's log line every ``every`` steps, and TensorBoard scalars (``directory``)."""

    def __init__(
        self, rank: int, every: int, global_batch: int, accum: int = 1, directory: str | None = None
    ):
        """``accum``: micro-batches per step (the loss passed to :meth:`step` is divided by it)."""
        self.main, self.every, self.global_batch, self.accum = rank == 0, every, global_batch, accum
        self.last = time.perf_counter()
        self.writer: Any = None
        if directory and self.main:
            from torch.utils.tensorboard import SummaryWriter  # needs: pip install tensorboard

            self.writer = SummaryWriter(directory)

    def step(self, step: int, loss: torch.Tensor, lr: float, norm: torch.Tensor) -> None:
        """After optimizer step ``step``; reads ``loss`` and ``norm`` (a host sync) when due."""
        if step % self.every or not self.main:
            return
        now, value = time.perf_counter(), loss.item() * self.accum
        rate, self.last = self.every * self.global_batch / (now - self.last), now
        memory = ""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            memory = f", {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB max allocated"
        print(f"step {step}: loss {value:.4f}, lr {lr:.4g}, grad norm {norm.item():.3g}, "
              f"{rate:.0f} samples/s{memory}", flush=True)  # fmt: skip
        self.scalars(step, loss=value, lr=lr, grad_norm=norm.item(), samples_per_sec=rate)

    def scalars(self, step: int, prefix: str = "train", **values: float) -> None:
        """TensorBoard scalars (rank 0, with ``--tensorboard``); nothing otherwise."""
        for key, value in values.items():
            if self.writer is not None:
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
