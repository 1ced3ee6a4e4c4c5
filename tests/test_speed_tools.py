"""Lesson 11's helpers: the wire counter, PowerSGD's arithmetic, log and trace parsing, plots.

The 2-rank claims (amp skip on every rank, compile = eager, the graph split,
bytes and overlap across real ranks, the template's warm-up curves) are
asserted on real launches by notebooks/11_speed_tools.ipynb and not launched
again here. These tests run in this process, with a world of one where a
process group is needed: no torchrun.
"""

from __future__ import annotations

import copy
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import REPO, load_script
from ddp_tutorial.harness import plots
from ddp_tutorial.lessons import speed
from ddp_tutorial.lessons.anatomy import global_batch, tiny_model

TOOLS = load_script("demos/speed_tools.py")  # what the ranks run: amp_choice, wire_log, ...


def _train(hook_state, hook, steps: int) -> TOOLS.WireLog:
    model = DDP(tiny_model(0, hidden=64))
    model.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TOOLS.wire_log() as log:
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


def test_profile_rows_ignores_the_gpu_twins_of_cpu_ranges():
    gpu_twin = _event("nccl:all_reduce", 5, 50)
    gpu_twin.device_type = DeviceType.CUDA  # a record_function's range as the GPU ran it
    rows = speed.profile_rows([_event(speed.BACKWARD_PREFIX + "AddmmBackward0", 0, 10), gpu_twin])
    assert [r["kind"] for r in rows] == ["backward"]


def _op(id_: int, name: str, parent=None) -> SimpleNamespace:
    """A CPU op: its ``id`` is what its kernels' ``linked_correlation_id`` points to."""
    return SimpleNamespace(id=id_, name=name, device_type=DeviceType.CPU,
                           linked_correlation_id=0, cpu_parent=parent,
                           time_range=SimpleNamespace(start=0, end=0))  # fmt: skip


def _kernel(name: str, op: int, stream: int, start: float, end: float, activity="kernel"):
    return SimpleNamespace(id=1000 + op, name=name, device_type=DeviceType.CUDA,
                           activity_type=activity, linked_correlation_id=op,
                           device_resource_id=stream, cpu_parent=None,
                           time_range=SimpleNamespace(start=start, end=end))  # fmt: skip


def _gpu_trace(nccl_start: float) -> list[SimpleNamespace]:
    """A CUDA step: forward, two backward nodes (compute on stream 7), DDP's bucket copy under
    AccumulateGrad, one NCCL kernel on stream 20 starting at ``nccl_start``, the optimizer."""
    prefix = speed.BACKWARD_PREFIX
    node2, node1 = _op(10, prefix + "AddmmBackward0"), _op(20, prefix + "AddmmBackward0")
    acc = _op(30, prefix + "torch::autograd::AccumulateGrad")
    ops = [_op(1, "aten::addmm"), node2, _op(11, "aten::mm", node2), node1,
           _op(21, "aten::mm", _op(22, "aten::matmul", node1)), acc, _op(31, "aten::copy_", acc),
           _op(40, "aten::add_"), _op(50, "nccl:all_reduce")]  # fmt: skip
    kernels = [
        _kernel("sm90_gemm_forward", 1, 7, 0, 40),  # forward: dropped
        _kernel("sm90_gemm_bwd2", 11, 7, 100, 200),
        _kernel("copy_kernel", 31, 7, 200, 210),  # DDP's copy into the bucket: accumulate
        _kernel("sm90_gemm_bwd1", 21, 7, 210, 400),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 20, nccl_start, nccl_start + 150),
        _kernel("nccl:all_reduce", 50, 20, nccl_start, nccl_start + 150, "gpu_user_annotation"),
        _kernel("Memcpy DtoD", 31, 7, 205, 206, "gpu_memcpy"),
        _kernel("vectorized_elementwise_kernel", 40, 7, 600, 610),  # the optimizer: dropped
    ]
    return [*ops, *kernels]


def test_kernel_rows_sorts_the_gpu_kernels_by_who_launched_them():
    rows = speed.kernel_rows(_gpu_trace(nccl_start=250))
    assert [(r["kind"], r["node"], r["stream"]) for r in rows] == [
        ("backward", "AddmmBackward0", 7), ("accumulate", "torch::autograd::AccumulateGrad", 7),
        ("backward", "AddmmBackward0", 7), ("comm", None, 20)]  # fmt: skip
    assert rows[0]["start"] == 0 and rows[-1]["start"] == 150  # from the first backward kernel


def test_gpu_overlap_summary_measures_the_time_both_ran():
    during = speed.gpu_overlap_summary(speed.kernel_rows(_gpu_trace(nccl_start=250)))
    assert during == {"backward_end": 300, "first_comm": 150, "comm_kernels": 1,
                      "overlapped_us": 150, "shared_streams": []}  # fmt: skip
    after = speed.gpu_overlap_summary(speed.kernel_rows(_gpu_trace(nccl_start=420)))
    assert after["first_comm"] >= after["backward_end"] and after["overlapped_us"] == 0
    rows = speed.kernel_rows(_gpu_trace(nccl_start=250))
    for r in rows:
        r["stream"] = 7  # everything on one stream: serialised, whatever the clock says
    assert speed.gpu_overlap_summary(rows)["shared_streams"] == [7]
    with pytest.raises(ValueError, match="CUPTI"):
        speed.gpu_overlap_summary([r for r in rows if r["kind"] != "comm"])


def test_overlap_us_counts_each_instant_once():
    assert speed.overlap_us([(0, 10), (5, 15)], [(8, 20)]) == 7  # a's union: 0-15
    assert speed.overlap_us([(0, 10)], [(10, 20), (30, 40)]) == 0  # touching is not overlap
    assert speed.overlap_us([(0, 5), (20, 35)], [(3, 4), (4, 25), (30, 31)]) == 2 + 5 + 1


def test_amp_choice_follows_the_compute_capability():
    assert TOOLS.amp_choice("cpu") == ("bf16", torch.bfloat16, False)
    for capability in [(7, 0), (7, 5)]:  # V100, T4: bf16 would be emulated
        assert TOOLS.amp_choice("cuda", capability) == ("fp16", torch.float16, True)
    for capability in [(8, 0), (8, 6), (9, 0), (12, 0)]:
        assert TOOLS.amp_choice("cuda", capability).precision == "bf16"
    with pytest.raises(ValueError):
        TOOLS.amp_choice("cuda", None)


def test_mean_relative_error_sees_three_bits():
    exact = torch.randn(20_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = {dt: speed.mean_relative_error(exact.to(dt).double(), exact)
              for dt in (torch.float16, torch.bfloat16)}  # fmt: skip
    assert errors[torch.bfloat16] / errors[torch.float16] == pytest.approx(8, rel=0.05)
    assert speed.mean_relative_error([1.0, 5.0], [1.0, 1e-9]) == 0.0  # 1e-9: under the floor
    with pytest.raises(ValueError):
        speed.mean_relative_error([1.0], [0.0])


def test_source_of_reads_a_function_without_running_the_file(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("raise SystemExit\n\ndef f(a):\n    return a  # kept\n")
    assert speed.source_of(path, "f") == "def f(a):\n    return a  # kept"
    with pytest.raises(LookupError):
        speed.source_of(path, "g")


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
    hit = script.recorded_amp_step(ddp, x, y, opt, scaler, "fp16", accum=2, inject=True)
    assert hit == {**hit, "grads_finite": False, "stepped": False, "scale_after": 512.0}
    assert all(torch.equal(v, ddp.module.state_dict()[k]) for k, v in before.items())
    clean = script.recorded_amp_step(ddp, x, y, opt, scaler, "fp16", accum=2, inject=False)
    assert clean["stepped"] and clean["grads_finite"] and clean["scale_after"] == 512.0
    bf16 = script.recorded_amp_step(ddp, x, y, opt, scaler, "bf16", accum=2, inject=False)
    assert bf16["stepped"] and bf16["grads_finite"]


def test_amp_step_with_no_sync_gives_the_one_big_batch_gradient(world_of_one):
    """Micro-batches of half the batch, each loss / 2: the gradient of the whole batch."""
    script = load_script("demos/speed_tools.py")
    x, y = global_batch(0, 16)
    grads = []
    for micro in ([(x, y)], list(zip(x.chunk(2), y.chunk(2), strict=True))):
        ddp = DDP(tiny_model(0))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)  # the step changes nothing
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        script.amp_step(ddp, micro, opt, scaler, None)
        grads.append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_plots_draw_the_timeline_and_the_curves():
    rows = [{"kind": "backward", "name": "AddmmBackward0", "start": 0, "end": 5},
            {"kind": "launch", "name": "c10d::allreduce_", "start": 2, "end": 3},
            {"kind": "comm", "name": "gloo:all_reduce", "start": 3, "end": 9}]  # fmt: skip
    fig = plots.overlap_timeline({"small": rows, "big": rows})
    assert len(fig.axes) == 2 and fig._repr_png_().startswith(b"\x89PNG")
    assert len(plots.loss_curves({"a": [3, 2, 1], "b": [3, 4, 90]}, log=True).axes) == 1
    with pytest.raises(ValueError):
        plots.overlap_timeline({})


def _snippets_to_remember() -> list[str]:
    """The python blocks of lesson 11's "What to remember" cell: what a learner copies."""
    import nbformat  # not at module level: a GPU box may run the tests without Jupyter

    nb = nbformat.read(REPO / "notebooks" / "11_speed_tools.ipynb", as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    (last,) = [text for text in markdown if text.startswith("## What to remember")]
    return re.findall(r"```python\n(.*?)```", last, flags=re.S)


def _minimal_script_names(model: nn.Module) -> dict:
    """The names the minimal script (scripts/minimal_ddp.py) has defined when the snippets run."""
    x, y = global_batch(0, 64)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    return {"torch": torch, "nn": nn, "DDP": DDP, "device": torch.device("cpu"), "local_rank": 0,
            "args": SimpleNamespace(epochs=2), "sampler": sampler, "model": model,
            "loader": DataLoader(data, batch_size=8, sampler=sampler),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}  # fmt: skip


def test_the_snippets_to_remember_run_in_the_minimal_script(world_of_one):
    amp, compiled, hook, powersgd_ = _snippets_to_remember()
    names = _minimal_script_names(DDP(tiny_model(0)))
    before = copy.deepcopy(names["model"].module.state_dict())
    exec(amp, names)  # 2 epochs of 8 batches, 2 micro-batches per step: 8 steps in bf16
    assert names["dtype"] == torch.bfloat16 and not names["scaler"].is_enabled()
    assert all(not torch.equal(v, names["model"].module.state_dict()[k]) for k, v in before.items())

    bare = tiny_model(0)
    names = _minimal_script_names(bare)
    exec(compiled, names)  # builds the wrapper; nothing compiles before the first call
    assert names["model"].module is bare  # the minimal script's save line still finds it

    for snippet, dtype in ((hook, "torch.bfloat16"), (powersgd_, "torch.float32")):
        names = _minimal_script_names(DDP(tiny_model(0)))
        exec(snippet, names)
        x, y = global_batch(0, 16)
        with TOOLS.wire_log() as log:
            F.cross_entropy(names["model"](x), y).backward()
        assert {d for _, d in log.calls} == {dtype}  # PowerSGD: plain all_reduce at first


def test_ddp_launches_every_bucket_but_the_first_layers_inside_backward(world_of_one):
    """Lesson 11's overlap asserts, in one process: where a launch falls is not timing.

    DDP launches a bucket's all_reduce from its last gradient's hook, on backward's own
    thread: every bucket but the one holding the first layer (whose gradient is backward's
    last computation) is launched before backward's compute ends; one bucket, after it.
    """
    from torch.profiler import ProfilerActivity, profile

    from ddp_tutorial.lessons.anatomy import deep_mlp

    x, y = global_batch(0, 64)
    summaries = {}
    for cap in (0.3, 25.0):  # about one 256 x 256 layer per bucket, as in the lesson; one bucket
        model = DDP(deep_mlp(0, width=256, depth=6), bucket_cap_mb=cap)
        for _ in range(2):  # the first step builds the real buckets
            F.cross_entropy(model(x), y).backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            F.cross_entropy(model(x), y).backward()
        rows = speed.profile_rows(prof.events())
        s = speed.overlap_summary(rows)
        launched = [r["start"] for r in rows if r["kind"] == "launch"]
        summaries[cap] = (s["launches"], sum(t < s["backward_end"] for t in launched))
    assert summaries[0.3][0] >= 3 and summaries[0.3][1] == summaries[0.3][0] - 1
    assert summaries[25.0] == (1, 0)


def test_the_code_lesson_11_shows_is_the_code_that_ran():
    # Lesson 11 shows amp_step and profiled_step in its markdown (readable in a notebook
    # without outputs); they must be the launched script's, line for line.
    cells = json.loads((REPO / "notebooks" / "11_speed_tools.ipynb").read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    blocks = re.findall(r"```python\n(.*?)\n```", text, re.S)
    path = REPO / "scripts" / "demos" / "speed_tools.py"
    amp = speed.source_of(path, "amp_step")
    imports = [ln for ln in path.read_text().splitlines() if "torch.profiler import" in ln]
    profiled = "\n".join(imports) + "\n\n\n" + speed.source_of(path, "profiled_step")
    assert amp in blocks, "lesson 11's amp_step differs from scripts/demos/speed_tools.py"
    assert profiled in blocks, "lesson 11's profiled_step differs from speed_tools.py"


def test_the_overlap_record_does_not_grow_with_the_model(world_of_one, tmp_path):
    """Lesson 11's overlap model is 2048 wide on a GPU (25 M weights): a record holding each
    knob's weights was ~2.6 GB of JSON per rank there. It holds the comparisons the lesson
    asserts instead, so its size is the same at any width (here 16 and 64, in one process)."""
    from ddp_tutorial.distributed import DistInfo
    from ddp_tutorial.records import write_json

    demo = load_script("demos/speed_tools.py")
    info = DistInfo(0, 0, 1, 1, "gloo", torch.device("cpu"), "a world of one")
    sizes = {}
    for width in (16, 64):
        args = SimpleNamespace(overlap_width=width, batch_size=8, seed=0, timing_steps=1)
        record = demo.case_overlap(args, info)
        knobs = record["knobs"]
        for k in knobs.values():  # the profiled events are as many at any width
            k.pop("events"), k.pop("kernels")
        sizes[width] = write_json(tmp_path / f"{width}.json", record).stat().st_size  # as ranks do
    assert sizes[64] < 1.5 * sizes[16], f"the record grows with the model: {sizes}"
    assert knobs["gradient_as_bucket_view"]["same_weights_as_first"], "bit for bit"
    assert knobs["small buckets"]["max_diff_from_first"] == 0.0
