"""Lesson 01: the collectives, the environment contract, and the three ways to start ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SCRIPTS, gpu_count
from ddp_tutorial.collectives import OPS, before_after_rows, check_records, expected
from ddp_tutorial.launch import torchrun
from ddp_tutorial.records import read_rank_records

GLOO = {"DDP_TUTORIAL_BACKEND": "gloo"}


def test_expected_values_follow_the_definitions():
    assert expected("all_reduce_sum", 1, 2) == [3.0, 30.0]
    assert expected("all_reduce_avg", 0, 4) == [2.5, 25.0]
    assert expected("broadcast", 3, 4) == [1.0, 10.0]
    assert expected("all_gather", 0, 3) == [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]
    assert expected("reduce", 0, 2) == [3.0, 30.0] and expected("reduce", 1, 2) is None
    assert expected("reduce_loss", 0, 3) == [3.0] and expected("reduce_loss", 2, 3) is None
    with pytest.raises(ValueError, match="unknown collective"):
        expected("scatter", 0, 2)


def test_collectives_and_env_contract_with_two_gloo_ranks(tmp_path):
    result = torchrun(
        SCRIPTS / "collectives.py", nproc=2, env=GLOO, run_dir=tmp_path, timeout=120, echo=False
    )
    records = result.records
    assert [r["rank"] for r in records] == [0, 1]
    assert check_records(records) == []
    env = [r["env"] for r in records]
    assert [e["RANK"] for e in env] == [e["LOCAL_RANK"] for e in env] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in env} == {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
    # reduce: rank 0 holds the sum, rank 1 does not (seed 001's reduce_loss).
    assert records[0]["collectives"]["reduce_loss"]["after"] == [2.0]
    assert records[1]["collectives"]["reduce_loss"]["after"] != [2.0]
    assert all(r["collectives"]["reduce_loss"]["fixed"] == [2.0] for r in records)
    assert not any(r["initialized_after_destroy"] for r in records)
    for op in OPS:
        assert len(before_after_rows(records, op)) == 2


def test_check_records_reports_a_wrong_value():
    good = [
        {"rank": r, "collectives": {op: {"after": expected(op, r, 2)} for op in OPS}}
        for r in range(2)
    ]
    for rec in good:
        rec["collectives"]["all_reduce_avg"]["error"] = None
    assert check_records(good) == []
    good[1]["collectives"]["broadcast"]["after"] = [2.0, 20.0]
    assert check_records(good) == ["rank 1 broadcast: got [2.0, 20.0], expected [1.0, 10.0]"]


def test_mp_spawn_template_runs_and_every_child_inherits_rank_0(tmp_path):
    cmd = [sys.executable, str(SCRIPTS / "spawn_template.py"), "--nprocs", "2"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_rank_records(tmp_path)
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["all_reduce_sum"] == 1.0 for r in records)
    assert [r["env"]["RANK"] for r in records] == ["0", "0"]


def _legacy(style: str, tmp_path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nnodes=1",
        "--nproc_per_node=2", str(SCRIPTS / "legacy_local_rank.py"), "--style", style,
        "--out", str(tmp_path / style),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_legacy_launcher_rejects_the_seed_local_rank_flag_and_the_fix_works(tmp_path):
    seed = _legacy("seed", tmp_path)
    assert seed.returncode != 0
    assert "deprecated" in seed.stderr
    assert "unrecognized arguments: --local-rank=" in seed.stderr
    fixed = _legacy("fixed", tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    records = read_rank_records(tmp_path / "fixed")
    assert [r["args_local_rank"] for r in records] == [r["env_local_rank"] for r in records]
    assert sorted(r["args_local_rank"] for r in records) == [0, 1]


def test_seed_local_rank_default_is_wrong_under_torchrun(tmp_path):
    result = torchrun(
        SCRIPTS / "legacy_local_rank.py", "--style", "seed",
        nproc=2, run_dir=tmp_path, timeout=120, echo=False,
    )  # fmt: skip
    assert [r["args_local_rank"] for r in result.records] == [1, 1]
    assert [r["env_local_rank"] for r in result.records] == [0, 1]


@pytest.mark.gpu
def test_collectives_on_nccl_one_rank_per_gpu(tmp_path):
    n = gpu_count()
    result = torchrun(
        SCRIPTS / "collectives.py", nproc=n, env={"DDP_TUTORIAL_BACKEND": "nccl"},
        run_dir=tmp_path, timeout=180, echo=False,
    )  # fmt: skip
    records = result.records
    assert len(records) == n and check_records(records) == []
    assert all(r["backend"] == "nccl" for r in records)
    assert [r["device"] for r in records] == [f"cuda:{i}" for i in range(n)]
