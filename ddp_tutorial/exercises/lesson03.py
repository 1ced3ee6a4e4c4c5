"""Lesson 03's exercise: which GPU is this rank's, by its logical and its physical id.

``03_rank_gpu``: given the environment a rank sees (``RANK``, ``LOCAL_RANK``, maybe
``CUDA_VISIBLE_DEVICES``), return the torch device the rank must use and the physical GPU
(``nvidia-smi``'s number) behind it. ``run`` calls the learner's function with the
environments of ranks on one- and two-node GPU jobs (and with the rank's own, torchrun's,
where it sets no ``CUDA_VISIBLE_DEVICES``); ``judge`` names the first wrong pick.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from ddp_tutorial.exercises.core import Context, Exercise, Record
from ddp_tutorial.exercises.spies import spying
from ddp_tutorial.settings import VISIBLE_DEVICES_ENV as CVD

# (where, the environment a rank sees, as torchrun sets it: GROUP_RANK too, 0 on one node);
# nodes have 4 GPUs unless CUDA_VISIBLE_DEVICES says. The last: nodes that run different
# numbers of ranks (torchrun allows it), where RANK % LOCAL_WORLD_SIZE is not the local rank.
SCENARIOS: tuple[tuple[str, dict[str, str]], ...] = (
    ("one node, rank 2", {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4",
                          "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}),
    ("node 1 of 2, rank 3", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}),
    ("one node, CUDA_VISIBLE_DEVICES=5,6,7, rank 1",
     {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0",
      CVD: "5,6,7"}),
    ("node 1 of 2, CUDA_VISIBLE_DEVICES=6,7, rank 3",
     {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "1", CVD: "6,7"}),
    ("one node, CUDA_VISIBLE_DEVICES=7,5, rank 0",
     {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
      CVD: "7,5"}),
    ("one node, CUDA_VISIBLE_DEVICES=7,5, rank 1",  # not the first listed + LOCAL_RANK (8)
     {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
      CVD: "7,5"}),
    ("one node, CUDA_VISIBLE_DEVICES=' 2, 3', rank 1",
     {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
      CVD: " 2, 3"}),
    ("node 1 of 2 (3 ranks on node 0, 2 here), rank 3",
     {"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "1"}),
    ("node 1 of 2, CUDA_VISIBLE_DEVICES=12,13,14,15 (2 ranks a node), rank 3",
     {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "1", CVD: "12,13,14,15"}),
)  # fmt: skip
OWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")  # torchrun's, in this launch


def _expected(env: dict[str, str]) -> tuple[int, int]:
    """(logical index, physical id): cuda:LOCAL_RANK, and the LOCAL_RANK-th card listed."""
    local = int(env["LOCAL_RANK"])
    listed = env.get(CVD)
    return local, local if listed is None else int(listed.split(",")[local])


def _answer(got: Any) -> dict[str, Any]:
    if not (isinstance(got, tuple | list) and len(got) == 2):
        return {"bad": repr(got)}
    device, physical = got
    if not isinstance(device, torch.device):
        return {"bad": f"a device {device!r} that is not a torch.device"}
    if not isinstance(physical, int):
        return {"bad": f"a physical id {physical!r} ({type(physical).__name__}), not an int"}
    return {"type": device.type, "index": device.index, "physical": physical}


# What a rank_gpu may not call (the stub's rule): on a machine without the job's GPUs, as here,
# each answers about this machine, not the node the rank runs on; several initialise CUDA.
CUDA_CALLS = ("device_count", "is_available", "current_device", "set_device", "device",
              "get_device_name", "get_device_properties", "mem_get_info", "init")  # fmt: skip


class _Noted(MutableMapping[str, str]):
    """``os.environ``, each read of a launch variable noted: the answer must come from the
    ``env`` it is given (the check's own launch hides its GPUs: CUDA_VISIBLE_DEVICES="")."""

    def __init__(self, real: MutableMapping[str, str], read: set[str]) -> None:
        self._real, self._read = real, read

    def __getitem__(self, key: str) -> str:
        if key in (*OWN, "GROUP_RANK", CVD):
            self._read.add(key)
        return self._real[key]

    def __setitem__(self, key: str, value: str) -> None:
        self._real[key] = value

    def __delitem__(self, key: str) -> None:
        del self._real[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


def _ask(module: ModuleType, where: str, env: dict[str, str], sees: dict[str, str]) -> Record:
    """One scenario's answer; an exception is recorded, so that the judge can name an earlier
    scenario's mistake first (a global-RANK index can overrun a later list)."""
    read: set[str] = set()
    asked: Record = {"where": where, "env": env}
    try:
        with mock.patch.object(os, "environ", _Noted(os.environ, read)):
            asked.update(_answer(module.rank_gpu(sees)))
    except Exception as exc:  # the learner's code may raise anything
        asked["raised"] = f"{type(exc).__name__}: {exc}"
    return {**asked, "os_environ": sorted(read)}


def run_gpu(module: ModuleType, ctx: Context) -> Record:
    called: list[str] = []
    with spying(CUDA_CALLS, lambda name, *_: called.append(name), module, source=torch.cuda):
        answers = [_ask(module, where, env, dict(env)) for where, env in SCENARIOS]
    # this rank's own environment, from torchrun, as on a node that sets no
    # CUDA_VISIBLE_DEVICES (the check hides the GPUs: nothing here may touch them)
    own = {k: os.environ[k] for k in OWN}
    sees = {k: v for k, v in os.environ.items() if k != CVD}
    with spying(CUDA_CALLS, lambda name, *_: called.append(name), module, source=torch.cuda):
        answers.append(_ask(module, f"this launch, rank {ctx.rank}", own, sees))
    return {"answers": answers, "cuda_calls": sorted(set(called))}


def _judge_physical(where: str, got: int, env: dict[str, str], physical: int) -> str:
    """A physical id other than the card listed at position LOCAL_RANK: which one it was."""
    listed = env.get(CVD)
    local, global_ = int(env["LOCAL_RANK"]), int(env["RANK"])
    if listed is not None and got == local:
        return (
            f"{where}: you said physical GPU {local}, the LOCAL_RANK; with "
            f"CUDA_VISIBLE_DEVICES={listed.strip()!r} cuda:{local} is the card listed "
            f"at position {local}: physical GPU {physical} "
            '(lesson 03, "Physical ids and logical ids")'
        )
    ids = [int(i) for i in listed.split(",")] if listed is not None else []
    if global_ < len(ids) and global_ != local and got == ids[global_]:
        return (f"{where}: you said physical GPU {ids[global_]}, the card at position "
                f"RANK ({global_}) of the list; the list is per node: the card at "
                f"position LOCAL_RANK ({local}), {physical} "
                '(lesson 03, "Physical ids and logical ids")')  # fmt: skip
    if ids and local and got == ids[0] + local:  # helper 142: "7,5" is not 7, 8
        return (f"{where}: you said physical GPU {got}, the first listed id plus LOCAL_RANK; "
                f"the list need not be consecutive (CUDA_VISIBLE_DEVICES={listed.strip()!r}): "
                f"take the entry at position LOCAL_RANK ({local}), {physical} "
                '(lesson 03, "Physical ids and logical ids")')  # fmt: skip
    if got == global_ != local:
        which = ("it is the card listed at position LOCAL_RANK" if listed is not None else
                 "without CUDA_VISIBLE_DEVICES, cuda:i is physical GPU i, so it is "
                 "LOCAL_RANK")  # fmt: skip
        return (f"{where}: you said physical GPU {global_}, the global RANK; {which}: "
                f"{physical} "
                '(lesson 03, "Physical ids and logical ids")')  # fmt: skip
    return (f"{where}: you said physical GPU {got}, expected {physical} "
            '(lesson 03, "Physical ids and logical ids")')  # fmt: skip


def _indexes(rec: Record) -> dict[str, Any]:
    """The device index this rank's answer gave in each environment (answers that raised or
    were malformed left out)."""
    return {a["where"]: a["index"] for a in rec["answers"] if "index" in a}


def _reads_own_rank(records: list[Record], where: str) -> bool:
    """Whether every launched rank answered ``where`` with its own number: it read the launch's
    LOCAL_RANK from os.environ, not from the environment it was given."""
    return all(_indexes(rec).get(where) == rank for rank, rec in enumerate(records))


def _constant(records: list[Record]) -> int | None:
    """The one device index every rank gave in every environment, if so (a hard-coded cuda:0)."""
    seen = {i for rec in records for i in _indexes(rec).values()}
    return seen.pop() if len(seen) == 1 else None


def _judge_cuda_calls(records: list[Record]) -> str | None:
    if called := sorted({c for rec in records for c in rec.get("cuda_calls", ())}):
        return (f"rank_gpu called torch.cuda.{called[0]}(): the device comes from the "
                "environment alone (the stub's rule: no torch.cuda call) - a rank's torch.cuda "
                "answers about the machine it runs on (here: none of the job's GPUs), and "
                "several calls initialise CUDA there "
                '(lesson 03, "When the variable takes effect: before CUDA initialises, '
                'never after")')  # fmt: skip
    return None


def _judge_os_environ(records: list[Record]) -> str | None:
    """A launch variable read from os.environ: right only where the check asks about the
    launch it runs in, and there its CUDA_VISIBLE_DEVICES is "" (the GPUs hidden)."""
    for rec in records:
        for a in rec["answers"]:
            if a["os_environ"]:
                return (f"{a['where']}: rank_gpu read {a['os_environ'][0]} from os.environ, "
                        "this process's own (the check's launch hides its GPUs), not the "
                        "environment it was asked about: read the variables from `env`, the "
                        "environment passed in, not os.environ")  # fmt: skip
    return None


def _why_raised(raised: str, env: dict[str, str]) -> str:
    """An IndexError into CUDA_VISIBLE_DEVICES: indexed by RANK past the node's list, or the
    list split on something other than its commas; int() of one character of the string."""
    if CVD in env and raised.startswith("ValueError") and "invalid literal for int()" in raised:
        return (
            f" - {env[CVD]!r} is a string: indexing it gives one character (a digit, a "
            'comma); split(",") it into the list first, then index that with LOCAL_RANK'
        )
    if not raised.startswith("IndexError") or CVD not in env:
        return ""
    if int(env["RANK"]) >= len(env[CVD].split(",")):
        return " - the list is per node: index it with LOCAL_RANK"
    return (f" - the list {env[CVD]!r} holds one entry per comma: split(\",\") (then int() of "
            "each, which ignores spaces), and index it with LOCAL_RANK")  # fmt: skip


def _wrong_index(records: list[Record], rank: int, a: Record, index: int, physical: int) -> str:
    """What a device index other than cuda:LOCAL_RANK came from, in the lesson's words."""
    where, env = a["where"], a["env"]
    listed = env.get(CVD)
    local, global_ = int(env["LOCAL_RANK"]), int(env["RANK"])
    if a["index"] is None:  # helper 142: torch.device("cuda"), no index
        return (f"{where}: torch.device('cuda') has no index - it means the current "
                "device, cuda:0 on every rank that never set one: every rank on "
                f"one GPU. Name this rank's: torch.device('cuda', {index}), "
                "LOCAL_RANK's (lesson 03, \"`LOCAL_RANK`, not `RANK`\")")  # fmt: skip
    if a["index"] == global_ and global_ != local:
        return (
            f"{where}: you picked cuda:{global_}, the global RANK; GPUs are numbered "
            f"per node, and this rank is LOCAL_RANK {local} there: use "
            f"cuda:LOCAL_RANK (on the second node cuda:RANK names a GPU that does "
            "not exist) "
            '(lesson 03, "`LOCAL_RANK`, not `RANK`")'
        )
    if listed is not None and a["index"] == physical:
        return (
            f"{where}: you picked cuda:{physical}, the physical id; inside the "
            f"process CUDA renumbers the listed cards from 0 in the order written, so "
            f"card {physical} is cuda:{index}: the device is cuda:LOCAL_RANK "
            '(lesson 03, "Physical ids and logical ids")'
        )
    if a["index"] == global_ % int(env["LOCAL_WORLD_SIZE"]):
        return (
            f"{where}: you picked cuda:{a['index']}, the local rank worked out "
            "from RANK (RANK % LOCAL_WORLD_SIZE, or RANK - GROUP_RANK x "
            "LOCAL_WORLD_SIZE): that holds only when every node runs as many ranks "
            "- read LOCAL_RANK, which torchrun sets on every node "
            '(lesson 03, "`LOCAL_RANK`, not `RANK`")'
        )
    if _reads_own_rank(records, where):  # os.environ is judged before: dist.get_rank()?
        return (
            f"{where}: you picked cuda:{rank}, the rank of the check's own process, whatever "
            "`env` says - dist.get_rank() (seed 000's line) is the global rank of the group "
            "this process is in, not the LOCAL_RANK of the environment asked about: read the "
            'variables from `env` (lesson 03, "`LOCAL_RANK`, not `RANK`")'
        )
    if _constant(records) is not None:
        return (
            f"{where}: you picked cuda:{a['index']} for every rank in every "
            f"environment, expected cuda:{index}: a rank's device is cuda:LOCAL_RANK, "
            "read from `env` "
            '(lesson 03, "`LOCAL_RANK`, not `RANK`")'
        )
    return f"{where}: you picked cuda:{a['index']}, expected cuda:{index}"


def judge_gpu(records: list[Record]) -> str | None:
    if mistake := _judge_cuda_calls(records) or _judge_os_environ(records):
        return mistake
    for rank, rec in enumerate(records):
        for a in rec["answers"]:
            where, env = a["where"], a["env"]
            index, physical = _expected(env)
            if "raised" in a:
                return (f"{where}: rank_gpu raised {a['raised']} (expected cuda:{index} and "
                        f"physical GPU {physical}){_why_raised(a['raised'], env)}")  # fmt: skip
            if "bad" in a:
                return (f"{where}: rank_gpu returned {a['bad']}, expected (cuda:{index}, "
                        f"{physical}): a (torch.device, int) pair")  # fmt: skip
            if a["type"] != "cuda":
                return (f"{where}: the device is {a['type']!r}; a rank of a GPU job uses "
                        f"torch.device('cuda', {index})")  # fmt: skip
            if a["index"] != index:
                return _wrong_index(records, rank, a, index, physical)
            if a["physical"] != physical:
                return _judge_physical(where, a["physical"], env, physical)
    return None


EXERCISES = [
    Exercise(
        name="03_rank_gpu", lesson="03", run=run_gpu, judge=judge_gpu,
        title="this rank's device, and the physical GPU behind it",
        teaches='lesson 03, "`LOCAL_RANK`, not `RANK`" and "Physical ids and logical ids"',
        proves=(
            f"the device and the physical GPU, right in all {len(SCENARIOS)} environments: one "
            "node and two, "
            "CUDA_VISIBLE_DEVICES lists, nodes of different sizes"
        ),
    ),
]  # fmt: skip
