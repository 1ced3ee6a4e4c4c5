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

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
# Its keys live under ROOT.
job_store = kit.job_store

ROOT = kit.STORE_ROOT


def exchange(store: object, rank: int, world_size: int, value: str) -> list[str]:
    """Every rank's ``value``, in rank order, through a key-value store (before init)."""
    store.set(f"{ROOT}/backend/{rank}", value)  # type: ignore[attr-defined]
    return [store.get(f"{ROOT}/backend/{r}").decode() for r in range(world_size)]  # type: ignore[attr-defined]
