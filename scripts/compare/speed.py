"""Is the template as fast as what users would write instead? Interleaved launches, ratios.

    python scripts/compare/speed.py --rounds 5 --out runs/speed.json
    FABRIC_PKGS=/tmp/fabric-pkgs python scripts/compare/speed.py ...   # with Lightning Fabric

For each workload — the course's CNN (32 px, batch 32 per rank) and seed 001's
(resnet18, 64 px, batch 32 per rank) — every round launches, in a rotating order,

* the template ``scripts/train.py`` with ``--out`` (what the lessons run), without
  checkpoints, with the loops' optimizer (``--optimizer sgd``: SGD, momentum 0.9) and
  everything else at its defaults — gradient clipping, the stop checks, the log line;
* ``scripts/compare/loops.py --framework bare``: the shortest correct DDP loop;
* ``scripts/compare/loops.py --framework fabric`` when ``FABRIC_PKGS`` names a folder
  holding Lightning (never a dependency of the project: see loops.py).

All three time the same way (warm-up steps excluded, the slowest rank's seconds).
This VM's speed moves by tens of percent between minutes, so no absolute number
is compared: each round gives the ratio template / other from launches seconds
apart, and the report is the median ratio over rounds with its range, the ratio of
each kind's best launch (noise only slows a launch down), and the load average before
each round (a shared machine: compare only quiet rounds). What the template adds per
step, piece by piece and far below what launches can resolve here: ``step_costs.py``.
``--monitor`` samples utilization during every launch (not only the template's:
the sampler takes CPU from the ranks on a small machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.records import format_table, write_json

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE.parent

# Each long enough to time several seconds: the CNN's 16384 images are 256 steps (about 6 s
# here); with 4096 (64 steps, 1.3 s timed) the template's median ratio to Fabric moved between
# 0.88 and 1.03 over four runs of 5-9 rounds: this VM's swings outlast so short a launch.
WORKLOADS = {
    "cnn": {"model": "cnn", "image_size": 32, "batch_size": 32, "num_samples": 16384},
    "resnet18": {"model": "resnet18", "image_size": 64, "batch_size": 32, "num_samples": 1536},
}


def _flags(work: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in work.items()]


def launch(kind: str, work: dict[str, Any], nproc: int, run_dir: Path, monitor: bool) -> float:
    """One launch of ``kind``; its samples/s as it measured them."""
    env = {}
    if kind == "template":
        script = SCRIPTS / "train.py"
        extra = ["--epochs=1", "--num-val=64", "--no-progress", "--optimizer=sgd"]
    else:
        script, extra = HERE / "loops.py", [f"--framework={kind}"]
        if kind == "fabric":
            env["PYTHONPATH"] = os.environ["FABRIC_PKGS"]
    torchrun(script, *_flags(work), *extra, nproc=nproc, run_dir=run_dir, monitor=monitor,
             echo=False, timeout=1800, env=env)  # fmt: skip
    return json.loads((run_dir / "metrics.json").read_text())["samples_per_sec"]


def summarize(rates: dict[str, list[float]]) -> dict[str, Any]:
    """The template's ratio to every other kind: per round (median, range), and best to best.

    ``rates``: samples/s per kind, one entry per round, ``"template"`` among them.
    The per-round ratio pairs launches seconds apart; the best-to-best ratio takes
    each kind at its least disturbed (noise only ever slows a launch down).
    """
    ratios = {
        other: [t / o for t, o in zip(rates["template"], rates[other], strict=True)]
        for other in rates
        if other != "template"
    }
    return {
        "samples_per_sec": rates,
        "ratios": ratios,
        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "range": {k: [min(v), max(v)] for k, v in ratios.items()},
        "best_ratio": {k: max(rates["template"]) / max(rates[k]) for k in ratios},
    }


def compare(rounds: int, nproc: int, kinds: list[str], tmp: Path, monitor: bool) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, work in WORKLOADS.items():
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        loads = []
        for r in range(rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # rotate who goes first
            loads.append(os.getloadavg()[0])
            for kind in order:
                rate = launch(kind, work, nproc, tmp / f"{name}-{kind}-{r}", monitor)
                rates[kind].append(rate)
                print(f"{name} round {r} (load {loads[-1]:.1f}): {kind} {rate:.0f} samples/s",
                      flush=True)  # fmt: skip
        results[name] = {"workload": work, "load_before_rounds": loads, **summarize(rates)}
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per workload")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--workloads", default="cnn,resnet18", help=f"of {sorted(WORKLOADS)}")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    p.add_argument("--monitor", action="store_true", help="sample utilization in every launch")
    args = p.parse_args(argv)
    for name in set(WORKLOADS) - set(args.workloads.split(",")):
        del WORKLOADS[name]
    kinds = ["template", "bare"] + (["fabric"] if os.environ.get("FABRIC_PKGS") else [])
    with tempfile.TemporaryDirectory() as tmp:
        results = compare(args.rounds, args.nproc, kinds, Path(tmp), args.monitor)
    rows = [
        {"workload": name, "template vs": other, "median ratio": r["median_ratio"][other],
         "min": r["range"][other][0], "max": r["range"][other][1],
         "best / best": r["best_ratio"][other], "rounds": args.rounds}
        for name, r in results.items()
        for other in r["ratios"]
    ]  # fmt: skip
    print(format_table(rows))
    print("ratio > 1: the template is faster (samples/s of the template / of the other)")
    if args.out:
        write_json(args.out, {"rounds": args.rounds, "nproc": args.nproc, "results": results})


if __name__ == "__main__":
    main()
