"""Lessons 03-04: what runs outside the notebooks, and the GPU paths.

DDP's anatomy (broadcast at construction, averaged gradients, buckets,
no_sync, unused parameters, BatchNorm) is asserted on a real 2-rank launch
of scripts/demos/ddp_anatomy.py by notebooks/04_ddp_wrapping.ipynb, and the
two-node LOCAL_RANK table by notebooks/03_device_mapping.ipynb; here are the
launcher's multi-node failure handling and the pure pieces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import DEMOS, gpu_count, processes_running
from ddp_tutorial.harness.failures import LaunchError
from ddp_tutorial.harness.launch import shell_command, torchrun
from ddp_tutorial.harness.multinode import multinode
from ddp_tutorial.lessons.anatomy import (
    shard,
    step_order,
    train_single,
    tutorial_series_run,
)
from ddp_tutorial.records import read_rank_records

STEPS, BATCH, LR, SEED = 5, 32, 0.1, 100


def vec(values: list[float]) -> torch.Tensor:
    return torch.tensor(values)


# -- pure pieces -------------------------------------------------------------------


def test_the_anchor_bug_run_refuses_an_unknown_loss():
    """(Lessons 04 and 08 assert what cross_entropy and mse do.)"""
    with pytest.raises(ValueError, match="loss must be one of"):
        tutorial_series_run("nll")


def test_shard_refuses_uneven_batches():
    assert shard(torch.arange(6), 1, 2).tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="does not split into 4 equal shards"):
        shard(torch.arange(6), 0, 4)


def fenced_python(notebook: str) -> list[str]:
    """The ```python blocks of a notebook's markdown cells: what a reader sees unexecuted."""
    import re

    from conftest import REPO

    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.findall(r"```python\n(.*?)\n```", text, re.S)


def test_lesson_04_shows_the_lines_its_script_runs_as_they_stand_in_the_file():
    """Lesson 04 prints the taught functions of ddp_anatomy.py in its markdown (readable
    without running); the notebook asserts they are the lines the ranks ran, this test that
    the markdown still holds the file's text."""
    from conftest import load_script
    from ddp_tutorial.lessons.speed import source_of

    shown = fenced_python("04_ddp_wrapping.ipynb")
    taught = [fn.__name__ for fn in load_script("demos/ddp_anatomy.py").TAUGHT]
    assert taught == ["wrap_model", "accumulate", "average_buffers", "global_token_loss"]
    for name in taught:
        assert source_of(DEMOS / "ddp_anatomy.py", name) in shown, (
            f"lesson 04's markdown no longer shows ddp_anatomy.py's {name} as it stands: "
            "copy the function's lines into its ```python block"
        )


def timeline(sent: list[float], grads: list[float], done: float = 9.0) -> dict:
    """A recorded step (StepTimeline.record()) with one parameter per bucket."""
    names = [f"p{i}" for i in range(len(grads))]
    buckets = [{"index": i, "numel": 1, "sent": t, "done": done, "params": [names[i]]}
               for i, t in enumerate(sent)]  # fmt: skip
    marks = {"forward": 0.0, "backward": 1.0, "optimizer.step": 10.0, "done": 11.0}
    grad_times = [[n, t] for n, t in zip(names, grads, strict=True)]
    return {"marks": marks, "grads": grad_times, "buckets": buckets}


def test_step_order_reads_the_order_of_events():
    overlapped = step_order(timeline(sent=[2.5, 4.5], grads=[2.0, 4.0]))
    assert overlapped["buckets"] == 2 and overlapped["first_sent_before_last_grad"]
    assert overlapped["all_done_before_backward_returned"] and overlapped["params_once"]
    waited = step_order(timeline(sent=[4.5], grads=[2.0]))
    assert not waited["first_sent_before_last_grad"]
    late = step_order(timeline(sent=[2.5, 4.5], grads=[2.0, 4.0], done=10.5))
    assert not late["all_done_before_backward_returned"]
    with pytest.raises(ValueError, match="no gradient or no bucket"):
        step_order(timeline(sent=[], grads=[]))


# -- launching several torchruns at once -----------------------------------------


FAILS_ON_NODE_1 = """
import os, time
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    if os.environ["GROUP_RANK"] == "1":
        raise ValueError("deliberate failure on node 1")
    time.sleep(3600)  # node 0 would wait for ever

if __name__ == "__main__":
    main()
"""


@pytest.mark.torchrun
def test_multinode_failure_names_node_and_kills_the_rest(tmp_path, write_script):
    script = write_script("fails_node1.py", FAILS_ON_NODE_1)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="deliberate failure on node 1") as info:
        multinode(script, nnodes=2, nproc_per_node=1, run_dir=tmp_path / "r", echo=False,
                  timeout=90, torchrun_args=["--max-restarts", "0"])  # fmt: skip
    assert time.monotonic() - t0 < 80, "a failed node must not leave the other waiting"
    assert str(info.value).startswith("node ")
    deadline = time.monotonic() + 10  # killed: gone as soon as the kernel has reaped them
    while processes_running(str(script)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_running(str(script)) == []


@pytest.mark.parametrize("value", ["0, 1, 2", "0,-1,1", "0,0", "1gpu", "GPU-ab,0", ""])
def test_torch_reading_is_torchs_parser_and_restores_the_environment(value, monkeypatch):
    from ddp_tutorial.lessons.device_mapping import torch_reading

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    reading = torch_reading(value)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"  # set for the one call only
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert reading == [str(x) for x in torch.cuda._parse_visible_devices()]
    assert not torch.cuda.is_initialized()


def test_multinode_bad_input():
    with pytest.raises(ValueError, match="nnodes must be a positive integer"):
        multinode(DEMOS / "hello.py", nnodes=0)
    with pytest.raises(ValueError, match="node_env needs 2 entries"):
        multinode(DEMOS / "hello.py", nnodes=2, node_env=[{}])


def test_shell_command_is_what_a_user_types():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--log-dir", "runs/x/logs", "--tee", "3",
           "s.py", "--lr", "1", "--out", "runs/x"]  # fmt: skip
    assert shell_command(cmd) == "torchrun --nproc-per-node 2 s.py --lr 1"


# -- GPU paths (make gpu-check) ----------------------------------------------------


def check_syncbn(records: list[dict]) -> None:
    """What a bare SyncBatchNorm does on these ranks (``syncbn_collectives`` in ddp_anatomy.py).

    On 2+ ranks its forward all-gathers (batch sizes differ), its backward
    all-reduces. On one rank torch skips the sync (``need_sync = world_size > 1``)
    and runs plain batch_norm: no collective at all. Either way the running mean
    is the mean over every rank's rows.
    """
    for rec in records:
        c = rec["batchnorm"]["syncbn_collectives"]
        if len(records) > 1:
            assert c["forward"] and all(n.startswith("all_gather") for n in c["forward"])
            assert c["backward"] == ["all_reduce"]
        else:
            assert (c["forward"], c["backward"]) == ([], []), "a world of one never syncs"
        torch.testing.assert_close(vec(c["running_mean"]), vec(c["global_mean"]))


def test_the_syncbn_check_asserts_what_one_rank_does():
    """One GPU: the path torch takes is plain batch_norm, which the CPU runs too."""
    from types import SimpleNamespace

    from conftest import load_script

    anatomy = load_script("demos/ddp_anatomy.py")
    one = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    recorded = anatomy.syncbn_collectives(one)  # as the rank record holds it: lists, not tensors
    recorded = {k: v.tolist() if torch.is_tensor(v) else v for k, v in recorded.items()}
    record = {"batchnorm": {"syncbn_collectives": recorded}}
    check_syncbn([record])
    with pytest.raises(AssertionError):  # the 2-rank claim (all-gathers) on what one rank did
        check_syncbn([record, record])


@pytest.mark.gpu
def test_anatomy_on_gpus_syncbn_and_device_ids(tmp_path):
    n = gpu_count()
    result = torchrun(DEMOS / "ddp_anatomy.py", "--timing-steps", 5, nproc=n,
                      run_dir=tmp_path, echo=False, timeout=300)  # fmt: skip
    for rec in result.records:
        assert rec["backend"] == "nccl"
        assert rec["device_ids"]["device_ids"] == [rec["rank"]]
        assert rec["device_ids"]["output_device"] == f"cuda:{rec['rank']}"
        assert rec["batchnorm"]["syncbn_error"] is None
    means = [vec(r["batchnorm"]["syncbn_running_mean"]) for r in result.records]
    for m in means[1:]:
        torch.testing.assert_close(m, means[0])  # one set of statistics for all ranks
    check_syncbn(result.records)
    for rec in result.records:  # buffers: each spelling, synced when it says
        b = rec["buffers"]
        assert b["broadcast_buffers=False"]["future_warning"] is not None
        assert b["forward_sync_buffers=False"]["after_init"] == 1.0  # rank 0's, everywhere
    reference = train_single(SEED, STEPS, BATCH, LR)
    torch.testing.assert_close(
        vec(result.records[0]["wrap"]["params_after_steps"]), reference, atol=1e-4, rtol=1e-4
    )


@pytest.mark.gpu
def test_cuda_visible_devices_only_before_init():
    def run(when: str) -> dict:
        out = subprocess.run(
            [sys.executable, str(DEMOS / "cuda_visibility.py"), "--when", when],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run("before")["device_count"] == 0
    assert run("after")["device_count"] == gpu_count()


@pytest.mark.gpu
def test_load_without_map_location_lands_on_gpu0(tmp_path):
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs to see a rank stray onto another rank's GPU")
    seen = {}
    for mode in ("stray", "clean"):
        result = torchrun(DEMOS / "cuda_contexts.py", "--mode", mode, nproc=2,
                          run_dir=tmp_path / mode, echo=False, timeout=180)  # fmt: skip
        seen[mode] = result.records
    assert [r["loaded_on"] for r in seen["stray"]] == ["cuda:0", "cuda:0"]
    assert [r["loaded_on"] for r in seen["clean"]] == ["cuda:0", "cuda:1"]
    gpu0 = seen["stray"][0]["nvml"][0]["pids"]
    pids = {r["pid"] for r in seen["stray"]}
    if pids & set(gpu0):  # NVML shows our pids (not a container with host pids)
        assert pids <= set(gpu0), "in stray mode every rank holds a context on GPU 0"
        assert seen["clean"][1]["pid"] not in seen["clean"][0]["nvml"][0]["pids"]


@pytest.mark.gpu
def test_dp_and_ddp_both_measured(tmp_path):
    pytest.importorskip("torchvision")  # the demo's resnet18; a torch-only GPU box skips it
    n = gpu_count()
    dp = subprocess.run(
        [sys.executable, str(DEMOS / "dp_vs_ddp.py"), "--mode", "dp", "--steps", "5",
         "--out", str(tmp_path / "dp")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dp.returncode == 0, dp.stderr[-2000:]
    (record,) = read_rank_records(tmp_path / "dp")
    assert len(record["peak_mib"]) == n
    if n >= 2:  # DataParallel's imbalance: GPU 0 holds what the others do, and more
        assert record["peak_mib"][0] > max(record["peak_mib"][1:]), record["peak_mib"]
    ddp = torchrun(DEMOS / "dp_vs_ddp.py", "--mode", "ddp", "--steps", 5, nproc=n,
                   run_dir=tmp_path / "ddp", echo=False, timeout=300)  # fmt: skip
    assert len(ddp.records) == n and all(r["samples_per_s"] > 0 for r in ddp.records)


def test_simulated_nodes_never_share_a_gpu():
    """Two torchrun "nodes" on one 8-GPU machine: each its own GPUs, or gloo when too few."""
    from ddp_tutorial.harness.multinode import node_gpus

    uuids = [f"GPU-{i}" for i in range(8)]
    envs, why = node_gpus(2, 4, uuids)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["GPU-0,GPU-1,GPU-2,GPU-3",
                                                         "GPU-4,GPU-5,GPU-6,GPU-7"]  # fmt: skip
    assert "own GPUs" in why
    envs, why = node_gpus(2, 2, uuids[:1])  # one GPU: both nodes would use cuda:0
    assert envs == [{"CUDA_VISIBLE_DEVICES": "", "DDP_TUTORIAL_BACKEND": "gloo"}] * 2
    assert "Duplicate GPU detected" in why
    assert node_gpus(2, 2, [])[0] == [{}, {}]


def test_multinode_gives_each_node_its_own_gpus(nvml):
    """What multinode() would start on an 8-GPU machine (NVML faked), without starting it."""
    from conftest import fake_gpu
    from ddp_tutorial.harness.multinode import node_specs

    nvml([fake_gpu(i) for i in range(8)])
    extra = ["--max-restarts", "0"]
    specs = node_specs(DEMOS / "hello.py", "--x", nnodes=2, nproc_per_node=2, echo=False,
                       port=29999, env={"A": "1"}, torchrun_args=extra)  # fmt: skip
    assert sorted(specs) == [0, 1]
    assert [specs[n].env for n in (0, 1)] == [
        {"A": "1", "CUDA_VISIBLE_DEVICES": f"{fake_gpu(0).uuid},{fake_gpu(1).uuid}"},
        {"A": "1", "CUDA_VISIBLE_DEVICES": f"{fake_gpu(2).uuid},{fake_gpu(3).uuid}"},
    ]
    for node, spec in specs.items():
        assert (spec.nproc, spec.standalone, spec.prefix) == (2, False, f"[node {node}]")
        assert spec.args == ("--x",) and spec.run_dir.name == f"node{node}"
        flags = list(spec.torchrun_args)
        assert flags[flags.index("--rdzv-endpoint") + 1] == "127.0.0.1:29999"
        assert flags[flags.index("--rdzv-conf") + 1] == f"is_host={int(node == 0)}"
        assert flags[-2:] == ["--max-restarts", "0"]
    nvml([fake_gpu(0)])  # one GPU for two nodes: both hide it and run gloo
    shared = node_specs(DEMOS / "hello.py", nnodes=2, nproc_per_node=2, echo=False)
    assert [s.env for s in shared.values()] == [{"CUDA_VISIBLE_DEVICES": "",
                                                 "DDP_TUTORIAL_BACKEND": "gloo"}] * 2  # fmt: skip
