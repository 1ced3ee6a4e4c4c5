"""Stop (or save) together: a signal, a loss that is no longer finite, a snapshot that is due.

Each of these is noticed by one rank alone, and is useless unless every rank
acts on it at the same step — a rank that saves or leaves alone leaves the
others waiting in a collective. :class:`StopCheck` turns them into one
decision, taken by every rank at the same step boundary with one small
``all_reduce`` every ``every`` steps (reading its result is a host sync, so
not at every step):

* **a signal.** On preemption torchrun forwards SIGTERM to every rank and
  SIGKILLs them ``--shutdown-timeout`` seconds later (30 by default; SLURM's
  KillWait is 30 s too). SIGUSR1 is what ``#SBATCH --signal=B:USR1@120`` sends
  before the time limit (``scripts/slurm/train.sbatch`` forwards it). The
  handler only sets a flag: the rank finishes its step, the ranks agree,
  save a snapshot of that step and exit with :data:`PREEMPTED_EXIT`, and the
  rerun resumes from it. That 75 is each rank's own status: torchrun, signalled
  too, re-raises the signal and exits 1, so a scheduler never sees 75 — the job
  script requeues it (``train.sbatch``'s trap runs ``scontrol requeue``). (torchrun also
  sends SIGTERM to stop a node's ranks for a restart; a rank blocked in a
  collective with a dead peer never reaches a step boundary — gloo fails that
  collective at once, nccl waits, and torchrun SIGKILLs it after the grace.)
* **divergence.** A loss that became inf or nan is remembered on the device
  (the first such step, no sync), and before a save the weights themselves are
  checked (an update can make them inf while the loss that led to it was finite);
  a snapshot of either would be useless, and with ``keep=2`` pruning it would
  delete the last good ones. The ranks stop, together, before saving it, and the
  error names the step.
* **time.** A snapshot every ``save_minutes`` (0: off), whatever the step
  time: a crash then loses at most that much work, by default.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

PREEMPTED_EXIT = 75  # EX_TEMPFAIL, "try again later": each rank's status; torchrun itself exits 1
SIGNALS = ("SIGTERM", "SIGUSR1")


class DivergedError(RuntimeError):
    """The loss stopped being finite; nothing after the last good snapshot was saved."""


@dataclass(frozen=True)
class Verdict:
    """What every rank does after a check (the same on every rank)."""

    stop: bool  # a signal arrived on some rank: save and exit
    save: bool  # a timed snapshot is due
    signal: str | None = None


class StopCheck:
    """One rank's view of why the job should stop or save; :meth:`check` makes it every rank's."""

    def __init__(self, device: torch.device, every: int = 10, save_minutes: float = 0.0):
        """``every``: steps between agreements (keep ``every`` x step time well under the
        30 s torchrun waits after forwarding a signal). Installs the signal handlers."""
        self.device, self.every, self.save_s = device, every, save_minutes * 60
        self.received: int | None = None
        self.first_bad = torch.full((), math.inf, dtype=torch.float64, device=device)
        self.last_save = time.monotonic()
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame: object) -> None:  # only a flag: safe anywhere
        self.received = signum

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """After each step: remember the first step whose loss was not finite (on the device)."""
        now = torch.full((), float(step), dtype=torch.float64, device=self.device)
        worse = torch.minimum(self.first_bad, now)
        self.first_bad = torch.where(loss.detach().isfinite(), self.first_bad, worse)

    def saved(self) -> None:
        """A snapshot was written: the time-based interval starts again."""
        self.last_save = time.monotonic()

    def check(
        self, step: int, force: bool = False, params: Iterable[torch.Tensor] | None = None
    ) -> Verdict:
        """Every ``every`` steps (or ``force``: before any save), agree across ranks.

        ``params``: the weights about to be saved, checked too. Raises
        :class:`DivergedError` on every rank when any rank's loss (or weights)
        stopped being finite; otherwise says whether to stop or save.
        """
        if not force and step % self.every:
            return Verdict(False, False)
        if params is not None and not nn.utils.get_total_norm(list(params)).isfinite():
            self.first_bad.fill_(min(float(step), self.first_bad.item()))
        due = self.save_s > 0 and time.monotonic() - self.last_save >= self.save_s
        mine = torch.tensor([self.received or 0, due], dtype=torch.float64, device=self.device)
        flags = torch.cat([mine, -self.first_bad.reshape(1)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # one decision, the same everywhere
        received, due_any, bad = flags.tolist()
        if math.isfinite(bad):
            raise DivergedError(
                f"the loss or the weights stopped being finite at step {int(-bad)}: every rank "
                f"stops before saving them (the snapshots in --checkpoint-dir are from before). "
                f"Lower --lr, keep --clip-grad on, use --warmup, or look for a bad batch there"
            )
        name = signal.Signals(int(received)).name if received else None
        return Verdict(stop=name is not None, save=bool(due_any), signal=name)
