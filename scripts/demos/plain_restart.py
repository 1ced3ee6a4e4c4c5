"""Your own loop under ``torchrun --max-restarts``, with the official example's bookkeeping.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        scripts/demos/plain_restart.py --out DIR

Torch only, like ``scripts/minimal_ddp.py``: the identity from torchrun's environment,
a plain ``init_process_group``, ``DDP``. Its snapshot bookkeeping is the one of
pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` (read at
f62b4ae): after running epoch ``e``, local rank 0 saves ``{"MODEL_STATE", "EPOCHS_RUN": e}``
with ``torch.save`` in place, and a (re)start resumes at ``range(EPOCHS_RUN, epochs)``.
On the first attempt rank ``--crash-rank`` SIGKILLs itself after the first step of
epoch ``--crash-in-epoch`` (after epoch ``crash - 1`` was saved).

Without ``--max-restarts`` (torchrun's default is 0) the job ends with the dead rank.
Lesson 08 runs it twice:

* with ``--max-restarts 1``: on torch >= 2.5 the restart's ``init_process_group`` meets
  the previous attempt's addresses in the store torchrun's agent hosts for its workers
  (which outlives a restart) and usually fails connecting to a dead process
  (pytorch/pytorch#135712);
* with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment: every
  restart gets a new store, the restart joins, and the epoch the example saved runs twice.

Each rank writes ``attempt{A}-rank{R}.json`` to ``--out`` before ``init_process_group``
(who it is, which store it meets) and again after each epoch (the epochs it ran).
The second outcome is a race, not a certainty: now and then the restarted ranks
rewrite their keys before either reads an old one, and the restart joins (lesson 08
reports which outcome its run saw).
"""

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: destroy_process_group can free the group
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps-per-epoch", type=int, default=4)
    p.add_argument("--crash-in-epoch", type=int, default=3)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="init_process_group's, seconds")
    p.add_argument("--restart-timeout", type=float, help="the same after a restart (demo only)")
    p.add_argument("--out", required=True, help="records and snapshot.pt go here")
    args = p.parse_args()

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # this node's restarts so far
    out = Path(args.out)
    record = {"attempt": attempt, "rank": rank, "pid": os.getpid(), "epochs": [],
              "master_port": int(os.environ["MASTER_PORT"]),
              "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}  # fmt: skip

    def write_record() -> None:
        path = out / f"attempt{attempt}-rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)

    write_record()
    timeout = args.restart_timeout if attempt > 0 and args.restart_timeout else args.timeout
    # The learner's line: a plain init. torchrun's environment says where the store is.
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))

    torch.manual_seed(0)
    model = DDP(nn.Linear(20, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    snapshot_path = out / "snapshot.pt"
    epochs_run = 0
    if snapshot_path.exists():  # the example's _load_snapshot, onto this rank's device
        snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        model.module.load_state_dict(snapshot["MODEL_STATE"])
        epochs_run = snapshot["EPOCHS_RUN"]
        record["resumed_at_epoch"] = epochs_run
    data = torch.Generator().manual_seed(rank)
    for epoch in range(epochs_run, args.epochs):  # the example's train()
        for step in range(args.steps_per_epoch):
            x, y = torch.randn(8, 20, generator=data), torch.randint(0, 4, (8,), generator=data)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # DDP: an all_reduce
            optimizer.step()
            crash = (attempt, rank, epoch, step) == (0, args.crash_rank, args.crash_in_epoch, 0)
            if crash:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no goodbye
        record["epochs"].append(epoch)
        write_record()
        if local_rank == 0:  # the example's guard and its _save_snapshot: the epoch just run
            torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch},
                       snapshot_path)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
