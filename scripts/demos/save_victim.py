"""Kill the writer (SIGKILL) in the middle of a checkpoint save, K times: what is left?

Run it from the shell:

    python scripts/demos/save_victim.py --dir /tmp/victim --trials 5

A crash, an out-of-memory kill or a pre-empted node stops a process between
any two bytes, with no ``finally`` and no cleanup. For each ``--modes`` entry
this script first writes a good checkpoint (version 0), then ``--trials``
times: forks a child that saves version ``k`` over it, waits until the save
is visibly under way (bytes on disk, not yet complete), and SIGKILLs the
child. Then it loads the checkpoint path:

* ``torch.save`` (the seeds' way) truncates the file first and writes it in
  place: the kill leaves a file cut short, which torch cannot read;
* :func:`ddp_tutorial.checkpoint.atomic_save` writes a temp file and renames
  it only when complete: the kill leaves version 0 intact (and a stale temp
  file, the proof that the kill landed mid-write).

Not a distributed script: the victim is a single writer, as rank 0 is.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

from ddp_tutorial.checkpoint import CheckpointError, atomic_save, load_checkpoint, stale_temp_files
from ddp_tutorial.records import write_json

MODES = ("torch.save", "atomic_save")
MAX_ATTEMPTS = 5  # per trial, when a save completes before the kill lands


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory for the checkpoint")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--trials", type=int, default=5, help="kills per mode")
    parser.add_argument("--mb", type=int, default=48, help="checkpoint size in MB (slow save)")
    parser.add_argument("--out", default=None, help="directory for result.json")
    args = parser.parse_args()
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        parser.error(f"unknown mode(s) {sorted(bad)}; choose from {MODES}")
    if args.trials < 1 or args.mb < 1:
        parser.error("--trials and --mb must be >= 1")
    return args


def make_state(version: int, numel: int) -> dict:
    return {"version": version, "model": {"weight": torch.full((numel,), float(version))}}


def save(mode: str, state: dict, path: Path) -> None:
    if mode == "torch.save":
        torch.save(state, path)
    else:
        atomic_save(state, path)


def bytes_on_disk(mode: str, path: Path) -> int:
    """How far the save in progress has got (the file written in place, or the temp file)."""
    if mode == "torch.save":
        return path.stat().st_size if path.exists() else 0
    temps = stale_temp_files(path.parent)
    return max((t.stat().st_size for t in temps if t.exists()), default=0)


def kill_mid_save(mode: str, path: Path, version: int, numel: int, full: int) -> dict:
    """Fork a writer of ``version``, SIGKILL it once part of the file is written."""
    state = make_state(version, numel)  # built before the fork: the child only writes
    pid = os.fork()
    if pid == 0:  # the child: save, and exit without any cleanup
        try:
            save(mode, state, path)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    written = 0
    while time.monotonic() < deadline:
        written = bytes_on_disk(mode, path)
        if full // 4 < written < full:  # visibly under way, not finished
            break
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:  # the save finished before we caught it (a busy machine): a miss, not a trial
            return {"written_at_kill": written, "killed": False}
        time.sleep(0.0005)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return {"written_at_kill": written, "killed": killed}


def run_mode(mode: str, directory: Path, trials: int, numel: int) -> dict:
    path = directory / f"{mode.replace('.', '_')}.pt"
    atomic_save(make_state(0, numel), path)  # the previous, good checkpoint
    full = path.stat().st_size
    outcomes, missed = [], 0
    for k in range(1, trials + 1):
        for _ in range(MAX_ATTEMPTS):
            for stale in stale_temp_files(directory):
                stale.unlink()
            kill = kill_mid_save(mode, path, k, numel, full)
            if kill["killed"]:
                break
            missed += 1
            atomic_save(make_state(0, numel), path)  # the save completed: put version 0 back
        temps = stale_temp_files(directory)
        try:
            loaded = load_checkpoint(path)
            version = loaded["version"]
            intact = version == 0 and bool((loaded["model"]["weight"] == 0).all())
            error = ""
        except CheckpointError as exc:
            version, intact, error = None, False, str(exc)
        # "Mid-write": the kill landed after a quarter of the bytes and before the end.
        mid_write = kill["killed"] and full // 4 < kill["written_at_kill"] < full
        outcomes.append(
            {
                "trial": k,
                **kill,
                "mid_write": mid_write,
                "file_bytes": path.stat().st_size if path.exists() else 0,
                "temp_files_left": len(temps),
                "loaded_version": version,
                "previous_intact": intact,
                "error": error,
            }
        )
        if not intact:
            atomic_save(make_state(0, numel), path)  # restore version 0 for the next trial
    left_behind = len(stale_temp_files(directory))
    for stale in stale_temp_files(directory):  # safe now: no save is running
        stale.unlink()
    # After the kills, an uninterrupted save still works and replaces the file.
    save(mode, make_state(trials + 1, numel), path)
    final_version = load_checkpoint(path)["version"]
    return {
        "full_bytes": full,
        "trials": outcomes,
        "final_version": final_version,
        "temp_files_removed": left_behind,
        "missed": missed,
    }


def main() -> None:
    args = parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    numel = args.mb * 1024 * 1024 // 4
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(mode, directory, args.trials, numel)
        trials = results[mode]["trials"]
        print(
            f"{mode}: {sum(t['mid_write'] for t in trials)}/{len(trials)} kills landed mid-write, "
            f"previous checkpoint intact after {sum(t['previous_intact'] for t in trials)}, "
            f"unreadable after {sum(bool(t['error']) for t in trials)} "
            f"({results[mode]['missed']} saves finished before the kill and were retried)",
            flush=True,
        )
    if args.out:
        write_json(Path(args.out) / "result.json", results)
    else:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
