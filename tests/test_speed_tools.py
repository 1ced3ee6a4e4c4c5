"""Lesson 11's helpers: the wire counter, PowerSGD's arithmetic, log and trace parsing, plots.

The 2-rank claims (amp skip on every rank, compile = eager, the graph split,
bytes and overlap across real ranks, the template's warm-up curves) are
asserted on real launches by notebooks/11_speed_tools.ipynb and not launched
again here. These tests run in this process, with a world of one where a
process group is needed: no torchrun.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import load_script
from ddp_tutorial.harness import plots
from ddp_tutorial.lessons import speed
from ddp_tutorial.lessons.anatomy import global_batch, tiny_model


@pytest.fixture
def world_of_one():
    """A gloo group of one process on an in-memory store (no port, no launch)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(hook_state, hook, steps: int) -> speed.WireLog:
    model = DDP(tiny_model(0, hidden=64))
    model.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with speed.wire_log() as log:
        for step in range(steps):
            log.reset()
            x, y = global_batch(step, 16)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return log


def test_wire_log_sees_what_the_hooks_send_and_restores_all_reduce(world_of_one):
    original = dist.all_reduce
    plain = _train(None, default_hooks.allreduce_hook, 1)
    half = _train(None, default_hooks.fp16_compress_hook, 1)
    params = sum(p.numel() for p in tiny_model(0, hidden=64).parameters())
    assert plain.bytes == 4 * params and plain.calls[0][1] == "torch.float32"
    assert half.bytes * 2 == plain.bytes and half.calls[0][1] == "torch.float16"
    assert dist.all_reduce is original


def test_powersgd_elements_matches_the_real_hook(world_of_one):
    shapes = [list(p.shape) for p in tiny_model(0, hidden=64).parameters()]
    predicted = speed.powersgd_elements(shapes, rank=1, min_compression_rate=2)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=2)  # fmt: skip
    log = _train(state, powersgd.powerSGD_hook, 3)  # the third step is compressed
    assert log.bytes == 4 * predicted["sent"]
    assert predicted == {"plain": 4931, "sent": 398, "compressed_tensors": 3,
                         "ratio": pytest.approx(4931 / 398)}  # fmt: skip


def test_powersgd_elements_rules():
    conv = speed.powersgd_elements([[32, 16, 3, 3]], rank=2)  # viewed as 32 x 144
    assert conv["sent"] == (32 + 144) * 2 and conv["compressed_tensors"] == 1
    strict = speed.powersgd_elements([[64, 64], [64]], rank=1, min_compression_rate=40)
    assert strict["sent"] == strict["plain"] == 64 * 64 + 64  # 4096 < 40 * 128: kept
    assert speed.powersgd_elements([[10]])["compressed_tensors"] == 0  # biases never


LOG = """\
[rank0]:V1201 [4/0] [__ddp_graphs] ---split graph---
[rank0]:V1201 [4/0] [__ddp_graphs]     %submod_0 : [num_users=1] = call_module[target=submod_0]
[rank0]:V1201 [4/0] [__ddp_graphs]     %submod_1 : [num_users=1] = call_module[target=submod_1]
[rank0]:V1201 [4/0] [__ddp_graphs] ---submod_0 graph---
[rank0]:V1201 [4/0] [__ddp_graphs] ---submod_1 graph---
[rank0]:V1201 [4/0] [__ddp_graphs] ---submod_0 graph---
"""


def test_ddp_graph_splits_reads_the_distinct_pieces():
    assert speed.ddp_graph_splits(LOG) == ["submod_0", "submod_1"]
    assert speed.ddp_graph_splits("no compile here") == []


def _event(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_profile_rows_and_overlap_summary():
    prefix = speed.BACKWARD_PREFIX
    events = [
        _event("aten::mm", 0, 1),  # dropped: an op inside a node
        _event(prefix + "AddmmBackward0", 100, 200),
        _event(prefix + "torch::autograd::AccumulateGrad", 200, 210),
        _event("c10d::allreduce_", 210, 215),
        _event("gloo:all_reduce", 220, 400),
        _event(prefix + "AddmmBackward0", 215, 350),
        _event(prefix + "TBackward0", 350, 360),
        _event(prefix + "torch::autograd::AccumulateGrad", 360, 600),  # waits: not compute
    ]
    rows = speed.profile_rows(events)
    assert [r["kind"] for r in rows] == ["backward", "accumulate", "launch", "backward",
                                         "comm", "backward", "accumulate"]  # fmt: skip
    assert rows[0]["start"] == 0  # relative to the first backward node
    s = speed.overlap_summary(rows)
    assert s == {"backward_end": 250, "first_launch": 110, "first_comm": 120, "launches": 1,
                 "overlapped_us": 140}  # fmt: skip
    with pytest.raises(ValueError):
        speed.overlap_summary([r for r in rows if r["kind"] != "launch"])


def test_loss_gap_and_blow_up():
    assert speed.loss_gap([1.0, 0.5], [1.1, 0.45]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        speed.loss_gap([1.0], [1.0, 2.0])
    assert speed.blow_up([2.0, 1.5, 1.0, 100.0], window=3) == 1.0  # the spike is later
    assert speed.blow_up([2.0, 30.0, math.nan], window=3) == math.inf


def test_inf_gradient_leaves_the_original_alone():
    script = load_script("demos/speed_tools.py")
    grad = torch.ones(2, 3)
    hit = script.inf_gradient(grad)
    assert math.isinf(hit[0, 0]) and torch.isfinite(hit.view(-1)[1:]).all()
    assert torch.equal(grad, torch.ones(2, 3))


def test_amp_step_skips_an_injected_inf_and_halves_the_scale(world_of_one):
    script = load_script("demos/speed_tools.py")
    ddp = DDP(tiny_model(0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = global_batch(0, 16)
    before = copy.deepcopy(ddp.module.state_dict())
    hit = script.amp_step(ddp, x, y, opt, scaler, "fp16", accum=2, inject=True)
    assert hit == {**hit, "grads_finite": False, "stepped": False, "scale_after": 512.0}
    assert all(torch.equal(v, ddp.module.state_dict()[k]) for k, v in before.items())
    clean = script.amp_step(ddp, x, y, opt, scaler, "bf16", accum=2, inject=False)
    assert clean["stepped"] and clean["grads_finite"]


def test_plots_draw_the_timeline_and_the_curves():
    rows = [{"kind": "backward", "name": "AddmmBackward0", "start": 0, "end": 5},
            {"kind": "launch", "name": "c10d::allreduce_", "start": 2, "end": 3},
            {"kind": "comm", "name": "gloo:all_reduce", "start": 3, "end": 9}]  # fmt: skip
    fig = plots.overlap_timeline({"small": rows, "big": rows})
    assert len(fig.axes) == 2 and fig._repr_png_().startswith(b"\x89PNG")
    assert len(plots.loss_curves({"a": [3, 2, 1], "b": [3, 4, 90]}, log=True).axes) == 1
    with pytest.raises(ValueError):
        plots.overlap_timeline({})
