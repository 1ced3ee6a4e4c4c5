"""The DDP training template: copy it, change the model and the data.

    torchrun --standalone --nproc-per-node 2 scripts/train.py            # CPU: 2 ranks, gloo
    torchrun --standalone --nproc-per-node 8 scripts/train.py --model resnet18 --amp \\
        --image-size 64 --num-samples 100000 --batch-size 256 --num-workers 4   # 8 GPUs, nccl

Every rank runs this file. torchrun sets RANK / LOCAL_RANK / WORLD_SIZE;
``ddp_tutorial.distributed.setup`` picks nccl when each rank has a GPU (and
binds it to cuda:LOCAL_RANK first), gloo on CPU otherwise. Restart it with the
same ``--checkpoint-dir`` and it resumes from the last snapshot; add
``torchrun --max-restarts 2`` and a crashed rank is survived automatically.
Outputs: ``--checkpoint-dir`` gets ``snapshot-<step>.pt`` (full state) and
``final.pt`` (the plain model ``state_dict``); ``--out`` gets ``metrics.json``
and one ``rank{r}.json`` per rank.
"""

from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial import settings
from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.distributed import print0, process_group
from ddp_tutorial.models import MODEL_NAMES
from ddp_tutorial.numerics import make_deterministic
from ddp_tutorial.training import TrainConfig, Trainer


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(description="DDP training template (run it under torchrun).")
    p.add_argument("--model", choices=MODEL_NAMES, default=d.model)
    p.add_argument("--image-size", type=int, default=d.image_size, help="height = width, pixels")
    p.add_argument("--num-classes", type=int, default=d.num_classes)
    p.add_argument("--num-samples", type=int, default=d.num_samples, help="training samples")
    p.add_argument("--num-val", type=int, default=d.num_val, help="validation samples")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="PER RANK, not global")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--num-workers", type=int, default=d.num_workers, help="DataLoader workers per rank"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-dir", default=None, help="snapshots + final.pt; resumes from it")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between snapshots")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--out", default=None, help="run directory for metrics.json and rank records")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (GPUs/nccl only)")
    p.add_argument("--pretrain", default=None, help="initial weights: a state_dict file")
    p.add_argument("--fail-at-step", type=int, default=None, help="fault injection (lesson 08)")
    p.add_argument("--fail-rank", type=int, default=d.fail_rank, help="rank that fails")
    p.add_argument("--backend", default=None, help="auto (default), gloo or nccl")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="bitwise-reproducible kernels (cuDNN/cuBLAS; slower on GPUs): for exact resumes",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=settings.timeout_s(default=d.timeout),
        help="seconds a collective may wait before the job fails (a long save on rank 0 "
        "included; default $DDP_TUTORIAL_TIMEOUT, else 600); joining the group may take "
        "$DDP_TUTORIAL_INIT_TIMEOUT (600 s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "num_samples", "num_val", "image_size", "num_classes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_workers < 0 or args.save_every < 0:
        p.error("--num-workers and --save-every must be >= 0")
    if args.timeout <= 0:
        p.error("--timeout must be a positive number of seconds")
    no_progress = args.no_progress
    del args.no_progress
    return TrainConfig(**vars(args), progress=not no_progress)


@record  # a crash's traceback reaches torchrun's summary (and the launcher's error)
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.deterministic:
        make_deterministic()  # before any CUDA work: cuBLAS reads its setting once
    with process_group(backend=cfg.backend, timeout_s=cfg.timeout) as info:  # destroyed on exit
        print0(f"{info.world_size} ranks, backend {info.backend} ({info.reason})")
        if cfg.sync_bn and info.backend != "nccl":
            sys.exit(
                f"train.py: error: --sync-bn needs GPUs with nccl; this run uses "
                f"{info.backend} on {info.device}. SyncBatchNorm has no CPU implementation."
            )
        # Same data on every rank: sample i is a pure function of (seed, i).
        train_set = SyntheticImages(cfg.num_samples, cfg.image_size, cfg.num_classes, seed=cfg.seed)
        val_set = SyntheticImages(cfg.num_val, cfg.image_size, cfg.num_classes, seed=cfg.seed + 1)
        metrics = Trainer(cfg, info, train_set, val_set).run()
        print0(
            f"done: {metrics['steps']} steps, train loss {metrics['train_loss']:.4f}, "
            f"val accuracy {metrics['val_accuracy']:.1%}, "
            f"{metrics['samples_per_sec']:.0f} samples/s"
        )


if __name__ == "__main__":
    main()
