"""Settings a run cannot train with, found before any rank starts: the template's preflight.

Tried as a new user would, an impossible setting used to surface late or never:
``--num-samples 10 --batch-size 32`` on 2 ranks trained 0 steps and printed
"done … nan samples/s" with exit status 0; a ``--checkpoint-dir`` that is a
file failed at the first snapshot, an epoch of GPU time later.
:func:`check_run` looks at the flags, the world size and the dataset size
before ``init_process_group`` and returns one sentence naming the flag and the
fix; ``scripts/train.py`` prints it once per node and exits with status 2 on
every rank. (Bad data — a missing folder, a corrupt image — is
:mod:`ddp_tutorial.real_data`'s to find.)
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any


def check_run(args: Any, world_size: int, train_size: int) -> str | None:
    """What makes this run impossible, in one sentence naming the flag; None if it can run.

    ``args``: the template's flags. ``world_size`` comes from torchrun's
    environment, so every rank can check before joining the process group.
    """
    per_rank = math.ceil(train_size / world_size)  # the sampler pads shards to equal size
    steps = per_rank // (args.batch_size * args.grad_accum) * args.epochs
    if steps == 0:
        return (f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than the "
                f"{per_rank} samples each of {world_size} ranks gets: no step could run. Lower "
                f"--batch-size or use more data than {train_size} samples")  # fmt: skip
    if args.save_every > min(steps, args.max_steps or steps):
        return f"--save-every {args.save_every} is beyond the run's {steps} steps: lower it, or 0"
    for name, path in (("--checkpoint-dir", args.checkpoint_dir), ("--out", args.out)):
        try:
            if path:  # made now, so a file in the way fails before training, not at the save
                Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            what = "is a file" if Path(path).is_file() else exc.strerror
            return f"{name} {path}: {what}; give a directory this user can write to"
        if path and not os.access(path, os.W_OK):
            return f"{name} {path}: not writable by this user; give another directory"
    if args.pretrain and not Path(args.pretrain).is_file():
        return f"--pretrain {args.pretrain}: no such file"
    if args.download and world_size > 1:  # every rank would download into the same files
        return (f"--download with {world_size} ranks: each would download into the same files "
                f"at once. Download once, with one process: torchrun --nproc-per-node 1 "
                f"scripts/train.py --data {args.data} --data-dir {args.data_dir} --download "
                f"--max-steps 1; then start this job without --download")  # fmt: skip
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return "--tensorboard needs the tensorboard package: pip install tensorboard"
    return None
