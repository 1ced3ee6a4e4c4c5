"""Helpers of lesson 10 (multi-node): a SLURM job script checked without a cluster, the
node x local-rank picture, and the Kubeflow operators' pod environments emulated on one machine."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def render_sbatch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    nodes: Sequence[str] = ("node01", "node02"),
    slurm_env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """The command a SLURM job script would run, without a cluster: a dry run.

    Debugging a job script in the queue costs an allocation per attempt.
    This runs it with ``bash`` under a fake SLURM environment — the variables
    ``sbatch`` sets (``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_JOB_ID``,
    …, overridable with ``slurm_env``), a stand-in ``scontrol`` that lists
    ``nodes``, and ``DRY_RUN=1``, which the course's job script honours by
    printing its command (after the variables it exports) instead of running
    it. Returns the words, e.g. ``["OMP_NUM_THREADS=8", "srun", …, "torchrun", …]``.
    """
    if not nodes:
        raise ValueError("render_sbatch: need at least one node name")
    with tempfile.TemporaryDirectory(prefix="fake-slurm-") as tmp:
        scontrol = Path(tmp) / "scontrol"
        listing = " ".join(shlex.quote(n) for n in nodes)
        scontrol.write_text(
            f"#!/bin/sh\n# fake: `scontrol show hostnames`\nprintf '%s\\n' {listing}\n"
        )
        scontrol.chmod(0o755)
        env = {
            **os.environ,
            "PATH": f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"{nodes[0]},{nodes[-1]}" if len(nodes) > 1 else nodes[0],
            "SLURM_NNODES": str(len(nodes)),
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_CPUS_PER_TASK": "64",
            **(slurm_env or {}),
            "DRY_RUN": "1",
        }
        if "OMP_NUM_THREADS" not in (slurm_env or {}):
            env.pop("OMP_NUM_THREADS", None)  # let the script compute it, as on a fresh node
        done = subprocess.run(
            ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {done.returncode}): {done.stderr.strip()}")
    return shlex.split(done.stdout)


def rank_grid_figure(records: Sequence[Mapping[str, Any]]) -> Any:
    """Nodes (rows) x local ranks (columns), each cell labelled with the process's RANK.

    Drawn from the ranks' own records (``group_rank``, ``local_rank``, ``rank``):
    the picture of ``RANK = GROUP_RANK x nproc_per_node + LOCAL_RANK``. Each cell's
    text is ``"RANK r"`` at ``(local_rank, group_rank)``, so a notebook can check
    the labels against the records. matplotlib is imported here: ranks never draw.
    """
    from matplotlib.patches import Rectangle

    from ddp_tutorial.harness.plots import new_figure

    nodes = 1 + max(int(r["group_rank"]) for r in records)
    per_node = 1 + max(int(r["local_rank"]) for r in records)
    fig = new_figure(figsize=(1.6 + 1.5 * per_node, 0.5 + 0.75 * nodes))
    ax = fig.subplots()
    for r in records:
        x, y = int(r["local_rank"]), int(r["group_rank"])
        ax.add_patch(Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, facecolor=f"C{y % 10}", alpha=0.25,
                               edgecolor=f"C{y % 10}"))  # fmt: skip
        ax.text(x, y, f"RANK {r['rank']}", ha="center", va="center", fontsize=10)
    ax.set_xlim(-0.55, per_node - 0.45)
    ax.set_ylim(nodes - 0.5, -0.5)  # node 0 on top
    ax.set_xticks(range(per_node), [f"LOCAL_RANK {i}" for i in range(per_node)], fontsize=8)
    ax.set_yticks(range(nodes), [f"node {n}: GROUP_RANK {n}" for n in range(nodes)], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    world = len(records)
    ax.set_title(f"RANK = GROUP_RANK × {per_node} + LOCAL_RANK   (WORLD_SIZE {world})", fontsize=9)
    fig.tight_layout()
    return fig


def grid_labels(fig: Any) -> dict[tuple[int, int], str]:
    """``{(group_rank, local_rank): "RANK r"}`` as drawn by :func:`rank_grid_figure`."""
    ax = fig.axes[0]
    return {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
            for t in ax.texts}  # fmt: skip


# --- Kubernetes: what the Kubeflow operators put in each pod ------------------------------
# Read from the operators' sources (see scripts/k8s/*.yaml): kubeflow/training-operator
# pkg/controller.v1/pytorch/{envvar,master,elastic}.go for the PyTorchJob (kubeflow.org/v1),
# kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go and pkg/constants for the
# TrainJob (trainer.kubeflow.org/v1alpha1). tests/test_k8s.py holds the manifests to these.

JOB_NAME = "ddp-train"
"""``metadata.name`` of both manifests: the operators name pods and addresses after it."""
POD_COMMAND = ("torchrun", "scripts/train.py")
"""The container's command in both manifests: a bare torchrun, every flag from PET_*."""
PODS = 2
"""Pods (one per machine, "nodes") in both manifests."""
NPROC_PER_POD = 2
"""Processes per pod (one per GPU of the pod) in both manifests."""
PYTORCHJOB_PORT = 23456
"""The PyTorchJob's ``pytorchjob-port`` (the training-operator's default)."""
TRAINJOB_PORT = 29500
"""The port the trainer's torch plugin gives every TrainJob (``ContainerTrainerPort``)."""

PYTORCHJOB_ENV = ("MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE",
                  "RANK", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_NNODES")  # fmt: skip
"""What the training-operator sets in every pod of a Master + Worker PyTorchJob."""
PYTORCHJOB_ELASTIC_ENV = ("PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_NNODES",
                          "PET_MAX_RESTARTS")  # fmt: skip
"""What it sets instead with an ``elasticPolicy`` (Worker pods only; also PET_RDZV_ID,
PET_RDZV_CONF when given)."""
TRAINJOB_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                "PET_MASTER_PORT")  # fmt: skip
"""What the trainer's torch plugin sets in every node of a TrainJob (no RANK, no WORLD_SIZE)."""

# What a launcher or an operator sets: a pod starts without any of them but the operator's.
_IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def pytorchjob_env(
    pod: int,
    pods: int = PODS,
    nproc: int = NPROC_PER_POD,
    host: str | None = None,
    port: int = PYTORCHJOB_PORT,
    job: str = JOB_NAME,
) -> dict[str, str]:
    """The variables the training-operator gives pod ``pod`` of a Master + Worker PyTorchJob.

    Pod 0 is ``Master-0``, pod ``i`` is ``Worker-(i-1)``. ``RANK`` is the *pod's*
    index and ``WORLD_SIZE`` is pods x ``nprocPerNode``: a node rank next to a
    process count, consistent only with one process per pod. ``host``: the
    master's address (the operator uses the Service ``<job>-master-0``).
    """
    master = host or f"{job}-master-0"
    return {
        "MASTER_ADDR": master, "MASTER_PORT": str(port),
        "PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(pods * nproc), "RANK": str(pod),
        "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(pod), "PET_NNODES": str(pods),
    }  # fmt: skip


def pytorchjob_elastic_env(
    min_pods: int, max_pods: int, max_restarts: int, host: str | None = None,
    port: int = PYTORCHJOB_PORT, job: str = JOB_NAME,
) -> dict[str, str]:  # fmt: skip
    """With an ``elasticPolicy`` (Worker pods only): a c10d rendezvous at worker 0, no ranks."""
    return {
        "PET_RDZV_ENDPOINT": f"{host or f'{job}-worker-0'}:{port}", "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": f"{min_pods}:{max_pods}", "PET_MAX_RESTARTS": str(max_restarts),
    }  # fmt: skip


def trainjob_env(
    pod: int,
    pods: int = PODS,
    nproc: int = NPROC_PER_POD,
    host: str | None = None,
    port: int = TRAINJOB_PORT,
    job: str = JOB_NAME,
) -> dict[str, str]:
    """The variables the trainer's torch plugin gives node ``pod`` of a TrainJob.

    ``PET_NODE_RANK`` is the pod's Job completion index; the master is node 0
    (``<job>-node-0-0.<job>``, its headless Service). Only torchrun's flags: no
    ``RANK`` or ``WORLD_SIZE`` that a script could misread.
    """
    return {
        "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(pod),
        "PET_MASTER_ADDR": host or f"{job}-node-0-0.{job}", "PET_MASTER_PORT": str(port),
    }  # fmt: skip


def torchrun_reads(env: Mapping[str, str]) -> dict[str, Any]:
    """``{"--flag": value}``: what torchrun's own parser takes from the ``PET_*`` variables.

    torchrun declares each option with an action that defaults it to
    ``$PET_<DEST>`` (``torch/distributed/argparse_util.py``), so a bare
    ``torchrun script.py`` under these variables parses as if the flags were
    typed. Raises ``KeyError`` for a ``PET_`` name that is no torchrun option.
    """
    from unittest import mock

    from torch.distributed.run import get_args_parser

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        args = vars(get_args_parser().parse_args(["script.py"]))  # reads $PET_* when built
    read = {}
    for name in env:
        if name.startswith("PET_"):
            dest = name.removeprefix("PET_").lower()
            if dest not in args:
                raise KeyError(f"{name}: torchrun has no option --{dest.replace('_', '-')}")
            read[f"--{dest.replace('_', '-')}"] = args[dest]
    return read


def pod_environment(operator_env: Mapping[str, str]) -> dict[str, str]:
    """This machine's environment as a fresh pod would have it, plus the operator's variables.

    Drops every identity a launcher or an operator sets (``RANK``, ``MASTER_ADDR``,
    ``PET_*``, ``TORCHELASTIC_*``, …) so the operator's are the only ones.
    """
    clean = {k: v for k, v in os.environ.items()
             if k not in _IDENTITY and not k.startswith(("PET_", "TORCHELASTIC_"))}  # fmt: skip
    return {**clean, **operator_env}


def run_pods(
    pods: Mapping[str, tuple[Sequence[str], Mapping[str, str]]], timeout: float = 60.0
) -> dict[str, Any]:
    """Start every pod's ``(command, operator env)`` at once; ``{name: CommandResult}``.

    Each pod is a plain process (a pod's container), with
    :func:`pod_environment` of its operator's variables; each is killed with its
    children after ``timeout``. The pods run side by side: the nodes of one job
    must, and unrelated ones cost little more than the slowest.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ddp_tutorial.harness.processes import run_command

    with ThreadPoolExecutor(max_workers=max(1, len(pods))) as pool:
        futures = {name: pool.submit(run_command, list(cmd), "", timeout, pod_environment(env))
                   for name, (cmd, env) in pods.items()}  # fmt: skip
        return {name: future.result() for name, future in futures.items()}


def read_pod_records(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``pid*.json`` records ``scripts/demos/pod_env.py`` wrote under ``folder``."""
    import json

    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("pid*.json"))]
