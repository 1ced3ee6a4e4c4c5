"""Lessons 03-04 against real ranks: DDP's anatomy, equivalence, no_sync, unused
parameters (gloo, real torchrun), the two-node LOCAL_RANK table, and the GPU paths.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import SCRIPTS, gpu_count, processes_running
from ddp_tutorial.anatomy import shard, train_single, tutorial_series_run
from ddp_tutorial.launch import LaunchError, multinode, shell_command, start, torchrun

STEPS, BATCH, LR, SEED = 5, 32, 0.1, 100


def vec(values: list[float]) -> torch.Tensor:
    return torch.tensor(values)


@pytest.fixture(scope="module")
def anatomy(tmp_path_factory) -> list[dict]:
    """One 2-rank launch of every experiment (launches are the expensive part)."""
    run_dir = tmp_path_factory.mktemp("anatomy")
    result = torchrun(
        SCRIPTS / "ddp_anatomy.py",
        "--steps", STEPS, "--batch-size", BATCH, "--lr", LR, "--seed", SEED,
        "--timing-steps", 5,
        nproc=2, run_dir=run_dir, echo=False, timeout=240,
        env={"DDP_TUTORIAL_BACKEND": "gloo"},
    )  # fmt: skip
    assert [r["rank"] for r in result.records] == [0, 1]
    return result.records


def test_construction_broadcasts_rank0_parameters(anatomy):
    r0, r1 = (r["wrap"] for r in anatomy)
    assert not torch.equal(vec(r0["params_before_wrap"]), vec(r1["params_before_wrap"]))
    assert torch.equal(vec(r1["params_after_wrap"]), vec(r0["params_before_wrap"]))
    assert r0["module_is_wrapped_model"] and r1["module_is_wrapped_model"]


def test_gradients_are_the_average_of_local_gradients(anatomy):
    w = [r["wrap"] for r in anatomy]
    mean = (vec(w[0]["local_grad_step0"]) + vec(w[1]["local_grad_step0"])) / 2
    assert not torch.allclose(vec(w[0]["local_grad_step0"]), vec(w[1]["local_grad_step0"]))
    for rank in w:
        torch.testing.assert_close(vec(rank["ddp_grad_step0"]), mean)


def test_all_reduce_per_bucket_covers_every_gradient_once(anatomy):
    w = anatomy[0]["wrap"]
    assert w["allreduce_numel_per_step"] == [w["num_params"]] * STEPS
    assert max(w["allreduce_calls_per_step"]) >= 2, "a tiny bucket cap gives several buckets"
    assert w["allreduce_calls_default_buckets"] == 1
    assert sum(w["bucket_numels_last_step"]) == w["num_params"]


def test_ddp_on_shards_equals_one_process_on_the_global_batch(anatomy):
    reference = train_single(SEED, STEPS, BATCH, LR)
    finals = [vec(r["wrap"]["params_after_steps"]) for r in anatomy]
    assert torch.equal(finals[0], finals[1]), "replicas stay identical"
    torch.testing.assert_close(finals[0], reference)
    assert not torch.allclose(finals[0], vec(anatomy[0]["wrap"]["params_after_wrap"]))


def test_no_sync_accumulation_equals_one_big_batch_with_fewer_all_reduces(anatomy):
    for record in anatomy:
        ns = record["no_sync"]
        torch.testing.assert_close(
            vec(ns["accumulate_no_sync"]["grad"]), vec(ns["one_big_batch"]["grad"])
        )
        torch.testing.assert_close(
            vec(ns["accumulate_naive"]["grad"]), vec(ns["one_big_batch"]["grad"])
        )
        assert ns["accumulate_no_sync"]["allreduce_calls"] == 1
        assert ns["accumulate_naive"]["allreduce_calls"] == 2


def test_unused_parameters_error_and_fixes(anatomy):
    for record in anatomy:
        u = record["unused"]
        assert u["error_iteration"] == 1, "the error surfaces at the NEXT forward"
        assert "Expected to have finished reduction in the prior iteration" in u["error"]
        assert "find_unused_parameters=True" in u["error"]
        for flag in ("find_unused_parameters", "static_graph"):
            assert len(u[flag]) == 3 and u[f"{flag}_aux_grad"] is None
        assert u["same_result_with_and_without"]
        assert u["step_ms_default"] > 0 and u["step_ms_find_unused"] > 0


def test_batchnorm_statistics_differ_and_syncbn_needs_gpus(anatomy):
    means = [vec(r["batchnorm"]["bn_running_mean"]) for r in anatomy]
    assert not torch.allclose(means[0], means[1])
    for record in anatomy:
        bn = record["batchnorm"]
        assert bn["converted_types"] == ["SyncBatchNorm"]
        assert bn["syncbn_error"] == "ValueError: SyncBatchNorm layers only work with GPU modules"


def test_cpu_module_refuses_device_ids(anatomy):
    for record in anatomy:
        assert (
            "device_ids and output_device arguments only work"
            in (record["device_ids"]["cpu_device_ids_error"])
        )


# -- pure pieces -------------------------------------------------------------------


def test_anchor_bug_cross_entropy_on_one_output_never_trains():
    bug = tutorial_series_run("cross_entropy")
    assert bug["first_loss"] == 0 and bug["last_loss"] == 0 and bug["max_grad_norm"] == 0
    assert not bug["weights_changed"]
    fix = tutorial_series_run("mse")
    assert fix["weights_changed"] and fix["last_loss"] < fix["first_loss"] / 2
    with pytest.raises(ValueError, match="loss must be one of"):
        tutorial_series_run("nll")


def test_shard_refuses_uneven_batches():
    assert shard(torch.arange(6), 1, 2).tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="does not split into 4 equal shards"):
        shard(torch.arange(6), 0, 4)


# -- launching several torchruns at once -----------------------------------------


def test_two_nodes_local_rank_is_not_rank(tmp_path):
    results = multinode(
        SCRIPTS / "device_report.py", "--gpus-per-node", 2,
        nnodes=2, nproc_per_node=2, run_dir=tmp_path, echo=False, timeout=120,
        env={"DDP_TUTORIAL_BACKEND": "gloo"},
        node_env=[{"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}],
    )  # fmt: skip
    assert len(results) == 2 and all(r.ok for r in results)
    rows = sorted((rec for r in results for rec in r.records), key=lambda rec: rec["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for result in results:  # each node holds local ranks 0 and 1 of one group
        assert sorted(rec["local_rank"] for rec in result.records) == [0, 1]
        assert len({rec["group_rank"] for rec in result.records}) == 1
    for row in rows:
        assert row["world_size"] == 4 and row["all_reduce_sum"] == 6.0
        assert row["rank"] == row["group_rank"] * 2 + row["local_rank"]
        assert row["package_device"] == f"cuda:{row['local_rank']}"
        assert row["seed_000_device"] == f"cuda:{row['rank']}"
    assert [r["seed_000_outcome"] for r in rows[2:]] == ["no such GPU (node has 2)"] * 2
    assert "--node-rank" in results[1].command and "c10d" in results[1].command
    for value, result in zip(("", "-1"), results, strict=True):  # node_env reaches its node only
        assert {rec["cuda_visible_devices"] for rec in result.records} == {value}
    assert (tmp_path / "node0").is_dir() and (tmp_path / "node1").is_dir()


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


def test_multinode_failure_names_node_and_kills_the_rest(tmp_path, write_script):
    script = write_script("fails_node1.py", FAILS_ON_NODE_1)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="deliberate failure on node 1") as info:
        multinode(script, nnodes=2, nproc_per_node=1, run_dir=tmp_path / "r", echo=False,
                  timeout=90, torchrun_args=["--max-restarts", "0"])  # fmt: skip
    assert time.monotonic() - t0 < 80, "a failed node must not leave the other waiting"
    assert str(info.value).startswith("node ")
    time.sleep(0.5)
    assert processes_running(str(script)) == []


def test_multinode_bad_input():
    with pytest.raises(ValueError, match="nnodes must be a positive integer"):
        multinode(SCRIPTS / "hello.py", nnodes=0)
    with pytest.raises(ValueError, match="node_env needs 2 entries"):
        multinode(SCRIPTS / "hello.py", nnodes=2, node_env=[{}])


def test_shell_command_is_what_a_user_types():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--log-dir", "runs/x/logs", "--tee", "3",
           "s.py", "--lr", "1", "--out", "runs/x"]  # fmt: skip
    assert shell_command(cmd) == "torchrun --nproc-per-node 2 s.py --lr 1"


def test_start_returns_before_the_launch_ends(tmp_path):
    t0 = time.monotonic()
    launch = start(SCRIPTS / "hello.py", nproc=1, run_dir=tmp_path, echo=False)
    assert time.monotonic() - t0 < 2 and not launch.done
    result = launch.wait()
    assert result.ok and [r["rank"] for r in result.records] == [0]
    assert launch.wait() is result


# -- GPU paths (make gpu-check) ----------------------------------------------------


@pytest.mark.gpu
def test_anatomy_on_gpus_syncbn_and_device_ids(tmp_path):
    n = gpu_count()
    result = torchrun(SCRIPTS / "ddp_anatomy.py", "--timing-steps", 5, nproc=n,
                      run_dir=tmp_path, echo=False, timeout=300)  # fmt: skip
    for rec in result.records:
        assert rec["backend"] == "nccl"
        assert rec["device_ids"]["device_ids"] == [rec["rank"]]
        assert rec["device_ids"]["output_device"] == f"cuda:{rec['rank']}"
        assert rec["batchnorm"]["syncbn_error"] is None
    means = [vec(r["batchnorm"]["syncbn_running_mean"]) for r in result.records]
    for m in means[1:]:
        torch.testing.assert_close(m, means[0])  # one set of statistics for all ranks
    reference = train_single(SEED, STEPS, BATCH, LR)
    torch.testing.assert_close(
        vec(result.records[0]["wrap"]["params_after_steps"]), reference, atol=1e-4, rtol=1e-4
    )


@pytest.mark.gpu
def test_cuda_visible_devices_only_before_init():
    def run(when: str) -> dict:
        out = subprocess.run(
            [sys.executable, str(SCRIPTS / "cuda_visibility.py"), "--when", when],
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
        result = torchrun(SCRIPTS / "cuda_contexts.py", "--mode", mode, nproc=2,
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
    n = gpu_count()
    dp = subprocess.run(
        [sys.executable, str(SCRIPTS / "dp_vs_ddp.py"), "--mode", "dp", "--steps", "5",
         "--out", str(tmp_path / "dp")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dp.returncode == 0, dp.stderr[-2000:]
    ddp = torchrun(SCRIPTS / "dp_vs_ddp.py", "--mode", "ddp", "--steps", 5, nproc=n,
                   run_dir=tmp_path / "ddp", echo=False, timeout=300)  # fmt: skip
    assert len(ddp.records) == n and all(r["samples_per_s"] > 0 for r in ddp.records)
