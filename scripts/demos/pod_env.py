"""What one process in a Kubernetes pod sees: its identity variables, written to ``--out``.

Lesson 10 starts it as a Kubeflow operator's pods would, with only the
operator's variables in the environment:

    torchrun scripts/demos/pod_env.py --out DIR        # every flag from the PET_* variables
    python scripts/demos/pod_env.py --out DIR --join    # no launcher: the pod's RANK is taken
                                                        # as this process's rank (the mistake)

Each process writes ``DIR/pid{pid}.json`` (a pid, not a rank: in the mistake two
processes claim the same rank). It imports nothing but the standard library unless
``--join`` asks it to join the process group, so a pod costs little more than
its launcher.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

# torchrun's identity contract, and the variables the operators set in the pod
SEEN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PET_NNODES", "PET_NPROC_PER_NODE",
        "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for pid{pid}.json")
    parser.add_argument("--join", action="store_true", help="init_process_group from the env")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds --join may wait")
    args = parser.parse_args()
    seen = {name: os.environ.get(name) for name in SEEN} | {"pid": os.getpid()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid{os.getpid()}.json").write_text(json.dumps(seen))  # before anything can hang
    print(f"pid {os.getpid()}: RANK={seen['RANK']} WORLD_SIZE={seen['WORLD_SIZE']}", flush=True)
    if args.join:
        import torch.distributed as dist

        # env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, exactly as a script would
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        print(f"pid {os.getpid()}: joined a group of {dist.get_world_size()}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
