"""The key-value store a (re)started job joins through: fresh keys, agreed by every node.

``init_process_group`` meets the other ranks through a store (each rank writes
its address under a key, reads the others'). Since torch 2.5 torchrun hands its
workers the elastic agent's own ``TCPStore`` (``TORCHELASTIC_USE_AGENT_STORE=True``
at ``MASTER_ADDR:MASTER_PORT``), and that store outlives a restart: the keys the
previous attempt's ranks wrote are still there, and a new rank that reads one
connects to a dead process ("Connection refused", pytorch/pytorch#135712).

Prefixing every key with ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart on
one node, not across nodes: each node's agent counts its *own* restarts, and a
node restarted only because another node failed does not count it
(torch/distributed/elastic/agent/server/api.py, ``_invoke_run``: "membership
changes do not count as retries"). After one failure node A's ranks then look
under ``attempt_1`` and node B's under ``attempt_0``, and ``init_process_group``
waits out its whole timeout, at every restart.

:func:`job_store` makes the prefix a number every rank *agrees* on: global rank 0
takes the next value of a counter in the store, and hands it to every other rank
under a key named by a random token that rank has just made up — a key no earlier
attempt can have written. (When the agent's store is off,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, global rank 0 hosts a new store on a
new port at every restart, as torch's ``env://`` does; the same exchange then runs
on keys that are fresh anyway.) Every old worker is gone before a new one starts:
torchrun stops its workers before it joins the next rendezvous round, and the
round completes only when every node has joined.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from ddp_tutorial import settings
from ddp_tutorial.settings import env_int

ROOT = "ddp_tutorial"


def job_store(rank: int, world_size: int, timeout_s: float | None = None) -> tuple[dist.Store, int]:
    """``(store, attempt)``: this (re)start's own key space, and its number, the same on every rank.

    Call it on every rank before ``init_process_group(store=...)`` (a rank that
    never calls it leaves rank 0 waiting up to ``timeout_s``). ``attempt`` is 0
    for the first start and grows with every restart of the *job* (not of one
    node's agent), so records and fault injection can rely on it.
    """
    timeout_s = settings.init_timeout_s() if timeout_s is None else timeout_s
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not shared,  # shared: the agent hosts it
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=not shared,
    )
    if rank == 0:
        # Shared: a counter that only grows (never a number an earlier attempt used). Not
        # shared: a new store, so any number is fresh; torchrun's restart count reads best.
        counted = store.add(f"{ROOT}/attempts", 1) - 1
        attempt = counted if shared else env_int("TORCHELASTIC_RESTART_COUNT", 0)
        _answer_every_rank(store, world_size, attempt, timeout_s)
    else:
        token = uuid.uuid4().hex  # no earlier attempt can have written a key with this name
        store.set(f"{ROOT}/hello/{rank}", token)
        attempt = int(store.get(f"{ROOT}/answer/{token}"))
        store.set(f"{ROOT}/{attempt}/joined/{rank}", "1")
    return dist.PrefixStore(f"{ROOT}/{attempt}", store), attempt


def _answer_every_rank(store: dist.Store, world_size: int, attempt: int, timeout_s: float) -> None:
    """Rank 0's side of :func:`job_store`: answer each rank's token until all have joined.

    A ``hello`` key may still hold the previous attempt's token (its rank has
    not written yet): answering it too is harmless, nobody waits on that name.
    """
    pending, answered = set(range(1, world_size)), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            if store.check([f"{ROOT}/{attempt}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"{ROOT}/hello/{r}"]):
                token = store.get(f"{ROOT}/hello/{r}").decode()
                if answered.get(r) != token:
                    store.set(f"{ROOT}/answer/{token}", str(attempt))
                    answered[r] = token
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(pending)[:8]} did not reach the job's store within "
                f"{timeout_s:g} s (attempt {attempt}); did they start?"
            )
        if pending:
            time.sleep(0.005)


def exchange(store: dist.Store, rank: int, world_size: int, value: str) -> list[str]:
    """Every rank's ``value``, in rank order, through a key-value store (before init)."""
    store.set(f"{ROOT}/backend/{rank}", value)
    return [store.get(f"{ROOT}/backend/{r}").decode() for r in range(world_size)]
