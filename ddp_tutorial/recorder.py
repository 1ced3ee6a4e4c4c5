"""What the lessons read from a template run, kept out of the template's loop.

``scripts/train.py`` reaches it through one optional hook: only with ``--out`` does it
import this module (:meth:`Recorder.from_template`, which parses the flags of
:meth:`Recorder.add_arguments` from what the template's parser left over) and call
it at named points: :meth:`~Recorder.step` after each optimizer step,
:meth:`~Recorder.pause` around evaluating and saving, :meth:`~Recorder.evaluated` at
each evaluation, :meth:`~Recorder.epoch_done` at each epoch's end and
:meth:`~Recorder.finish` at the end. It only records: nothing it does steers
training. **Without** ``--out`` the template runs without it, the path a copy of the
template outside this repository runs. With ``--out`` it writes:

* ``attempt{a}-rank{r}.json`` at start-up: who this process is after a
  (re)start (lessons 08 and 10); ``a`` is the job's attempt, agreed by every node
  (:func:`ddp_tutorial.stores.job_store`);
* ``rank{r}.json`` and, on rank 0, ``metrics.json`` at the end (gathered to rank 0
  only): the history, throughput, each evaluation's state digest (lesson 06:
  every rank evaluates one model);
* ``exit-rank{r}.json`` when a preempted rank exits (its step, its exit status: lesson 08;
  torchrun does not print its ranks' statuses on that path);
* with ``--record-indices``: the sample indices each rank was handed, per epoch
  (lesson 10: a resume on another world size sees each sample once) — every index
  of every epoch, so only when a lesson asks;
* with ``--record-steps``: every step's time and, on rank 0, ``steps.jsonl``
  (the loss of every step, across attempts; lesson 08). **Cost:** a per-step
  loss is a ``.item()``, a host sync that stalls the GPU queue every step; the
  template's default path syncs only every ``--log-every`` steps.

Evaluation pauses the clock. Fault injection for lesson 08 lives here too: rank
``fail_rank`` SIGKILLs itself after ``fail_at_step`` optimizer steps, on the
job's first attempt only.
"""

from __future__ import annotations

import argparse
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

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The lessons' flags, in a group of their own (the template's --help lists them last)."""
        add = parser.add_argument_group("recording, for the lessons").add_argument
        add("--out", help="run directory: metrics.json, rank and attempt records")
        add("--record-steps", action="store_true", help="per-step loss/time (a sync per step)")
        add("--record-indices", action="store_true", help="every sample index each rank read")
        add("--fail-at-step", type=int, help="fault injection (lesson 08): die after this step")
        add("--fail-rank", type=int, default=1, help="the rank that dies")

    @classmethod
    def from_template(
        cls,
        args: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        resumed_from: dict[str, int] | None = None,
        attempt: int = 0,
    ) -> Recorder:
        """The template's hook: ``args.out`` and the lessons' flags in ``args.hook_argv``
        (what the template's own parser did not know)."""
        parser = argparse.ArgumentParser(prog="train.py --out DIR")
        cls.add_arguments(parser)
        own = parser.parse_args(list(args.hook_argv))
        own.out, own.grad_accum = args.out, args.grad_accum
        return cls(own, rank, world_size, device, resumed_from, attempt)

    def __init__(
        self,
        args: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        resumed_from: dict[str, int] | None = None,
        attempt: int = 0,
    ):
        """``args``: the template's flags (those of :meth:`add_arguments`). ``attempt``:
        the job's, agreed by every node. Call it after resuming, before the first step:
        it writes the attempt record and opens the step log."""
        self.out = Path(args.out) if args.out else None
        self.rank, self.world_size, self.device = rank, world_size, device
        self.per_step, self.keep_indices = args.record_steps, args.record_indices
        self.fail_at_step, self.fail_rank = args.fail_at_step, args.fail_rank
        self.attempt, self.resumed_from = attempt, resumed_from
        self.evaluations: list[dict[str, Any]] = []
        self.indices: dict[int, list[int]] = {}
        self.t_start = self.t_end = time.time()
        self.steps = 0  # optimizer steps in this process
        self.spans: list[tuple[Any, Any, int]] = []  # timed stretches: (start, end, steps)
        self._span: list[Any] | None = None  # the open one: [start, steps]
        self.intervals: list[tuple[Any, Any]] = []  # --record-steps: every step's
        self._previous: Any = None
        self._first: Any = None
        self._step_log: Any = None
        if self.out is not None:
            self._write_attempt_record()

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if self.device.type == "cuda" else b - a

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
                # this node's agent's own count, which another node's may not equal (lesson 10)
                "agent_restarts": env_int("TORCHELASTIC_RESTART_COUNT", 0),
            },
        )
        if self.per_step and self.rank == 0:  # append across attempts, a line at a time
            self._step_log = (self.out / "steps.jsonl").open("a", buffering=1)

    def step(self, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (1-based, global); ``loss`` (the last micro-batch's
        mean) stays on the device.

        A timed stretch starts at the end of the :data:`WARMUP_STEPS`-th step (and
        of the first step after each evaluation) and counts the steps after it.
        """
        self.steps += 1
        if self.steps == 1:  # for a run too short to time after warm-up
            self._first = self._now()
        if self._span is not None:
            self._span[1] += 1
        elif self.steps >= WARMUP_STEPS:
            self._span = [self._now(), 0]
        if self.per_step:  # a clock reading per step: only when asked
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

    def pause(self) -> None:
        """Evaluating or saving is not training: close the timed stretch, restart it later."""
        if self._span is not None and self._span[1] > 0:
            self.spans.append((self._span[0], self._now(), self._span[1]))
        self._span, self._previous = None, None  # the next step's end starts a new stretch

    def evaluated(self, epoch: int, step: int, model: nn.Module, moved: float) -> None:
        """At an evaluation: the digest of exactly what this rank evaluates (and saves)
        and how far averaging moved its buffers (``moved``); only with ``--out``."""
        self.pause()
        if self.out is not None:
            digest = state_digest(model)
            self.evaluations.append({"epoch": epoch, "step": step, "digest": digest,
                                     "moved": moved})  # fmt: skip

    def epoch_done(self, epoch: int, sampler: Any, count: int) -> None:
        """With ``--record-indices``: the first ``count`` indices ``sampler`` handed this rank."""
        if self.keep_indices:
            self.indices.setdefault(epoch, []).extend(list(sampler)[:count])

    def exiting(self, step: int, code: int) -> None:
        """This rank leaves now, at ``step``, with exit status ``code`` (a preemption)."""
        if self.out is not None:
            write_json(self.out / f"exit-rank{self.rank}.json",
                       {"rank": self.rank, "step": step, "exit": code})  # fmt: skip

    def step_times(self) -> list[float]:
        """Seconds per step, data loading included (``--record-steps`` only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return [self._seconds(a, b) for a, b in self.intervals]

    def finish(
        self, steps: int, history: list[dict[str, Any]], global_batch: int, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """Throughput of the slowest rank, and the records; a collective (call on every rank)."""
        if not self.spans and self._span is None and self.steps > 1:  # too short: every step
            self._span = [self._first, self.steps - 1]
        self.pause()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t_end = time.time()
        if self._step_log is not None:
            self._step_log.close()
        mine = [sum(self._seconds(a, b) for a, b, _ in self.spans), sum(n for *_, n in self.spans)]
        slowest = torch.tensor([mine[0], -mine[1]], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every step waits for the slowest rank
        seconds, timed_steps = slowest[0].item(), -slowest[1].item()
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
        }
        if self.out is not None:
            self._write_records(mine, metrics)
        return metrics

    def _write_records(self, timed: list[float], metrics: dict[str, Any]) -> None:
        """``rank{r}.json`` on every rank; every rank's gathered to rank 0 for ``metrics.json``."""
        assert self.out is not None
        mine = {
            "rank": self.rank,
            "pid": os.getpid(),
            "train_start": self.t_start,
            "train_end": self.t_end,
            "restart_count": self.attempt,
            "resumed_from": self.resumed_from,
            "timed": timed,
            "step_times": self.step_times() if self.per_step else [],
            "evaluations": self.evaluations,
            "indices": self.indices,
        }
        write_rank_record(self.out, mine)
        small = {k: v for k, v in mine.items() if k != "indices"}
        ranks: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(small, ranks, dst=0)
        if ranks is not None:
            metrics["step_times"] = {str(r["rank"]): r["step_times"] for r in ranks}
            metrics["ranks"] = [{k: v for k, v in r.items() if k != "step_times"} for r in ranks]
            write_json(self.out / "metrics.json", metrics)


def read_step_log(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rank 0's ``{"attempt", "step", "loss"}`` rows from a run's ``steps.jsonl``, in order."""
    path = Path(run_dir) / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
