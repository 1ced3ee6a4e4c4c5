"""Lesson 08 (fault tolerance): a preemption at a given step, the workers' resume check, a figure.

* :class:`SignalAtStep` sends a signal to a running launch (torchrun) once the
  template's ``steps.jsonl`` shows a given step: a preemption that lands
  mid-epoch, wherever the machine's speed puts the steps.
* :class:`WhenDone` starts what follows a launch the moment it ends (a requeue);
  :func:`excerpt` shows a few lines of a file as they are now; :func:`agreement_steps`
  when the template's ranks agree on a signal, for a given step time.
* :func:`worker_resume_check` runs the template's own ``data_loader`` with
  DataLoader workers and random augmentation, and reports what a resume keeps
  exactly (run it in a subprocess: ``python -m ddp_tutorial.lessons.faults
  workers OUT.json`` — the notebook kernel never forks DataLoader workers).
* :func:`fault_figure` draws the lesson's runs: one job's loss across a crash, a
  restart, a preemption and its rerun; and a run that diverged.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ddp_tutorial.data import SyntheticImages
from ddp_tutorial.lessons.speed import script_module

TEMPLATE = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


class SignalAtStep(threading.Thread):
    """Send ``sig`` to ``launch``'s torchrun once ``steps_file`` has a row with ``step >= step``.

    ``steps_file`` is the template's ``steps.jsonl`` (``--record-steps``), one
    line per optimizer step, written by rank 0 as it goes. The thread gives up
    when the launch ends first (``sent_after`` stays None). ``sent_after``: the
    newest step in the file when the signal went; ``sent_at``: ``time.monotonic()``
    then (the clock of ``Launch.start_time``).
    """

    def __init__(
        self,
        launch: Any,
        steps_file: str | os.PathLike[str],
        step: int,
        sig: int = signal.SIGTERM,
        poll_s: float = 0.01,
    ):
        super().__init__(daemon=True)
        self.launch, self.steps_file, self.step = launch, Path(steps_file), step
        self.sig, self.poll_s = sig, poll_s
        self.sent_after: int | None = None
        self.sent_at: float | None = None

    def _newest_step(self) -> int:
        try:
            lines = self.steps_file.read_text().splitlines()
        except FileNotFoundError:
            return 0
        steps = []
        for line in lines:
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError):  # a line being written
                continue
        return max(steps, default=0)

    def run(self) -> None:
        while self.launch.proc.poll() is None:
            newest = self._newest_step()
            if newest >= self.step:
                self.launch.proc.send_signal(self.sig)  # not by number: it may be reaped by now
                self.sent_after, self.sent_at = newest, time.monotonic()
                return
            time.sleep(self.poll_s)


class WhenDone(threading.Thread):
    """Run ``then()`` as soon as ``launch``'s torchrun has exited; its return value in ``result``.

    What a scheduler does with a preempted job: the moment it ends, requeue it.
    The caller still collects ``launch`` itself (``launch.wait()``); an exception
    from ``then`` is kept in ``error`` and raised again by :meth:`get`.
    """

    def __init__(self, launch: Any, then: Callable[[], Any]):
        super().__init__(daemon=True)
        self.launch, self.then = launch, then
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        self.launch.proc.wait()
        try:
            self.result = self.then()
        except BaseException as exc:  # handed to the caller by get()
            self.error = exc

    def get(self, timeout: float | None = None) -> Any:
        """``then()``'s result, once it ran (raises what it raised)."""
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"{self.launch.spec.name} had not ended within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


def excerpt(source: str, first: str, last: str) -> str:
    """The lines of ``source`` from the first one containing ``first`` to the next containing
    ``last``, dedented: a few lines of a file shown as they are when the cell runs."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if first in line), None)
    if start is None:
        raise ValueError(f"{first!r} is not in the source any more")
    end = next((i for i in range(start, len(lines)) if last in lines[i]), None)
    if end is None:
        raise ValueError(f"{last!r} does not follow {first!r} in the source any more")
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def agreement_steps(step_s: float, steps: int = 30) -> list[int]:
    """The steps at which the template's ``StopCheck`` agrees across ranks (its all_reduce),
    for steps of ``step_s`` seconds on a clock that only moves with them (no launch, no group:
    the same decisions, made alone). Its SIGTERM/SIGUSR1 handlers are put back afterwards."""
    from ddp_tutorial.stopping import StopCheck

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    now = [0.0]
    try:
        checks = StopCheck(torch.device("cpu"), clock=lambda: now[0])
        agreed = []
        for step in range(1, steps + 1):
            now[0] += step_s
            before = checks.next_step
            checks.check(step)
            if checks.next_step != before:
                agreed.append(step)
        return agreed
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def load_template() -> ModuleType:
    """``scripts/train.py`` as a module (its functions, without a launch)."""
    return script_module(TEMPLATE, "template_train")


class AugmentedImages(SyntheticImages):
    """SyntheticImages plus a random shift drawn from torch's RNG, like a random crop.

    The label is the sample's index, so a batch says which samples it holds.
    The base image depends on the index only; the shift on the RNG of the
    process that loads it: the DataLoader worker, or the rank itself with
    ``num_workers=0``.
    """

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:  # type: ignore[override]
        x, _ = super().__getitem__(index)
        return x + torch.rand(()), index


def worker_resume_check(
    workers: int = 2, batch_size: int = 4, samples: int = 64, resume_after: int = 3
) -> dict[str, bool]:
    """What a resume of the template's loader keeps, with and without DataLoader workers.

    Rank 0 of 2, the template's ``data_loader`` and the two lines of its loop that
    start an epoch (``set_epoch(epoch, consumed)``, the workers' generator seeded
    per epoch). An uninterrupted run reads epochs 0 and 1; resumes build a new
    loader (a new process would) and read epoch 1 again: from its start (an
    epoch-boundary snapshot) and after ``resume_after`` batches (a mid-epoch
    one). Each resume first puts back the rank's RNG state of that moment
    (:func:`ddp_tutorial.snapshots.restore_rng_state`), as the template's resume
    does: without workers the augmentation draws from it, so that is all it needs.
    """
    from ddp_tutorial.seeding import rank_seed
    from ddp_tutorial.snapshots import capture_rng_state, restore_rng_state

    template = load_template()
    data = AugmentedImages(samples, 8, 4)
    world = 2
    found: dict[str, bool] = {}
    for w in (workers, 0):
        args = template.parse_args(["--batch-size", str(batch_size), "--num-workers", str(w)])

        def epoch(sampler: Any, loader: Any, e: int, consumed: int = 0, seed: int = 0) -> list[Any]:
            sampler.set_epoch(e, consumed)  # the template's loop, section 8
            loader.generator.manual_seed(rank_seed(seed, 0, e, 1))
            return list(loader)

        sampler, loader = template.data_loader(args, data, 0, world, cuda=False)
        epoch(sampler, loader, 0, seed=args.seed)
        rng_at_start = capture_rng_state()  # what a snapshot at the end of epoch 0 holds
        sampler.set_epoch(1, 0)
        loader.generator.manual_seed(rank_seed(args.seed, 0, 1, 1))
        straight, rng_at_cut = [], None
        for i, batch in enumerate(loader):
            straight.append(batch)
            if i == resume_after - 1:  # a snapshot after this step holds the rank's RNG now
                rng_at_cut = capture_rng_state()
        sampler, loader = template.data_loader(args, data, 0, world, cuda=False)  # a new process
        restore_rng_state(rng_at_start)  # as the template's resume does
        boundary = epoch(sampler, loader, 1, seed=args.seed)
        sampler, loader = template.data_loader(args, data, 0, world, cuda=False)
        assert rng_at_cut is not None
        restore_rng_state(rng_at_cut)
        mid = epoch(sampler, loader, 1, resume_after * batch_size * world, args.seed)
        rest = straight[resume_after:]
        kind = "workers" if w else "no_workers"
        found[f"{kind}_boundary_exact"] = all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for a, b in zip(straight, boundary, strict=True)
        )
        found[f"{kind}_mid_epoch_order_exact"] = len(mid) == len(rest) and all(
            torch.equal(a[1], b[1]) for a, b in zip(rest, mid, strict=True)
        )
        found[f"{kind}_mid_epoch_augmentation_exact"] = all(
            torch.equal(a[0], b[0]) for a, b in zip(rest, mid, strict=True)
        )
    return found


def _steps(rows: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def fault_figure(
    job: Sequence[Mapping[str, Any]],
    rerun: Sequence[Mapping[str, Any]],
    reference: Sequence[Mapping[str, Any]],
    crash_step: int,
    resume_step: int,
    preempt_step: int,
    diverged: Sequence[Mapping[str, Any]],
    kept: Sequence[int],
    bad_step: int,
) -> Any:
    """Two panels from the runs' ``steps.jsonl`` rows (``{"attempt", "step", "loss"}``).

    1. a job's life over the uninterrupted run (``reference``): attempt 0 up to
       its crash, attempt 1 from the snapshot before it (the replayed steps lie
       on top of the first attempt's) up to a preemption, then the rerun;
    2. a run that diverged: the loss on a log scale (finite values), the
       snapshots it kept and the first step that was not finite.
    """
    from ddp_tutorial.harness.plots import loss_across_restarts, new_figure

    fig = new_figure(figsize=(13, 3.8))
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    loss_across_restarts(job, crash_step=crash_step, resume_step=resume_step,
                         reference=reference, ax=ax1)  # fmt: skip
    ax1.plot(*_steps(rerun), ".-", lw=1, color="tab:purple", label="rerun (requeued)")
    ax1.axvline(preempt_step, color="tab:purple", ls="--", lw=1,
                label=f"SIGTERM: snapshot of step {preempt_step}")  # fmt: skip
    ax1.legend(fontsize="small", ncol=2)
    ax1.set_title("one job: a crash, a restart, a preemption, a rerun")
    steps, losses = _steps(diverged)
    finite = [(s, v) for s, v in zip(steps, losses, strict=True) if math.isfinite(v)]
    ax2.semilogy([s for s, _ in finite], [max(v, 1e-3) for _, v in finite], ".-", lw=1,
                 color="tab:red", label="loss (finite values)")  # fmt: skip
    for k, step in enumerate(kept):
        ax2.axvline(step, color="tab:green", ls=":", lw=1.5,
                    label="snapshots kept" if k == 0 else None)  # fmt: skip
    ax2.axvline(bad_step, color="black", ls="--", lw=1, label=f"not finite from step {bad_step}")
    ax2.set_title("a learning rate too large: divergence")
    ax2.set_xlabel("global step")
    ax2.set_ylabel("rank 0 batch loss (log)")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    """``python -m ddp_tutorial.lessons.faults workers OUT.json``: the workers check, as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "workers":
        sys.exit("usage: python -m ddp_tutorial.lessons.faults workers OUT.json")
    Path(argv[1]).write_text(json.dumps(worker_resume_check()))


if __name__ == "__main__":
    main()
