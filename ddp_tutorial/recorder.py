"""What the lessons read from a template run, kept out of the template's loop.

``scripts/train.py`` makes a :class:`Recorder` after resuming (it writes the
attempt record) and calls it at three named points: :meth:`~Recorder.step`
after each optimizer step, :meth:`~Recorder.epoch_end` at each evaluation and
:meth:`~Recorder.finish` at the end. Without ``--out`` it only measures
throughput. With ``--out`` it writes:

* ``attempt{a}-rank{r}.json`` at start-up: who this process is after a
  (re)start (lessons 08 and 10);
* ``rank{r}.json`` and, on rank 0, ``metrics.json`` at the end: the history,
  throughput, each evaluation's state digest (lesson 06: every rank evaluates
  one model), the sample indices each rank was handed (lesson 10: a resume on
  another world size sees each sample once);
* with ``--record-steps``: every step's time and, on rank 0, ``steps.jsonl``
  (the loss of every step, across attempts; lesson 08). **Cost:** a per-step
  loss is a ``.item()``, a host sync that stalls the GPU queue every step; the
  template's default path syncs only every ``--log-every`` steps.

Step times never sync: a ``perf_counter`` per step on CPU, a CUDA event on GPU,
read at the end. Evaluation pauses the clock. Fault injection for lesson 08
lives here too: rank ``fail_rank`` SIGKILLs itself after ``fail_at_step``
optimizer steps, on the first attempt only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_tutorial.records import write_json, write_rank_record
from ddp_tutorial.settings import env_int

WARMUP_STEPS = 5  # not counted in samples_per_sec: first steps allocate, connect, warm caches


def state_digest(state: dict[str, torch.Tensor] | nn.Module) -> str:
    """A short SHA-256 of every tensor of a state dict (or a module's), key by key.

    Two ranks evaluate the same model exactly when their digests match; a
    saved ``final.pt`` loaded back gives the same digest as the model saved.
    """
    if isinstance(state, nn.Module):
        state = state.state_dict()
    h = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().cpu().reshape(-1)  # 0-d tensors (counters) too
        h.update(key.encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Recorder:
    """Records of one rank of one template run (``out=None``: throughput only)."""

    def __init__(
        self,
        args: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        resumed_from: dict[str, int] | None = None,
    ):
        """``args``: the template's flags (``out``, ``record_steps``, ``fail_at_step``,
        ``fail_rank``). Call it after resuming, before the first step: it writes the
        attempt record and opens the step log."""
        self.out = Path(args.out) if args.out else None
        self.rank, self.world_size, self.device = rank, world_size, device
        self.per_step = args.record_steps
        self.fail_at_step, self.fail_rank = args.fail_at_step, args.fail_rank
        self.attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0)
        self.resumed_from = resumed_from
        self.evaluations: list[dict[str, Any]] = []
        self.indices: dict[int, list[int]] = {}
        self.t_start = self.t_end = time.time()
        self.intervals: list[tuple[Any, Any]] = []  # (end of the step before, end of this one)
        self._previous: Any = self._now()
        self._step_log: Any = None
        if self.out is not None:
            self._write_attempt_record()

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _write_attempt_record(self) -> None:
        """Who this process is in this attempt (after a restart, who is who may change)."""
        assert self.out is not None
        write_json(
            self.out / f"attempt{self.attempt}-rank{self.rank}.json",
            {
                "attempt": self.attempt,
                "rank": self.rank,
                "local_rank": env_int("LOCAL_RANK", 0),
                "group_rank": env_int("GROUP_RANK", 0),
                "world_size": self.world_size,
                "pid": os.getpid(),
                "resumed_from": self.resumed_from,
            },
        )
        if self.per_step and self.rank == 0:  # append across attempts, a line at a time
            self._step_log = (self.out / "steps.jsonl").open("a", buffering=1)

    def step(self, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (1-based, global); ``loss`` stays on the device.

        The step's time runs from the end of the step before (its data loading
        included): a perf_counter on CPU, a CUDA event on GPU (no host sync).
        """
        now = self._now()
        if self._previous is not None:
            self.intervals.append((self._previous, now))
        self._previous = now
        if self._step_log is not None:  # .item(): a host sync, the stated cost
            row = {"attempt": self.attempt, "step": step, "loss": loss.item()}
            self._step_log.write(json.dumps(row) + "\n")
        if step == self.fail_at_step and self.rank == self.fail_rank and self.attempt == 0:
            print(f"[fault injection] rank {self.rank} dies after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # abrupt: no cleanup, like a real crash

    def epoch_end(
        self, epoch: int, step: int, model: nn.Module, indices: list[int], moved: float
    ) -> None:
        """At an evaluation: the digest of exactly what this rank evaluates (and saves),
        how far averaging moved its buffers (``moved``), and the sample indices its
        loader was handed in ``epoch`` (in this process). The clock pauses until the
        next step ends: evaluating is not training."""
        digest = state_digest(model)
        self.evaluations.append({"epoch": epoch, "step": step, "digest": digest, "moved": moved})
        self.indices.setdefault(epoch, []).extend(indices)
        self._previous = None

    def step_times(self) -> list[float]:
        """Seconds per timed step (data + compute + communication)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1000 for a, b in self.intervals]
        return [b - a for a, b in self.intervals]

    def finish(
        self, steps: int, history: list[dict[str, Any]], global_batch: int, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """Throughput of the slowest rank, and the records; a collective (call on every rank)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t_end = time.time()
        if self._step_log is not None:
            self._step_log.close()
        times = self.step_times()
        counted = times[WARMUP_STEPS:] or times  # a run shorter than warm-up: every step
        mine = {
            "rank": self.rank,
            "pid": os.getpid(),
            "train_start": self.t_start,
            "train_end": self.t_end,
            "restart_count": self.attempt,
            "resumed_from": self.resumed_from,
            "timed": [sum(counted), len(counted)],
            "step_times": times if self.per_step else [],
            "evaluations": self.evaluations,
            "indices": self.indices,
        }
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        # Every step waits for every rank: the slowest one sets the pace.
        seconds = max(r["timed"][0] for r in ranks)
        timed_steps = min(r["timed"][1] for r in ranks)
        metrics = {
            "world_size": self.world_size,
            "backend": dist.get_backend(),
            "device": str(self.device),
            "steps": steps,
            "global_batch": global_batch,
            "history": history,
            "train_loss": history[-1]["train_loss"] if history else math.nan,
            "val_accuracy": history[-1]["val_accuracy"] if history else math.nan,
            "resumed": self.resumed_from is not None,
            **extra,
            "samples_per_sec": timed_steps * global_batch / seconds if seconds > 0 else math.nan,
            "step_times": {str(r["rank"]): r["step_times"] for r in ranks},
            "ranks": [{k: r[k] for k in mine if k not in ("step_times", "indices")} for r in ranks],
        }
        if self.out is not None:
            write_rank_record(self.out, mine)
            if self.rank == 0:
                write_json(self.out / "metrics.json", metrics)
        return metrics


def read_step_log(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rank 0's ``{"attempt", "step", "loss"}`` rows from a run's ``steps.jsonl``, in order."""
    path = Path(run_dir) / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
