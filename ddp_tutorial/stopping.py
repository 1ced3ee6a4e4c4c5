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

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
PREEMPTED_EXIT = kit.PREEMPTED_EXIT
SIGNALS = kit.SIGNALS
DivergedError = kit.DivergedError
Verdict = kit.Verdict
StopCheck = kit.StopCheck
agreed_batches = kit.agreed_batches  # the same agreement between an evaluation's batches
