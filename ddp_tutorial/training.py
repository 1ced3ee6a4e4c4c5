"""The Trainer behind ``scripts/train.py``: seed 001's template, done right.

What it does differently from the seeds, and why:

* ``DistributedSampler.set_epoch(epoch)`` every epoch (seed 001 never calls
  it, so every epoch sees the same order);
* the per-rank ``--batch-size`` is per process: the global batch is
  ``batch_size × world_size`` (lesson 02);
* metrics are averaged with ``all_reduce`` so *every* rank has them (seed 001's
  ``reduce`` leaves them on rank 0 only), validation counts every sample once;
* one progress bar, on global rank 0 (seed 001 draws one per rank);
* snapshots through :mod:`ddp_tutorial.checkpoint`: written by global rank 0
  only, atomically, every ``save_every`` steps, at the end of every epoch and
  of training (seed 001 never saves the last epoch); a run restarted with the
  same ``checkpoint_dir`` resumes exactly where the snapshot stood — mid-epoch
  included (the sampler skips the batches already consumed, RNG states are
  restored), so a crash-and-restart gives the same weights bit for bit on CPU;
* fault injection for the fault-tolerance lesson: rank ``fail_rank`` dies by
  SIGKILL at global step ``fail_at_step`` on the first attempt only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_tutorial import checkpoint, distributed, snapshots
from ddp_tutorial.data import distributed_evaluate
from ddp_tutorial.distributed import DistInfo, print0
from ddp_tutorial.models import build_model
from ddp_tutorial.numerics import amp_dtype
from ddp_tutorial.records import write_json, write_rank_record

FINAL_NAME = "final.pt"
KEEP_SNAPSHOTS = 2  # older snapshots are deleted once a newer one is safely on disk


@dataclass
class TrainConfig:
    """Every knob of the template; ``scripts/train.py`` maps its flags onto these."""

    model: str = "cnn"
    image_size: int = 32
    num_classes: int = 10
    num_samples: int = 8192
    num_val: int = 1000
    epochs: int = 3
    batch_size: int = 32  # per rank: the global batch is batch_size * world_size
    lr: float = 0.05
    num_workers: int = 0
    seed: int = 0
    checkpoint_dir: str | None = None
    save_every: int = 0  # steps between snapshots (0: only at epoch ends)
    max_steps: int | None = None
    out: str | None = None
    amp: bool = False
    sync_bn: bool = False
    pretrain: str | None = None
    fail_at_step: int | None = None
    fail_rank: int = 1
    warmup_steps: int = 5  # not counted in samples_per_sec
    progress: bool = True
    backend: str | None = None  # None: auto (nccl with a GPU per rank, else gloo)
    deterministic: bool = False  # bitwise-reproducible kernels (slower on GPUs)
    timeout: float = 600.0  # seconds a collective may wait (a long save on rank 0 included)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch.

    After a restart the loader must not replay the batches the snapshot had
    already consumed: ``start_index`` drops that many of this rank's indices
    from the current epoch's (seeded, deterministic) order.
    """

    def __init__(self, dataset: Dataset, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class Trainer:
    """Train one model under DDP; ``run()`` returns the metrics dict."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, train_set: Dataset, val_set: Dataset):
        self.cfg, self.info = cfg, info
        self.device = info.device
        self.ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP broadcasts anyway)
        model = build_model(cfg.model, cfg.num_classes, cfg.image_size)
        if cfg.pretrain:
            # Before wrapping: the file may come from a DDP run ("module.") or a
            # compiled model ("_orig_mod."), saved on a GPU or a CPU.
            checkpoint.load_model_state(model, cfg.pretrain, map_location="cpu")
        if cfg.sync_bn:
            if info.backend != "nccl":
                raise ValueError(
                    "--sync-bn needs GPUs with the nccl backend: SyncBatchNorm has no CPU/gloo "
                    f"implementation (this run uses {info.backend} on {info.device}). "
                    "Drop --sync-bn on CPU."
                )
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = distributed.wrap(model, self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.sampler = ResumableSampler(train_set, shuffle=True, seed=cfg.seed)
        self.loader = DataLoader(
            train_set,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
            drop_last=True,  # equal step counts on every rank: no rank waits for a missing batch
        )
        self.val_set = val_set
        self.amp_dtype = amp_dtype(self.device, cfg.amp)
        # Progress state: what a snapshot holds besides weights.
        self.epoch = 0
        self.step = 0  # global optimizer steps taken
        self.batch_in_epoch = 0
        self.loss_sum = 0.0
        self.loss_count = 0
        self.history: list[dict[str, float]] = []
        self.step_times: list[float] = []
        self.resumed_from: dict[str, int] | None = None
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._step_log: Any = None

    # -- checkpoints --------------------------------------------------------
    def save_snapshot(self) -> None:
        """A full snapshot (a collective: every rank's RNG state is gathered)."""
        if self.ckpt_dir is None:
            return
        state = snapshots.training_state(
            self.model,
            self.optimizer,
            epoch=self.epoch,
            step=self.step,
            batch_in_epoch=self.batch_in_epoch,
            extra={
                "loss_sum": self.loss_sum,
                "loss_count": self.loss_count,
                "history": self.history,
                "config": asdict(self.cfg),
            },
        )
        checkpoint.save_checkpoint(snapshots.snapshot_path(self.ckpt_dir, self.step), state)
        if self.info.is_main:  # the newest snapshots are complete (renamed), drop older ones
            snapshots.prune_snapshots(self.ckpt_dir, keep=KEEP_SNAPSHOTS)

    def maybe_resume(self) -> bool:
        """Continue from the newest snapshot in ``checkpoint_dir``, if there is one."""
        path = snapshots.agreed_latest_snapshot(self.ckpt_dir)  # rank 0 decides for all
        if path is None:
            return False
        state = checkpoint.load_checkpoint(path, map_location=self.device)
        where = snapshots.restore_training_state(state, self.model, self.optimizer)
        self.epoch, self.step = where["epoch"], where["step"]
        self.batch_in_epoch = where["batch_in_epoch"]
        extra = state["extra"]
        self.loss_sum, self.loss_count = extra["loss_sum"], extra["loss_count"]
        self.history = list(extra["history"])
        self.resumed_from = {"epoch": self.epoch, "step": self.step, "batch": self.batch_in_epoch}
        print0(f"resumed from {path.name}: epoch {self.epoch}, step {self.step}")
        return True

    # -- one epoch ----------------------------------------------------------
    def _maybe_fail(self) -> None:
        cfg = self.cfg
        if (
            cfg.fail_at_step is not None
            and self.step == cfg.fail_at_step
            and self.info.rank == cfg.fail_rank
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        ):
            print(f"[fault injection] rank {self.info.rank} dies at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # abrupt: no cleanup, like a real crash

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.cfg.amp
        ):
            loss = self.loss_fn(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all_reduces gradient buckets while backward runs
        self.optimizer.step()
        return loss.detach()

    def _finished(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def train_epoch(self, bar: Any) -> None:
        cfg = self.cfg
        self.sampler.set_epoch(self.epoch)  # a new shuffle every epoch, the same on every rank
        self.sampler.start_index = self.batch_in_epoch * cfg.batch_size
        self.model.train()
        sync = self.device.type == "cuda"
        last = time.perf_counter()
        for x, y in self.loader:
            if self._finished():
                return
            self._maybe_fail()
            loss = self._train_step(x, y)
            if sync:
                torch.cuda.synchronize(self.device)  # honest step times on GPU
            now = time.perf_counter()
            self.step_times.append(now - last)  # data loading + compute + communication
            last = now
            self.step += 1
            self.batch_in_epoch += 1
            value = loss.item()
            self.loss_sum += value
            self.loss_count += 1
            if self._step_log is not None:
                self._step_log.write(
                    json.dumps({"attempt": self.attempt, "step": self.step, "loss": value}) + "\n"
                )
            if bar is not None:
                bar.update(1)
                if self.step % 10 == 0:
                    rate = cfg.batch_size * self.info.world_size / self.step_times[-1]
                    bar.set_postfix(loss=f"{value:.3f}", samples_s=f"{rate:.0f}")
            if cfg.save_every and self.step % cfg.save_every == 0:
                self.save_snapshot()

    # -- metrics ------------------------------------------------------------
    def mean_train_loss(self) -> float:
        """This epoch's loss averaged over every rank's batches (all_reduce: all ranks get it)."""
        totals = torch.tensor(
            [self.loss_sum, float(self.loss_count)], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1].clamp(min=1)).item()

    def validate(self) -> float:
        """Exact accuracy: each validation sample counted exactly once across ranks."""
        return distributed_evaluate(self.model, self.val_set, device=self.device).accuracy

    # -- the whole run ------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        resumed = self.maybe_resume()
        if cfg.out:
            self._open_attempt_records()
        steps_per_epoch = self.sampler.num_samples // cfg.batch_size  # drop_last=True
        bar = self._progress_bar(steps_per_epoch) if info.is_main and cfg.progress else None
        t_start = time.time()
        while self.epoch < cfg.epochs and not self._finished():
            self.train_epoch(bar)
            if self._finished() and self.batch_in_epoch < steps_per_epoch:
                break  # --max-steps stopped mid-epoch
            self._end_of_epoch_row()
            self.epoch += 1
            self.batch_in_epoch, self.loss_sum, self.loss_count = 0, 0.0, 0
            self.save_snapshot()  # the end of every epoch always saves
        t_end = time.time()
        if bar is not None:
            bar.close()
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        if not self.history or self.history[-1]["step"] != self.step:
            # stopped mid-epoch by --max-steps: still report and save where we are
            self._end_of_epoch_row()
            self.save_snapshot()
        if self.ckpt_dir is not None:
            # The deliverable: the plain model, no "module." prefix, weights_only-loadable.
            checkpoint.save_checkpoint(self.ckpt_dir / FINAL_NAME, self.model.module.state_dict())
        return self._metrics(t_start, t_end, resumed)

    def _open_attempt_records(self) -> None:
        """One record per rank per attempt (after a restart, who is who may have changed)."""
        info, out = self.info, Path(self.cfg.out)
        write_json(
            out / f"attempt{self.attempt}-rank{info.rank}.json",
            {
                "attempt": self.attempt,
                "rank": info.rank,
                "local_rank": info.local_rank,
                "group_rank": int(os.environ.get("GROUP_RANK", "0")),
                "world_size": info.world_size,
                "pid": os.getpid(),
                "resumed_from": self.resumed_from,
            },
        )
        if info.is_main:  # rank 0's loss at every step, across attempts (append, line-buffered)
            self._step_log = (out / "steps.jsonl").open("a", buffering=1)

    def _progress_bar(self, steps_per_epoch: int) -> Any:
        from tqdm.auto import tqdm

        total = steps_per_epoch * self.cfg.epochs
        if self.cfg.max_steps is not None:
            total = min(total, self.cfg.max_steps)
        # A log file or a notebook gets a line every few seconds, a terminal a live bar.
        interval = 0.5 if sys.stderr.isatty() else 5.0
        return tqdm(total=total, initial=self.step, desc="train", unit="step", mininterval=interval)

    def _end_of_epoch_row(self) -> None:
        self.history.append(
            {
                "epoch": self.epoch,
                "step": self.step,
                "train_loss": self.mean_train_loss(),
                "val_accuracy": self.validate(),
            }
        )

    def _metrics(self, t_start: float, t_end: float, resumed: bool) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        counted = self.step_times[cfg.warmup_steps :] or self.step_times
        mine = {
            "rank": info.rank,
            "pid": os.getpid(),
            "step_times": self.step_times,
            "train_start": t_start,
            "train_end": t_end,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "resumed_from": self.resumed_from,
        }
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, mine)
        # Throughput of the slowest rank sets the pace: every step waits for all ranks.
        slowest = max(sum(g["step_times"][cfg.warmup_steps :] or g["step_times"]) for g in gathered)
        samples = len(counted) * cfg.batch_size * info.world_size
        last = self.history[-1]
        metrics = {
            "world_size": info.world_size,
            "backend": info.backend,
            "device": str(info.device),
            "model": cfg.model,
            "samples_per_sec": samples / slowest if slowest > 0 else math.nan,
            "step_times": {str(g["rank"]): g["step_times"] for g in gathered},
            "train_loss": last["train_loss"],
            "val_accuracy": last["val_accuracy"],
            "epochs": cfg.epochs,
            "steps": self.step,
            "history": self.history,
            "resumed": resumed,
            "ranks": [{k: v for k, v in g.items() if k != "step_times"} for g in gathered],
            "config": asdict(cfg),
        }
        write_rank_record(cfg.out, mine)
        if cfg.out and info.is_main:
            write_json(Path(cfg.out) / "metrics.json", metrics)
        return metrics


def read_step_log(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rank 0's ``{"attempt", "step", "loss"}`` rows from a run's ``steps.jsonl``, in order."""
    path = Path(run_dir) / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
