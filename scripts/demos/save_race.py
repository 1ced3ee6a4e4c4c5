"""Several ranks save the same checkpoint path at once: count what a load gets back.

Run it from the shell (one node, every rank writes):

    torchrun --standalone --nproc-per-node 2 scripts/demos/save_race.py --dir /tmp/race

or as two "nodes" on one machine (two torchrun agents, one rank each, sharing
the disk, so seed 000's ``local_rank == 0`` guard leaves two writers):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port 29555 scripts/demos/save_race.py --dir /tmp/race &
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port 29555 scripts/demos/save_race.py --dir /tmp/race

For each ``--modes`` entry it runs ``--rounds`` rounds. In each round the
writers of that mode save a training-like state to the same file
(``every-rank``: all ranks, ``local-rank-0``: seed 000's guard,
``rank-0-atomic``: :func:`ddp_tutorial.checkpoint.save_checkpoint`), all
ranks wait, and then every rank loads the file and checks it is exactly one
writer's state. The weights are the same on every rank (as after a DDP step),
but a full checkpoint also holds per-rank values (RNG states, the writer's
rank), so interleaved writes can produce a file that loads without error and
is still wrong.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_tutorial.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record

MODES = ("every-rank", "local-rank-0", "rank-0-atomic")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="shared directory for the checkpoint")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--rounds", type=int, default=20, help="save/load rounds per mode")
    parser.add_argument("--numel", type=int, default=1_000_000, help="floats in the weights")
    parser.add_argument("--backend", default="gloo", help="gloo (default), nccl or auto")
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    args = parser.parse_args()
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        parser.error(f"unknown mode(s) {sorted(bad)}; choose from {MODES}")
    return args


def make_state(writer: int, round_: int, numel: int) -> dict:
    """What ``writer`` saves in ``round_``: deterministic, so any rank can rebuild it."""
    weights = torch.Generator().manual_seed(round_)  # same on every rank, like DDP weights
    per_rank = torch.Generator().manual_seed(1000 * writer + round_)  # differs per rank
    return {
        "model": {"weight": torch.randn(numel, generator=weights)},
        "rng": torch.randint(0, 256, (numel // 4,), generator=per_rank, dtype=torch.uint8),
        "noise": torch.randn(numel // 8 + 1000 * writer, generator=per_rank),  # sizes differ too
        "writer": writer,
        "round": round_,
    }


def same_state(a: dict, b: dict) -> bool:
    return (
        a.keys() == b.keys()
        and a["writer"] == b["writer"]
        and a["round"] == b["round"]
        and torch.equal(a["model"]["weight"], b["model"]["weight"])
        and torch.equal(a["rng"], b["rng"])
        and torch.equal(a["noise"], b["noise"])
    )


def check_load(path: Path, round_: int, numel: int) -> tuple[str, str, int | None]:
    """``("ok" | "wrong" | "error", detail, writer)`` for one load of the shared file (writer:
    the rank whose whole, consistent state it holds; None unless "ok")."""
    try:
        loaded = load_checkpoint(path)
    except CheckpointError as exc:
        return "error", str(exc), None
    writer = loaded.get("writer") if isinstance(loaded, dict) else None
    if not isinstance(writer, int):
        return "wrong", f"loaded a {type(loaded).__name__} without a writer id", None
    try:
        ok = same_state(loaded, make_state(writer, round_, numel))
    except (KeyError, RuntimeError) as exc:
        return "wrong", f"malformed content: {exc}", None
    if not ok:
        return "wrong", f"says writer {writer} round {round_}, but its tensors are a mix", None
    return "ok", "", writer


@record
def main() -> None:
    args = parse_args()
    path = Path(args.dir) / "checkpoint.pt"
    with process_group(backend=args.backend) as info:
        path.parent.mkdir(parents=True, exist_ok=True)
        results = {}
        for mode in args.modes.split(","):
            writes = (
                True
                if mode == "every-rank"
                else info.local_rank == 0
                if mode == "local-rank-0"
                else info.rank == 0
            )
            flags = torch.tensor([int(writes)], device=info.device)  # nccl: on the rank's GPU
            dist.all_reduce(flags)  # how many processes write in this mode
            counts: Counter[str] = Counter()
            examples: dict[str, str] = {}
            from_writers: set[int] = set()  # whose state the good loads held
            for r in range(args.rounds):
                state = make_state(info.rank, r, args.numel)
                dist.barrier()  # start together, as ranks do at the end of an epoch
                if mode == "rank-0-atomic":
                    # Rank 0 writes; every rank returns once the file is in place: no barrier.
                    save_checkpoint(path, state)
                else:
                    if writes:
                        torch.save(state, path)  # the seeds' way
                    dist.barrier()  # every writer has finished: the naive modes' best chance
                outcome, detail, writer = check_load(path, r, args.numel)
                counts[outcome] += 1
                from_writers |= {writer} if writer is not None else set()
                if detail and outcome not in examples:
                    examples[outcome] = detail
                dist.barrier()  # nobody rewrites while someone still reads
            results[mode] = {
                "writers": int(flags.item()),
                "loads": args.rounds,
                **{k: counts.get(k, 0) for k in ("ok", "wrong", "error")},
                "examples": examples,
                "from_writers": sorted(from_writers),
            }
            print(
                f"rank {info.rank} (local {info.local_rank}) {mode}: {int(flags.item())} "
                f"writer(s), {dict(counts)}",
                flush=True,
            )
        write_rank_record(
            args.out,
            {
                "local_rank": info.local_rank,
                "world_size": info.world_size,
                "pid": os.getpid(),
                "file_bytes": path.stat().st_size,
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
