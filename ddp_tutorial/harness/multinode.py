"""Several torchrun "nodes" of one job on this machine: the multi-node lessons without a cluster.

Each node is the command you would type on one machine of a real cluster:
``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint host:port --rdzv-id JOB …``
(plus ``--node-rank i``, which c10d ignores: lesson 10 shows its warning).
:func:`rendezvous_args` builds those flags (the one place they are written),
:func:`rendezvous_node` describes one such node as a
:class:`~ddp_tutorial.harness.launch.LaunchSpec`, and :func:`multinode` starts all
nodes of a job together through
:func:`~ddp_tutorial.harness.launch.run_together`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_tutorial.devices import visible_gpus
from ddp_tutorial.distributed import free_port
from ddp_tutorial.harness.failures import LaunchError
from ddp_tutorial.harness.gpu_plan import mig_fallback
from ddp_tutorial.harness.launch import (
    LaunchSpec,
    RunResult,
    default_nproc,
    default_run_dir,
    raise_for_failure,
    run_together,
)
from ddp_tutorial.settings import BACKEND_ENV, VISIBLE_DEVICES_ENV


def rendezvous_args(
    nnodes: int | str,
    endpoint: str,
    run_id: str,
    node_rank: int | None = None,
    conf: str = "",
) -> list[str]:
    """torchrun's flags for a c10d rendezvous at ``endpoint`` (``host:port``).

    ``nnodes``: ``2``, or ``"1:2"`` for an elastic job. ``node_rank``: passed as
    ``--node-rank``, which torchrun uses only with ``--rdzv-backend static``; with
    c10d it ignores it (torch 2.14's ``run.py`` warns "node_rank is only used for
    static rdzv_backend. It will be ignored" for any rank but 0), and the
    rendezvous gives each node its ``GROUP_RANK``, whatever number it was given.
    ``conf``: ``--rdzv-conf``, e.g. ``"join_timeout=5"`` (how long to wait for
    missing nodes, 600 s by default) or ``"is_host=1"``.
    """
    args = ["--nnodes", str(nnodes)]
    if node_rank is not None:
        args += ["--node-rank", str(node_rank)]
    args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    if conf:
        args += ["--rdzv-conf", conf]
    return args


def rendezvous_node(
    script: str | os.PathLike[str],
    *args: object,
    nnodes: str = "2",
    rdzv_conf: str = "",
    nproc: int = 1,
    port: int | None = None,
    run_id: str | None = None,
    local_addr: str | None = None,
) -> LaunchSpec:
    """One node's torchrun of a multi-node job whose c10d rendezvous is hosted here.

    Started alone (with :func:`run_together`), it shows what a node sees when
    the others do not come. ``local_addr``: torchrun's ``--local-addr``, the address
    this node advertises (as ``MASTER_ADDR``, when it is the rank-0 node) instead of its
    fully qualified host name.
    """
    port = port or free_port()
    rdzv = rendezvous_args(nnodes, f"127.0.0.1:{port}", run_id or f"job-{port}", conf=rdzv_conf)
    if local_addr:
        rdzv += ["--local-addr", local_addr]
    return LaunchSpec(script, args, nproc=nproc, standalone=False, torchrun_args=rdzv)


def node_gpus(
    nnodes: int, nproc_per_node: int, visible: list[str]
) -> tuple[list[dict[str, str]], str]:
    """Each simulated node's environment, so that nodes on one machine never share a GPU.

    Real nodes have GPUs of their own. Two torchrun "nodes" on one machine see
    the same cards, and both would put their local rank 0 on ``cuda:0``:
    nccl stops with "Duplicate GPU detected". With enough GPUs each node gets
    its own slice of ``visible`` (the GPUs' UUIDs, in CUDA's order) as
    ``CUDA_VISIBLE_DEVICES``; with too few, every node hides them and uses
    gloo on the CPU. Returns ``(one env per node, what was decided, in words)``.
    """
    need = nnodes * nproc_per_node
    if visible and len(visible) >= need:
        slices = [visible[n * nproc_per_node : (n + 1) * nproc_per_node] for n in range(nnodes)]
        return [{VISIBLE_DEVICES_ENV: ",".join(s)} for s in slices], (
            f"{nnodes} nodes x {nproc_per_node} GPU(s): each node gets its own GPUs"
        )
    if visible:
        why = (
            f"{len(visible)} GPU(s) for {nnodes} nodes x {nproc_per_node} ranks: nodes on one "
            f'machine would share a GPU (nccl: "Duplicate GPU detected"), so gloo on the CPU'
        )
        return [{VISIBLE_DEVICES_ENV: "", BACKEND_ENV: "gloo"} for _ in range(nnodes)], why
    return [{} for _ in range(nnodes)], "no GPU: gloo on the CPU"


def node_gpus_here(
    nnodes: int, nproc_per_node: int | None = None, env: Mapping[str, str] | None = None
) -> tuple[list[dict[str, str]], str]:
    """:func:`node_gpus` for this machine's GPUs, as processes started with ``env`` see them."""
    merged = {**os.environ, **(env or {})}
    hide, why = mig_fallback(merged)
    if hide:  # MIG: every node on the CPU, as one launch would be
        return [dict(hide) for _ in range(nnodes)], why
    visible = [gpu.uuid for gpu in visible_gpus(merged)]
    per_node = nproc_per_node if nproc_per_node is not None else default_nproc(merged)
    return node_gpus(nnodes, per_node, visible)


def multinode(
    script: str | os.PathLike[str],
    *args: object,
    nnodes: int = 2,
    nproc_per_node: int | None = None,
    node_env: Sequence[Mapping[str, str]] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    **options: Any,
) -> list[RunResult]:
    """One job on ``nnodes`` "nodes" that all live on this machine; one result per node.

    Node ``i`` writes to ``RUN_DIR/node{i}`` and its echoed lines start with
    ``[node i]``; ``node_env[i]`` adds variables for node ``i`` only (over
    ``env``). Without either setting ``CUDA_VISIBLE_DEVICES``, each node gets
    GPUs of its own where there are enough, else every node runs gloo on the
    CPU (:func:`node_gpus`; it says which). Other ``options`` (``env``,
    ``timeout``, ``run_dir``, ``check``, ``echo``, ``torchrun_args``) are
    :class:`LaunchSpec`'s. With c10d the rendezvous, not ``--node-rank``,
    decides each node's ``GROUP_RANK`` (the ranks' records say which it got).

    If one node fails or times out the others are killed (they would wait
    for it until the rendezvous timeout); with ``check`` the first failure
    is raised, naming the node.
    """
    check = options.pop("check", True)
    specs = node_specs(script, *args, nnodes=nnodes, nproc_per_node=nproc_per_node,
                       node_env=node_env, host=host, port=port, **options)  # fmt: skip
    results = run_together(specs, stop_on_failure=True, share_gpus=False)  # GPUs of its own
    if check:
        # A timed-out node first, then one that says why it failed, then any failed node.
        order = sorted(results, key=lambda n: (not results[n].timed_out, not results[n].failures))
        for node in order:
            try:
                raise_for_failure(Path(script).name, results[node], specs[node].timeout)
            except LaunchError as exc:
                message = f"node {node}: {exc}"
                if results[node].timed_out:
                    message += "\nEvery node was killed."
                raise type(exc)(message, exc.result) from None
    return list(results.values())


def node_specs(
    script: str | os.PathLike[str],
    *args: object,
    nnodes: int = 2,
    nproc_per_node: int | None = None,
    node_env: Sequence[Mapping[str, str]] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    **options: Any,
) -> dict[int, LaunchSpec]:
    """What :func:`multinode` starts, node by node, without starting it (same arguments)."""
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"multinode: nnodes must be a positive integer, got {nnodes!r}")
    if node_env is not None and len(node_env) != nnodes:
        raise ValueError(f"multinode: node_env needs {nnodes} entries, got {len(node_env)}")
    base = Path(options.pop("run_dir", None) or default_run_dir(script))
    env, extra = options.pop("env", None) or {}, list(options.pop("torchrun_args", ()))
    if node_env is None and VISIBLE_DEVICES_ENV not in env:
        node_env, why = node_gpus_here(nnodes, nproc_per_node, env)
        if options.get("echo", True):
            print(f"multinode: {why}", flush=True)
    port = port or free_port(host)
    specs = {}
    for node in range(nnodes):
        # node 0 hosts the rendezvous store; the others connect to it
        rdzv = rendezvous_args(nnodes, f"{host}:{port}", f"{Path(script).stem}-{port}",
                               node_rank=node, conf=f"is_host={1 if node == 0 else 0}")  # fmt: skip
        specs[node] = LaunchSpec(
            script, args, nproc=nproc_per_node, run_dir=base / f"node{node}",
            env={**env, **(node_env[node] if node_env else {})}, standalone=False,
            torchrun_args=[*rdzv, *extra], prefix=f"[node {node}]", **options,
        )  # fmt: skip
    return specs
