"""Seed 000's way to learn the local rank — a ``--local_rank`` argument — and the fix.

``--style seed`` (default) is the seed's argparse line, verbatim:

    parser.add_argument("--local_rank", type=int, default=1)

* under ``python -m torch.distributed.launch`` (deprecated) it fails: since
  torch 2.0 the launcher passes ``--local-rank=N`` (dash), which argparse
  does not recognise (``unrecognized arguments: --local-rank=0``);
* under ``torchrun`` nothing is passed at all, so ``default=1`` wins and
  *every* rank believes it is local rank 1 — both would pick ``cuda:1``.

``--style fixed`` reads ``LOCAL_RANK`` from the environment, which both
launchers set; it also accepts either spelling of the old flag so the
deprecated launcher still works while you migrate. With torchrun, the
environment is all you need (``ddp_tutorial.distributed.setup`` reads it).

This script only reports; it does not join a process group, and it does
not import torch (plain ``json`` for the record), so it starts in a blink.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse_args() -> argparse.Namespace:
    # --style decides which parser to build, so read it first on its own.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--style", choices=("seed", "fixed"), default="seed")
    style = pre.parse_known_args()[0].style

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[pre])
    parser.add_argument("--out", default=None, help="run directory for per-rank JSON records")
    if style == "seed":
        # seed 000, verbatim (help text shortened): the old spelling and a wrong default.
        parser.add_argument("--local_rank", type=int, default=1)
    else:
        # The fix: the environment is the source of truth; the flag (either spelling) is
        # accepted only so the deprecated launcher keeps working during a migration.
        parser.add_argument(
            "--local-rank",
            "--local_rank",
            dest="local_rank",
            type=int,
            default=int(os.environ.get("LOCAL_RANK", "0")),
        )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    env_local_rank = os.environ.get("LOCAL_RANK")
    line = (
        f"RANK={os.environ.get('RANK')} style={args.style}: args.local_rank={args.local_rank}, "
        f"env LOCAL_RANK={env_local_rank}, argv={sys.argv[1:]}\n"
    )
    # One write per line: two ranks share this pipe, and separate writes of the
    # text and its newline can interleave with the other rank's.
    sys.stdout.write(line)
    sys.stdout.flush()
    if args.out:
        rank = os.environ.get("RANK", "0")
        record = {
            "rank": int(rank),
            "style": args.style,
            "args_local_rank": args.local_rank,
            "env_local_rank": None if env_local_rank is None else int(env_local_rank),
            "argv": sys.argv[1:],
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
