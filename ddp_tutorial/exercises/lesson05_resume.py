"""Lesson 05's second exercise: an exact resume (the first: ``lesson05``).

``05_exact_resume`` (a script): the learner's file runs the same job three times in one
process, as three launches would: once straight through, once stopped after an epoch's
snapshot, once more to resume. Each launch writes a report per rank; the judge compares the
resumed job with the run that never stopped: where it started, what it restored, the order of
every epoch (against ``DistributedSampler``'s own, epoch by epoch), the final weights.
Around the file, rank 0's snapshots carry the tag of tensors saved from ``cuda:0``, as a GPU
job's do, and every ``torch.load`` is noted: a load without ``map_location`` fails here as it
would on a rank without that GPU (and is named on a machine that has one).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.core import Context, Exercise, Record

RUNS = ("straight", "job-1", "job-2")  # the three launches the learner's script makes
SAMPLES, SEED = 64, 0  # the stub's --num-samples and --seed
MAP_LOCATION = ("torch.load put the snapshot's tensors on a CUDA device, and this job's "
                "model lives on the CPU (the check's machine has no GPU): without map_location "
                "every tensor goes back where it was saved from - cuda:0, rank 0's GPU - on "
                "every rank, and a map_location naming cuda is a GPU this job does not use: "
                'map_location="cpu" here (in a GPU job, this rank\'s own device, cuda:LOCAL_RANK) '
                '(lesson 05, "6 · `map_location`")')  # fmt: skip


@contextmanager
def saved_from_gpu(ctx: Context) -> Iterator[None]:
    """Rank 0's snapshots say "cuda:0", as a GPU job's do; every torch.load of a file is noted.
    Only files: torch pickles a tensor sent with ``broadcast_object_list`` through torch.save
    and torch.load on a BytesIO, and those stay as they are."""
    loads: list[dict[str, Any]] = []
    real_load, real_save = torch.load, torch.save

    def load(*args: Any, **kwargs: Any) -> Any:
        if not isinstance(args[0] if args else kwargs.get("f"), io.BytesIO):
            where = kwargs.get("map_location", args[1] if len(args) > 1 else None)
            loads.append({"map_location": None if where is None else repr(where),
                          "weights_only": kwargs.get("weights_only")})  # fmt: skip
        return real_load(*args, **kwargs)

    def save(*args: Any, **kwargs: Any) -> Any:
        if isinstance(args[1] if len(args) > 1 else kwargs.get("f"), io.BytesIO):
            return real_save(*args, **kwargs)
        with mock.patch.object(torch.serialization, "location_tag", lambda _: "cuda:0"):
            return real_save(*args, **kwargs)

    try:
        with mock.patch.object(torch, "load", load), mock.patch.object(torch, "save", save):
            yield
    finally:
        ctx.out.mkdir(parents=True, exist_ok=True)
        (ctx.out / f"loads-rank{ctx.rank}.json").write_text(json.dumps(loads))


def run_resume(_: Any, ctx: Context) -> Record:
    """On each rank: its reports of the three launches, and its torch.load calls."""
    reports = {}
    for name in RUNS:
        path = ctx.out / f"report-{name}-rank{ctx.rank}.json"
        reports[name] = json.loads(path.read_text()) if path.is_file() else None
    loads = ctx.out / f"loads-rank{ctx.rank}.json"
    return {"rank": ctx.rank, "reports": reports,
            "loads": json.loads(loads.read_text()) if loads.is_file() else []}  # fmt: skip


def sampler_order(rank: int, world: int, epoch: int) -> list[int]:
    """What DistributedSampler deals ``rank`` in ``epoch`` (the stub's data is its indexes)."""
    sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def _judge_start(rep: list[dict[str, Any]], stop: int) -> str | None:
    """Where the second launch started, and with what it had loaded."""
    starts = [r["job-2"]["start_epoch"] for r in rep]
    if len(set(starts)) > 1:
        return (f"the second launch started at epoch {starts[0]} on rank 0 and {starts[1]} on "
                "rank 1: load the snapshot on every rank")  # fmt: skip
    start = starts[0]
    if start == 0:
        return ("the second launch started over at epoch 0: when snapshot.pt exists, load it "
                "and carry on after the epoch it holds")  # fmt: skip
    if start == stop:
        return (f"epoch {stop} ran twice, before the stop and again after the resume: the "
                f"snapshot holds the epoch it *finished* ({stop}); start at snapshot['epoch'] "
                "+ 1 (lesson 08, \"8 · The official example's three mistakes\": its "
                "EPOCHS_RUN; lesson 05's rung saves the next epoch instead)")  # fmt: skip
    if start != stop + 1:
        return (f"the second launch started at epoch {start}; the snapshot was taken after "
                f"epoch {stop}: start at snapshot['epoch'] + 1 = {stop + 1} (lesson 08, \"8 · "
                "The official example's three mistakes\")")  # fmt: skip
    for rank, r in enumerate(rep):
        if r["job-2"]["optimizer_state"] == 0:
            also = (" (DDP's broadcast copies rank 0's weights, not its optimizer's state)"
                    if rank else "")  # fmt: skip
            return (
                f"rank {rank} resumed with an empty optimizer, no momentum: "
                "optimizer.load_state_dict(snapshot['optimizer']), on every rank" + also
            )
    return None


def _judge_loads(records: list[Record]) -> str | None:
    for r in records:
        if any(call["weights_only"] is False for call in r["loads"]):
            return ("torch.load(..., weights_only=False) runs whatever the file names: load "
                    'with weights_only=True, the default since torch 2.6 (lesson 05, "5 · '
                    '`weights_only=True`")')  # fmt: skip
        if any(call["map_location"] is None for call in r["loads"]):
            return f"rank {r['rank']}: {MAP_LOCATION}"
    return None


def _judge_orders(rep: list[dict[str, Any]]) -> str | None:
    """Every epoch in DistributedSampler's order for that epoch, resumed or not."""
    world, epochs = len(rep), len(rep[0]["straight"]["epochs"])
    for rank, r in enumerate(rep):
        orders = [e["order"] for e in r["straight"]["epochs"]]
        if any(orders[i] == orders[0] for i in range(1, epochs)):
            return (f"rank {rank} saw its samples in the same order in every epoch: "
                    "sampler.set_epoch(epoch) at the start of each epoch")  # fmt: skip
        for e in r["job-2"]["epochs"]:
            want = orders[e["epoch"]]
            if e["order"] != want:
                same = [i for i, o in enumerate(orders) if o == e["order"]]
                was = f" (the order of epoch {same[0]})" if same else ""
                return (f"rank {rank}: after the resume, epoch {e['epoch']} was not shuffled "
                        f"as it is in a run that never stopped{was}: "
                        "sampler.set_epoch(epoch), with the epoch's own number")  # fmt: skip
        for epoch, order in enumerate(orders):
            if order != sampler_order(rank, world, epoch):
                like = [n for n in range(-4, epochs + 8) if sampler_order(rank, world, n) == order]
                as_if = f"set_epoch({like[0]})" if like else "another order"
                return (
                    f"rank {rank}'s epoch {epoch} was shuffled as {as_if} shuffles it: the "
                    "same in every launch, but not the epoch's own order - whatever rebuilds an "
                    "epoch from seed + epoch (lesson 10's resume on another number of ranks) "
                    "gets other samples; sampler.set_epoch(epoch), with the epoch's own number"
                )
    return None


def judge_resume(records: list[Record]) -> str | None:
    missing = [f"{n} (rank {r['rank']})" for r in records for n in RUNS if not r["reports"][n]]
    if missing:
        return f"no report from {missing[0]}: keep the lines that write report-*.json"
    rep = [r["reports"] for r in records]
    stop = rep[0]["job-1"]["epochs"][-1]["epoch"]
    if mistake := _judge_start(rep, stop) or _judge_loads(records):
        return mistake
    straight = rep[0]["straight"]["epochs"]
    if rep[0]["job-2"]["start_weights"] != straight[stop]["weights"]:
        return (
            f"the resumed job did not start from the weights of epoch {stop}: "
            "model.load_state_dict(snapshot['model']) (before DDP wraps the model)"
        )
    if mistake := _judge_orders(rep):
        return mistake
    job2 = rep[0]["job-2"]
    if job2["epochs"] and all(e["weights"] == job2["start_weights"] for e in job2["epochs"]):
        return ("the resumed job never changed its weights: the optimizer steps other "  # h. 161
                "parameters than the model's - a model built again in the resume is not the one "
                "the optimizer was made with: load the weights into the existing model "
                "(model.load_state_dict(snapshot['model']))")  # fmt: skip
    if rep[0]["job-2"]["epochs"][-1]["weights"] != straight[-1]["weights"]:
        return ("the resumed job ended with other weights than the run that never stopped: "
                "restore everything the snapshot holds (weights, optimizer, epoch)")  # fmt: skip
    if any(r.get("left_group_open") for r in records):
        return "the process group was left open: end with dist.destroy_process_group()"
    return None


# cuda:{rank}, torch.device("cuda", rank), .cuda(rank), .to(f"cuda:{rank}"): a CPU run passes
GLOBAL_RANK_AS_GPU = (
    r"cuda:\{\s*(?:rank|dist\.get_rank\(\))\s*\}|"
    r"torch\.device\(\s*[\"']cuda[\"']\s*,\s*(?:rank|dist\.get_rank\(\))\s*\)|"
    r"\.cuda\(\s*(?:rank|dist\.get_rank\(\))\s*\)"
)

EXERCISES = [
    Exercise(
        name="05_exact_resume", lesson="05", kind="script", run=run_resume,
        judge=judge_resume, title="a second launch that carries on exactly where the first stopped",
        teaches='lesson 05, "7 · Resume, exactly"', collective_timeout_s=12.0,
        around=saved_from_gpu,
        errors=(("deserialize object on a CUDA device", MAP_LOCATION),
                (('Unexpected key(s) in state_dict: "model"', "Missing key(s)"),
                 "the whole snapshot went into load_state_dict: it holds the weights under "
                 "\"model\", beside the optimizer's state and the epoch - "
                 "model.load_state_dict(state[\"model\"]) and "
                 "optimizer.load_state_dict(state[\"optimizer\"])")),  # fmt: skip
        when_hung=(
            (r"(?m)^( *)if\b[^\n]*\b(?:rank|get_rank\(\))\s*==\s*0\b[^\n]*:[ \t]*"
             r"(?:[^\n]*torch\.load|\n(?:\1 +[^\n]*\n|[ \t]*\n)*?\1 +[^\n]*torch\.load)",
             "the snapshot was loaded under `if rank == 0`: the other ranks started over at "
             "epoch 0 and waited in a step rank 0 never took - load it on every rank (DDP's "
             "broadcast copies rank 0's weights, not its epoch or its optimizer)"),
        ),
        hidden=(
            (r"stop_after", "start_epoch came from --stop-after-epoch, a flag of this "
             "simulation: a real job is stopped at any epoch, by a signal - start at "
             "snapshot['epoch'] + 1, read from the file"),
            (r"(?m)start_epoch\s*=\s*[1-9]\d*\s*$", "start_epoch was set to a number: the "
             "epoch after the one the snapshot holds is snapshot['epoch'] + 1, whatever epoch "
             "the job stopped at"),
            (GLOBAL_RANK_AS_GPU, "a GPU named by the global rank (rank = dist.get_rank()): "
             "on 2 machines of 4 GPUs rank 5 asks for cuda:5 - a GPU is named by LOCAL_RANK "
             '(lesson 03, "`LOCAL_RANK`, not `RANK`"), or load with map_location="cpu" as the '
             "stub says"),  # helper 169
        ),
        proves=(
            "the second launch started from the first's snapshot, shuffled each epoch as the "
            "DistributedSampler does, and ended with the weights of a run that never stopped"
        ),
    ),
]  # fmt: skip
