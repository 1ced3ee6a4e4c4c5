"""make rehearse: the lessons at GPU world sizes (3 and 8 ranks), on the CPU with gloo.

A GPU box runs the lessons with one rank per GPU: 8 where CI runs 2. Most
of what breaks there depends on the world size, not on CUDA (a shard that no
longer divides, a record count that assumed two ranks, a picture sized for
two), and a CPU can rehearse that: each lesson gpu-check runs, plus 01 and 02,
executed by nbclient with its world-size parameter set, then a table.

    python -m ddp_tutorial.harness.rehearse --ranks 3 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddp_tutorial.harness.course import NOTEBOOK_DIR, REPO_ROOT


def per_node(ranks: int) -> int:
    """Ranks per node of a two-"node" lesson: half of ``ranks``, or all of an odd count."""
    return ranks // 2 if ranks % 2 == 0 else ranks


# lesson -> its world-size parameter(s) for n ranks. Lessons that start two "nodes" take
# ranks per node (:func:`per_node`); a lesson whose claims are about exactly two ranks has none.
WORLD_PARAMETERS: dict[str, Callable[[int], dict[str, Any]]] = {
    "00_environment": lambda n: {"NPROC": n},
    "01_process_groups": lambda n: {"NPROC": n},
    "02_data_sampling": lambda n: {"NPROC": n},
    "03_device_mapping": lambda n: {"GPUS_PER_NODE": per_node(n)},
    "04_ddp_wrapping": lambda n: {"NPROC": n},
    "06_training_and_utilization": lambda n: {"NPROC": n},
    "10_multinode": lambda n: {"NPROC_PER_NODE": per_node(n)},
    "11_speed_tools": lambda n: {"NPROC": n},
    "12_beyond_ddp": lambda n: {"NPROC": n},
}
FIXED = {  # in gpu-check's plan, but their launches do not follow the GPU count
    "05_checkpointing": "its launches are 2 writers / 2 ranks by design (the race, the resume)",
    "08_fault_tolerance": "a 2-rank job and its restart: the claims are about one rank dying",
    "09_debugging": "each case is a rank 0 against rank 1 story (the GPU branches use every GPU)",
}
CELL_TIMEOUT_S = 600.0  # 8 gloo ranks on 2 cores: a launch can take minutes


def rehearsal_plan(
    ranks: int, lessons: Sequence[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """``[(notebook stem, parameters)]`` for a rehearsal at ``ranks`` ranks.

    ``lessons``: only these (stems of :data:`WORLD_PARAMETERS`), as the test suite
    rehearses one lesson to keep this code path running.
    """
    if ranks < 2:
        raise ValueError(f"a rehearsal needs at least 2 ranks, got {ranks}")
    unknown = set(lessons or ()) - set(WORLD_PARAMETERS)
    if unknown:
        raise ValueError(f"not rehearsed: {sorted(unknown)} (see WORLD_PARAMETERS and FIXED)")
    return [(lesson, params(ranks)) for lesson, params in WORLD_PARAMETERS.items()
            if lessons is None or lesson in lessons]  # fmt: skip


def rehearse(
    ranks: int, output_dir: Path, echo: bool = True, lessons: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Run the lessons of :func:`rehearsal_plan` at ``ranks`` ranks; one table row each."""
    from ddp_tutorial.harness.course import run_notebook

    rows = []
    for lesson, parameters in rehearsal_plan(ranks, lessons):
        if echo:
            print(f"rehearse: {lesson} at {ranks} ranks {parameters} ...", flush=True)
        began = time.monotonic()
        path = NOTEBOOK_DIR / f"{lesson}.ipynb"
        result = run_notebook(path, output_dir, CELL_TIMEOUT_S, parameters, html=False)
        cell = f" in cell {result.failed_cell}" if result.failed_cell is not None else ""
        status = "ok" if result.ok else f"FAILED{cell}"
        if echo and not result.ok:
            print(result.error[-3000:], flush=True)
        rows.append({"lesson": lesson[:2], "ranks": ranks, "parameters": parameters,
                     "seconds": round(time.monotonic() - began, 1), "status": status})  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from ddp_tutorial.records import format_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--output-dir", type=Path, default=REPO_ROOT / "build" / "rehearse")
    parser.add_argument("--lessons", nargs="+", help="only these notebooks (stems), e.g. "
                        "02_data_sampling")  # fmt: skip
    args = parser.parse_args(argv)
    began, rows = time.monotonic(), []
    for ranks in args.ranks:
        rows += rehearse(ranks, args.output_dir / f"{ranks}-ranks", lessons=args.lessons)
    print()
    print(format_table(rows, ["lesson", "ranks", "parameters", "seconds", "status"]))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())  # a busy machine explains slow rows
    print(f"rehearsal: {time.monotonic() - began:.0f} s in all; load average {load} (1, 5, 15 min)")
    for lesson, why in FIXED.items():
        print(f"lesson {lesson[:2]}: not rehearsed, {why}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
