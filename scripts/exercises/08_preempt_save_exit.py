"""Lesson 08, your turn: on SIGTERM, every rank stops at the same step, rank 0 saves, exit 75.

A cluster that preempts a job sends SIGTERM, waits a grace period (30 s), then SIGKILL. Make
this loop use that grace, in the lesson's three pieces: a handler that only sets a flag (it may
run in the middle of anything, a collective included: no saving in it); at each step boundary
(or every few steps, well inside the grace) one all_reduce of the flag (MAX), so that a signal
that reached ANY rank stops EVERY rank at the same step - a rank that stopped alone would leave
the others waiting in the next all_reduce;
then rank 0 saves a snapshot of that step (``save_snapshot``, atomic), every rank waits for it,
and the loop ends with status 75 (EX_TEMPFAIL, "try again": the requeued job resumes there).

Here the SIGTERM comes from the script itself: after step ``--preempt-at-step`` the process of
rank ``--preempt-rank`` sends it to itself (only when a handler is installed: without one it
would end that process at once, as on a cluster). Check it (2 gloo ranks):

    ddp-tutorial check 08

or run it yourself:
torchrun --standalone --nproc-per-node 2 scripts/exercises/08_preempt_save_exit.py
"""

import argparse
import inspect
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: the group can be freed at exit (lesson 09)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PREEMPTED = 75  # EX_TEMPFAIL, "temporary failure, try again": what a preempted rank exits with
SAVES: list[dict[str, Any]] = []  # every snapshot this process wrote (for the check's report)


def make_data(n: int, seed: int) -> TensorDataset:
    """n points in 20 dimensions, 4 classes from a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return TensorDataset(x, (x @ torch.randn(20, 4, generator=g)).argmax(dim=1))


def in_sigterm_handler() -> bool:
    """Whether the caller runs inside the SIGTERM handler (the check's report says so)."""
    code = getattr(signal.getsignal(signal.SIGTERM), "__code__", None)
    return any(frame.f_code is code for frame, *_ in inspect.stack(0)[1:])


def save_snapshot(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically (lesson 05). Call it on global rank 0 only."""
    SAVES.append({"step": state.get("step"), "in_handler": in_sigterm_handler()})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes on the disk before the rename (lesson 05, section 2)
    os.replace(tmp, path)


def main() -> int:
    """Train until the end, or until a SIGTERM; the process's exit status (0 or PREEMPTED)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-samples", type=int, default=640)  # 40 steps an epoch on 2 ranks
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--preempt-at-step",
        type=int,
        default=5,
        help="the cluster's SIGTERM, simulated: sent after this step (0: never)",
    )
    p.add_argument("--preempt-rank", type=int, default=1, help="... to this rank's process")
    p.add_argument("--out", default="ex08", help="folder for the snapshot and the check's reports")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    stop = {"signal": 0}  # set by the handler; read by the loop, at a step boundary
    # YOUR CODE: install a handler for SIGTERM that only sets stop["signal"] (a handler runs
    # between any two bytecodes - mid-save, between two collectives: nothing else belongs in it)
    # END YOUR CODE
    handled = callable(signal.getsignal(signal.SIGTERM))

    train_set = make_data(args.num_samples, args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step, status, total = 0, 0, args.epochs * len(loader)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.preempt_at_step and rank == args.preempt_rank and handled:
                os.kill(os.getpid(), signal.SIGTERM)  # the cluster's SIGTERM, to one process
            # YOUR CODE: at this step boundary every rank learns whether ANY rank was signalled
            # (one all_reduce of the flag, MAX). If so: rank 0 saves a snapshot of this step
            # with save_snapshot(out / "snapshot.pt", {"model": ..., "optimizer": ...,
            # "step": step}), every rank waits for it, and the loop ends with status PREEMPTED
            # END YOUR CODE
        if status:
            break

    report = {"rank": rank, "handler": handled, "stopped_at": step, "total": total,
              "status": status, "saves": SAVES, "flag": stop["signal"]}  # fmt: skip
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))  # read by the check
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    before = signal.getsignal(signal.SIGTERM)
    try:
        status = main()  # on a cluster, end with sys.exit(status): 75 after a preemption's save.
        # (The check runs this file inside its own process and reads the status from the report.)
    finally:
        signal.signal(signal.SIGTERM, before)  # the check runs several files in one process
