"""Lesson 12's helpers: the memory formula, the largest-model table, how tensors are split,
the collectives' accounting, the pictures; and the sharding script on 3 ranks.

The 2-rank claims (bytes per rank for DDP, ZeRO-1 and FSDP2, gradients and weights
against one process, the collectives of a step, DCP saved on 2 ranks and loaded on
1 and 3, the naive save that fails) are asserted on real launches by
notebooks/12_beyond_ddp.ipynb and not launched again here. The one launch below
rehearses the training at 3 ranks, where every tensor splits unevenly, and runs the
lesson's GPU section on the CPU: its code, and the dtypes it records (bf16 applied).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import DEMOS, fake_gpu
from ddp_tutorial.lessons import sharding
from ddp_tutorial.lessons.anatomy import deep_mlp, flat_grads, flat_params, global_batch


def _adam_after_one_step(model: torch.nn.Module) -> torch.optim.Adam:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 16)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return opt


# -- the memory formula and the table ---------------------------------------------------


def test_adam_bytes_is_what_a_model_and_its_adam_really_hold():
    model = deep_mlp(0, width=32, depth=3)
    opt = _adam_after_one_step(model)
    numels = [p.numel() for p in model.parameters()]
    assert sharding.state_bytes(model, opt) == sharding.adam_bytes(numels)
    assert sum(sharding.adam_bytes(numels).values()) == 16 * sum(numels) + 4 * len(numels)


def test_per_rank_bytes_are_the_zero_papers_formulas():
    psi, n = 1e9, 8
    assert sharding.per_rank_bytes("DDP", psi, n) == 16 * psi
    assert sharding.per_rank_bytes("ZeRO-1", psi, n) == pytest.approx((4 + 12 / n) * psi)
    assert sharding.per_rank_bytes("ZeRO-2", psi, n) == pytest.approx((2 + 14 / n) * psi)
    assert sharding.per_rank_bytes("FSDP (ZeRO-3)", psi, n) == pytest.approx(16 * psi / n)
    assert sharding.per_rank_bytes("ZeRO-1", psi, n, "fp32") == pytest.approx((8 + 8 / n) * psi)
    for s in sharding.STRATEGIES:  # one rank: nothing to shard, every strategy is DDP
        assert sharding.per_rank_bytes(s, psi, 1) == sharding.per_rank_bytes("DDP", psi, 1)


def test_largest_model_table():
    rows = sharding.largest_model_table((24, 80), world_size=8)
    assert [r["GPU"] for r in rows] == ["24 GB", "80 GB"]
    assert rows[1] == {"GPU": "80 GB", "DDP": 5.0, "ZeRO-1": 14.55, "ZeRO-2": 21.33,
                       "FSDP (ZeRO-3)": 40.0}  # fmt: skip
    fits = sharding.largest_model(80e9, 8)
    assert fits["DDP"] < fits["ZeRO-1"] < fits["ZeRO-2"] < fits["FSDP (ZeRO-3)"]
    assert sharding.largest_model(80e9, 1000)["DDP"] == fits["DDP"]  # more GPUs: no bigger


# -- how the tensors are split ----------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 256, 257])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shard_rows_is_torch_chunks_split(rows, world_size):
    chunks = [c.shape[0] for c in torch.zeros(rows).chunk(world_size)]
    chunks += [0] * (world_size - len(chunks))  # chunk returns fewer pieces: those ranks hold none
    assert [sharding.shard_rows(rows, r, world_size) for r in range(world_size)] == chunks
    padded = sharding.padded_numel([rows, 5], world_size)
    assert padded == world_size * math.ceil(rows / world_size) * 5 >= rows * 5


def test_fsdp_local_numel_counts_every_element_once():
    shapes = [[256, 8], [256], [3, 256], [3]]
    for n in (1, 2, 3, 8):
        total = sum(sharding.fsdp_local_numel(shapes, r, n) for r in range(n))
        assert total == sum(math.prod(s) for s in shapes)
    assert sharding.fsdp_local_numel([[3, 256], [3]], 1, 2) == 256 + 1  # the short last shard


def test_zero_partition_is_sorted_greedy_over_whole_tensors():
    numels = [p.numel() for p in deep_mlp(0, width=256, depth=2).parameters()]
    owned = sharding.zero_partition(numels, 2)
    assert owned == [[0, 2], [1, 3, 4, 5, 6, 7]]  # what ZeroRedundancyOptimizer chose (lesson)
    assert sorted(i for o in owned for i in o) == list(range(len(numels)))
    assert sharding.zero_partition([10, 1, 1], 2) == [[0], [1, 2]]  # one big tensor: uneven
    assert sharding.zero_partition([5, 5], 3) == [[0], [1], []]


# -- the collectives' accounting --------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n):
    size = 1000.0
    both = sharding.ring_bytes("reduce_scatter", size, n) + sharding.ring_bytes(
        "all_gather", size, n
    )
    assert sharding.ring_bytes("all_reduce", size, n) == pytest.approx(both)
    assert sharding.ring_bytes("broadcast", size, n, root=True) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        sharding.ring_bytes("gossip", size, n)


def test_predicted_payload_and_calls_of_each_method():
    units = sharding.fsdp_units(deep_mlp(0, width=256, depth=2))
    assert units[-1] == [[3, 256], [3]] and len(units) == 4
    psi = sum(math.prod(s) for u in units for s in u)
    assert sharding.predicted_payload("ddp", units, 2) == {"all_reduce": 4 * psi}
    assert sharding.predicted_payload("zero1", units, 2) == {"all_reduce": 4 * psi,
                                                             "broadcast": 4 * psi}  # fmt: skip
    padded = 4 * (psi + 256 + 1)  # the 3-row layer travels as 4 rows on 2 ranks
    assert sharding.predicted_payload("fsdp2", units, 2) == {"all_gather": 2 * padded,
                                                             "reduce_scatter": padded}  # fmt: skip
    assert sharding.predicted_payload("fsdp2_no_reshard", units, 2)["all_gather"] == padded
    assert sharding.fsdp_calls(units, True) == {"all_gather": 8, "reduce_scatter": 4}
    assert sharding.fsdp_calls([*units, []], False) == {"all_gather": 4, "reduce_scatter": 4}


def test_step_traffic_counts_the_broadcasts_a_rank_does_not_own():
    calls = [("all_reduce", 100), ("broadcast", 60), ("broadcast", 40)]
    assert sharding.step_traffic(calls, 2) == 100 + 100
    assert sharding.step_traffic(calls, 2, owned=60) == 100 + 40
    assert sharding.count_calls(calls) == {"all_reduce": 1, "broadcast": 2}
    assert sharding.payload_by_kind(calls) == {"all_reduce": 100, "broadcast": 100}


def test_comm_log_sees_ddps_all_reduce_from_cpp(world_of_one):
    model = DDP(deep_mlp(0, width=16, depth=1))
    x, y = global_batch(0, 8)
    with sharding.comm_log() as log:
        F.cross_entropy(model(x), y).backward()
    psi = sum(p.numel() for p in model.parameters())
    assert log.calls == [("all_reduce", 4 * psi)]  # one bucket, the whole gradient
    assert sum(log.get_comm_counts().values()) == 1


def test_state_bytes_counts_a_dtensors_local_shard(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = deep_mlp(0, width=16, depth=1)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = _adam_after_one_step(model)
    numels = [p.numel() for p in model.parameters()]
    assert sharding.state_bytes(model, opt) == sharding.adam_bytes(numels)


# -- pictures ----------------------------------------------------------------------------


def test_memory_bars_and_traffic_bars_draw_every_segment():
    rows = [{"method": m, "rank": r, "weights": 4, "gradients": 4, "optimizer": 8}
            for m in ("DDP", "FSDP2, no reshard") for r in (0, 1)]  # fmt: skip
    fig = sharding.memory_bars(rows)
    assert len(fig.axes[0].patches) == 3 * len(rows)
    assert "no reshard" in fig.axes[0].get_xticklabels()[-1].get_text()
    traffic = {"DDP": {"all_reduce": 10.0}, "FSDP2": {"all_gather": 10.0, "reduce_scatter": 5.0}}
    counts = {"DDP": {"all_reduce": 1}, "FSDP2": {"all_gather": 2, "reduce_scatter": 1}}
    fig = sharding.traffic_bars(traffic, counts)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["all_reduce", "all_gather", "reduce_scatter"]  # kinds nobody sent: none
    assert len(fig.axes[0].patches) == 3 * 2


# -- the script at 3 ranks ---------------------------------------------------------------


@pytest.mark.torchrun
def test_sharding_script_trains_like_one_process_on_three_ranks(tmp_path):
    """3 ranks: every tensor splits unevenly; all four methods still train like one process.

    The same launch runs the GPU section (``gpu_memory``) on the CPU, small: the lesson
    runs it only where GPUs exist, so without this its code would never run here.
    """
    from ddp_tutorial.harness.launch import torchrun

    width, depth, steps, batch = 32, 1, 2, 48
    run = torchrun(DEMOS / "sharding.py", "--only", "train", "gpu_memory", "--width", width,
                   "--depth", depth, "--steps", steps, "--batch-size", batch, "--timing-steps", 1,
                   "--gpu-width", width, "--gpu-depth", depth, nproc=3, run_dir=tmp_path,
                   timeout=240, echo=False)  # fmt: skip
    ref = deep_mlp(0, width=width, depth=depth)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    grads = []
    for step in range(steps):
        x, y = global_batch(step, batch, 0)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        grads.append(flat_grads(ref))
        opt.step()
    g_ref = grads[0]
    w_ref, shapes = flat_params(ref), [list(p.shape) for p in ref.parameters()]
    for rank, rec in enumerate(run.records):
        tensors = torch.load(tmp_path / f"train_rank{rank}.pt", weights_only=True)
        for method in sharding.METHODS:
            assert torch.allclose(tensors[method]["grad0"], g_ref, rtol=1e-5, atol=1e-7), method
            assert torch.allclose(tensors[method]["weights"], w_ref, atol=1e-5), method
        fsdp = rec["train"]["fsdp2"]
        assert [s[0] for s in fsdp["local_shapes"]] == [
            sharding.shard_rows(s[0], rank, 3) for s in shapes
        ]
        assert fsdp["bytes"]["weights"] == 4 * sharding.fsdp_local_numel(shapes, rank, 3)
        assert (
            rec["train"]["zero1"]["owned"]
            == sharding.zero_partition([math.prod(s) for s in shapes], 3)[rank]
        )
        mem = rec["gpu_memory"]
        assert mem["psi"] == sum(math.prod(s) for s in shapes)
        fp32, bf16 = ["torch.float32"], ["torch.bfloat16"]
        for method in ("ddp", "fsdp2", "fsdp2_bf16"):
            row = mem[method]
            computed = bf16 if method == "fsdp2_bf16" else fp32  # bf16 applied where it says
            assert row["weight_dtypes"] == row["output_dtypes"] == computed, (method, row)
            assert row["param_dtypes"] == row["grad_dtypes"] == fp32, (method, row)
            assert row["peak_bytes"] is row["forward_added_bytes"] is None  # no CUDA statistics


def test_process_gpu_bytes_reads_the_process_whole_from_nvml(nvml, monkeypatch):
    """Issue 33 point 11: lesson 12 shows what must fit beside the allocator's peak: the
    process's memory in NVML (found by the GPU's UUID, whatever CUDA_VISIBLE_DEVICES says)."""
    from ddp_tutorial.lessons.sharding import process_gpu_bytes

    nvml([fake_gpu(0, uuid="GPU-a"), fake_gpu(1, uuid="GPU-b")], pids={1: [10, 42]})
    assert process_gpu_bytes("GPU-b", 42) == 512 * 2**20, "GPU 1's second process"
    assert process_gpu_bytes("GPU-a", 42) is None, "not on that GPU"
    assert process_gpu_bytes("GPU-c", 42) is None, "no such GPU: None, not an NVML error"
    nvml(None)  # no driver
    assert process_gpu_bytes("GPU-b", 42) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no bindings
    assert process_gpu_bytes("GPU-b", 42) is None
