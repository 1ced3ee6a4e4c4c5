"""The benchmark: its timing loop, derived figures and the ring-model fit on fixed inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO
from ddp_tutorial.lessons import perf


def test_percentile_matches_linear_interpolation():
    assert perf.percentile([1, 2, 3, 4], 50) == 2.5
    assert perf.percentile([10.0], 90) == 10.0
    assert perf.percentile([0, 10], 90) == pytest.approx(9.0)


def test_summarize_steps():
    s = perf.summarize_steps([0.1, 0.1, 0.2, 0.2], samples_per_step=64)
    assert s["samples_per_sec"] == pytest.approx(64 * 4 / 0.6)
    assert s["step_ms_p50"] == pytest.approx(150.0)
    assert s["seconds"] == pytest.approx(0.6), "the clock the throughput divides by, kept"


def test_derive_on_fixed_inputs():
    d = perf.derive(plain_1=100.0, plain_all=150.0, ddp_world1=95.0, ddp_world_n=171.0, n=2)
    assert d["ddp_overhead"] == pytest.approx(100 / 95 - 1)
    assert d["scaling_efficiency"] == pytest.approx(171 / 190)
    assert d["speedup_vs_all_cores"] == pytest.approx(171 / 150)
    with pytest.raises(ValueError):
        perf.derive(0, 1, 1, 1, 2)


def test_ring_model_recovers_alpha_and_bandwidth():
    alpha, bandwidth, n = 50e-6, 2e9, 4
    sizes = [2**k for k in range(10, 27, 2)]
    times = [2 * (n - 1) * alpha + perf.ring_factor(n) * s / bandwidth for s in sizes]
    assert times == [perf.ring_time(s, n, alpha, bandwidth) for s in sizes]
    fit = perf.fit_ring_model(sizes, times, n)
    assert fit["latency_s"] == pytest.approx(2 * (n - 1) * alpha, rel=1e-6)  # the constant
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)  # per step: the constant / 2(N-1)
    assert fit["bandwidth_Bps"] == pytest.approx(bandwidth, rel=1e-6)
    assert fit["max_rel_error"] < 1e-6
    assert perf.bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)  # 2(N-1)/N = 1 for N=2
    with pytest.raises(ValueError):
        perf.fit_ring_model(sizes, times, 1)  # one rank sends nothing: no latency to fit


def test_one_process_has_no_ring_to_fit_and_says_so():
    """One GPU: lesson 07's benchmark runs one rank; the fit is skipped with the reason."""
    alpha, bandwidth = 50e-6, 2e9
    sweep = [{"bytes": s, "best_seconds": perf.ring_time(s, 2, alpha, bandwidth) + 1e-6}
             for s in (2**10, 2**14, 2**18)]  # fmt: skip
    one = perf.fit_ring_sweep(sweep, 1)
    assert one["ring_fit"] is None and one["ring_fit_skipped"].startswith(
        "no ring with one process"
    )
    two = perf.fit_ring_sweep(sweep, 2)
    assert two["ring_fit_skipped"] == "" and two["ring_fit"]["world_size"] == 2
    assert two["ring_fit"]["bandwidth_Bps"] == pytest.approx(bandwidth, rel=0.05)


def test_the_ring_latency_grows_with_n_and_its_bandwidth_term_stays_below_2s_over_b():
    alpha, bandwidth = 1e-5, 1e9
    tiny = [perf.ring_time(8, n, alpha, bandwidth) for n in (2, 4, 8, 64)]
    assert tiny == pytest.approx([2 * (n - 1) * alpha for n in (2, 4, 8, 64)], rel=1e-3)
    big = 2**30
    for n in (2, 8, 512):
        assert perf.ring_time(big, n, 0.0, bandwidth) < 2 * big / bandwidth


def test_step_times_leaves_the_warmup_out(benchmark, monkeypatch):
    clock, calls = [0.0], []  # a clock of our own: a busy host woke a sleep 40 ms late (helper 111)
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])

    def step():  # the first call is slow, as a real first step is (allocation, kernels)
        calls.append(None)
        clock[0] += 5.0 if len(calls) == 1 else 0.001

    times = benchmark.step_times(step, steps=3, warmup=1)
    assert len(calls) == 4 and times == pytest.approx([0.001] * 3)  # not the slow first call
    assert len(benchmark.step_times(step, steps=2, warmup=0)) == 2


def test_slowest_rank_takes_the_max_over_the_ranks(world_of_one, benchmark):
    import torch

    # a world of one: the max over one rank is its own time, as a float
    assert benchmark.slowest_rank(1.5, torch.device("cpu")) == 1.5


def test_ddp_throughput_keeps_every_ranks_seconds_and_divides_by_the_largest(
    world_of_one, benchmark
):
    """Lesson 07 checks on the N-rank run that ``seconds`` is the max of ``rank_seconds``."""
    import torch

    args = benchmark.parse_args(["--quick", "--steps", "2", "--warmup", "1", "--no-template"])
    summary = benchmark.ddp_throughput(args, torch.device("cpu"))
    assert len(summary["rank_seconds"]) == 1 and summary["seconds"] == max(summary["rank_seconds"])
    assert summary["samples_per_sec"] == pytest.approx(2 * args.batch_size / summary["seconds"])


def test_the_bucket_view_rows_zero_the_gradients_in_place(world_of_one, benchmark, monkeypatch):
    """gradient_as_bucket_view saves the copies only while the gradients stay the buckets'
    views: zero_grad(set_to_none=True), the default, makes them new tensors every step (torch's
    DDP docs, under batched_grad_copy). The knob's rows zero them in place; the others keep
    set_to_none=True. (Whether a copy was made cannot be seen from Python: the reducer makes
    the gradient the bucket's view again after copying, so its address is the same anyway.)"""
    import torch

    seen, real = [], benchmark.timed_loop

    def spy(*args, **kwargs):
        seen.append(args[7] if len(args) > 7 else kwargs.get("set_to_none", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(benchmark, "timed_loop", spy)
    args = benchmark.parse_args(["--quick", "--steps", "2", "--warmup", "1", "--no-template"])
    benchmark.ddp_throughput(args, torch.device("cpu"))
    benchmark.ddp_throughput(args, torch.device("cpu"), gradient_as_bucket_view=True)
    assert seen == [True, False]


def test_the_bucket_rows_change_how_many_buckets_there_are(world_of_one, benchmark):
    """bucket_cap_mb=1 gave the knob MLP (two hidden layers) the same buckets as the default:
    the bucket rows run a deeper MLP, at least 1024 wide (also under --quick, whose 256 made
    one bucket of 25 and 100 MB alike), where 1, 25 and 100 MB give fewer all_reduces each;
    its layers alternate, Linear then ReLU."""
    import torch

    args = benchmark.parse_args(
        ["--quick", "--steps", "2", "--warmup", "1", "--no-template"]
    )  # 256 wide
    per_step = [
        benchmark.ddp_throughput(args, torch.device("cpu"), "deep", count=True, bucket_cap_mb=cap)[
            "allreduces_per_step"
        ]
        for cap in (1, 25, 100)
    ]
    assert per_step[0] > per_step[1] > per_step[2], per_step
    kinds = [type(m).__name__ for m in benchmark.new_model(args, "deep")][1:]
    assert kinds == ["Linear", "ReLU"] * benchmark.DEPTH + ["Linear"], kinds


def test_the_benchmark_times_with_the_functions_the_lesson_shows(benchmark):
    """Lesson 07 shows step_times and slowest_rank as the loop to copy: the benchmark uses them."""
    import inspect

    assert "step_times(" in inspect.getsource(benchmark.timed_loop)
    assert "slowest_rank(sum(times)" in inspect.getsource(benchmark.ddp_throughput)
    assert "= timed_loop(" in inspect.getsource(benchmark.role_plain)
    assert "accumulation_step(" in inspect.getsource(benchmark.timed_loop)


def test_the_knob_groups_can_be_chosen(benchmark):
    assert benchmark.parse_args(["--knobs", "no_sync,threads"]).knobs == ["no_sync", "threads"]
    assert benchmark.parse_args([]).knobs == list(benchmark.KNOB_GROUPS)
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--knobs", "no_such_knob"])


# -- what the benchmark does on GPUs, proven here ------------------------------------------


@pytest.fixture(scope="module")
def benchmark():
    from conftest import load_script

    return load_script("benchmark.py")


def test_on_gpus_the_baselines_run_on_a_gpu_and_the_ceiling_gives_each_process_one(
    benchmark, nvml, monkeypatch
):
    """The ceiling's N processes get one GPU each, as N single-rank "nodes" would."""
    from conftest import fake_gpu
    from ddp_tutorial.harness.multinode import node_gpus_here

    assert benchmark.bench_device(0) == "cpu" and benchmark.bench_device(8) == "cuda:0"
    nvml([fake_gpu(i) for i in range(8)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs, _ = node_gpus_here(3, 1)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [fake_gpu(i).uuid for i in range(3)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in node_gpus_here(2, 1)[0]] == [
        fake_gpu(4).uuid, fake_gpu(5).uuid]  # fmt: skip


def test_the_gpu_all_reduce_sweep_reaches_a_gibibyte_and_reports_both_bandwidths():
    gpu, cpu = perf.sweep_sizes(False, "cuda"), perf.sweep_sizes(False, "cpu")
    assert gpu[0] == cpu[0] == 1024 and gpu[-1] >= 2**30 and cpu[-1] == 64 * 2**20
    assert perf.sweep_sizes(True, "cpu")[-1] == 4 * 2**20
    # nccl-tests' definitions: busbw = algbw * 2(N-1)/N
    assert perf.alg_bandwidth(2**30, 0.5) == 2 * 2**30
    assert perf.bus_bandwidth(2**30, 0.5, 8) == pytest.approx(2 * 2**30 * 2 * 7 / 8)


# -- the ring all-reduce of lesson 07: a computed schedule, run on real numbers ---------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_the_ring_schedule_sums_exactly_and_sends_two_n_minus_one_over_n(world):
    import torch

    schedule = perf.ring_schedule(world)
    assert len(schedule) == 2 * (world - 1)
    for step in schedule:  # every rank sends one chunk to its right neighbour, each step
        assert sorted(src for src, _, _, _ in step) == list(range(world))
        assert all(dst == (src + 1) % world for src, dst, _, _ in step)
    size = 4 * world * 6
    inputs = [torch.randint(-99, 99, (size,)).double() for _ in range(world)]
    run = perf.simulate_ring(inputs)
    total = torch.stack(inputs).sum(0)
    assert all(torch.equal(r, total) for r in run.results)
    assert run.bytes_sent == [perf.ring_factor(world) * 8 * size] * world
    after_rs = run.contributions[world - 1]  # rank r holds the full sum of chunk r+1
    assert all(after_rs[r][(r + 1) % world] == world for r in range(world))
    assert run.contributions[-1] == [[world] * world] * world


def test_the_reduce_scatter_adds_and_the_all_gather_copies():
    import torch

    # A schedule that sent the wrong chunk would add a partial sum twice: count the inputs.
    run = perf.simulate_ring([torch.full((3,), 10.0**r) for r in range(3)])
    assert [r.tolist() for r in run.results] == [[111.0] * 3] * 3
    phases = [step[0][3] for step in perf.ring_schedule(3)]
    assert phases == ["reduce-scatter"] * 2 + ["all-gather"] * 2
    with pytest.raises(ValueError):
        perf.ring_schedule(0)


def test_the_ring_picture_has_a_block_per_step_and_a_box_per_send():
    import torch

    fig = perf.draw_ring(perf.simulate_ring([torch.ones(8) for _ in range(4)]))
    (ax,) = fig.axes
    assert len(ax.images) == 1 and len(ax.patches) == 6 * 4
    titles = [t.get_text() for t in ax.texts if t.get_text().startswith(("start", "RS", "AG"))]
    assert titles == ["start", "RS 1", "RS 2", "RS 3", "AG 1", "AG 2", "AG 3"]


def test_lesson_07_shows_the_timing_code_as_it_stands_in_the_files():
    """Lesson 07 prints the timing code in its markdown (readable without running): step_times,
    slowest_rank, accumulation_step and the lines of ddp_throughput that use them, as same-as
    blocks (test_readable keeps them equal to scripts/benchmark.py; helper 144: the lines were
    once a filtered copy, without the `world` they use)."""
    import json

    from conftest import REPO

    cells = json.loads((REPO / "notebooks" / "07_scaling_and_performance.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in cells["cells"] if c["cell_type"] == "markdown")
    for name in ("step_times", "slowest_rank", "accumulation_step"):
        assert f"<!-- same as: scripts/benchmark.py {name} -->" in text, f"07 shows {name}"
    used = 'scripts/benchmark.py from "times = timed_loop(ddp" to "samples / slowest"'
    assert f"<!-- same as: {used} -->" in text, "lesson 07 shows ddp_throughput's lines"


def test_bad_benchmark_flags_are_refused_and_zero_warmup_is_kept(benchmark, capsys):
    """--warmup 0 is a choice (it was read as "not given": 5); a count below 1 gets the flag
    named, not a ZeroDivisionError from the first run or torch's "negative dimension"."""
    assert benchmark.parse_args(["--quick", "--warmup", "0"]).warmup == 0
    assert benchmark.parse_args([]).warmup == 5
    for flag, value in (("--steps", "0"), ("--knob-hidden", "-5"), ("--repeats", "0"),
                        ("--nproc", "0"), ("--warmup", "-1")):  # fmt: skip
        with pytest.raises(SystemExit):
            benchmark.parse_args([flag, value])
        assert f"{flag} must be" in capsys.readouterr().err, flag
    with pytest.raises(SystemExit):  # the template's recorder leaves 5 steps out: none timed
        benchmark.parse_args(["--steps", "2", "--warmup", "1"])
    assert "or --no-template" in capsys.readouterr().err


def test_fewer_gpus_than_ranks_put_every_run_on_the_cpu(benchmark, nvml, monkeypatch, capsys):
    """One GPU, two ranks: gloo, and the GPUs hidden from every launch; else the one-rank
    launch (ddp_world1) chose nccl on cuda:0 for itself and was compared with CPU runs."""
    from conftest import fake_gpu
    from ddp_tutorial import settings

    for name in (settings.VISIBLE_DEVICES_ENV, settings.BACKEND_ENV, settings.DEVICE_ORDER_ENV):
        monkeypatch.setenv(name, "")  # restored (or removed again) after the test
        monkeypatch.delenv(name)
    nvml([fake_gpu(i) for i in range(2)])
    assert benchmark.device_plan(2) == 2 and settings.VISIBLE_DEVICES_ENV not in os.environ
    assert benchmark.device_plan(1) == 1
    assert os.environ[settings.DEVICE_ORDER_ENV] == "PCI_BUS_ID", "the plain runs' cuda:0 too"
    nvml([fake_gpu(0)])
    assert benchmark.device_plan(2) == 0
    assert os.environ[settings.VISIBLE_DEVICES_ENV] == "" and settings.backend() == "gloo"
    assert "1 GPU(s) for 2 local ranks" in capsys.readouterr().out
    monkeypatch.setenv(settings.BACKEND_ENV, "gloo")  # helper 89: MIG with gloo asked for
    monkeypatch.delenv(settings.VISIBLE_DEVICES_ENV)  # every GPU visible again
    nvml([fake_gpu(i, mig=True) for i in range(2)])
    assert benchmark.device_plan(2) == 0, "the CPU plan, not a MigError"


@pytest.mark.torchrun
def test_one_rank_reports_the_run_its_figures_come_from(tmp_path):
    """One GPU (lesson 07's default there is one rank): ddp_world1 and ddp_world{n} are the
    same key, and the N-rank run overwrote the one-rank run the figures were computed from:
    ddp_overhead 0.259 against 0.239 recomputed, scaling 1.016 of itself (measured). Lesson
    07's identities, on a real run with --nproc 1."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--quick", "--nproc", "1",
           "--no-template", "--no-knobs", "--repeats", "1", "--steps", "2", "--warmup", "1",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    batch = result["config"]["batch_size"]
    rates = {k: batch * result[k]["steps"] / result[k]["seconds"]
             for k in ("plain_1thread", "ddp_world1")}  # fmt: skip
    assert math.isclose(result["ddp_overhead"], rates["plain_1thread"] / rates["ddp_world1"] - 1)
    assert math.isclose(result["scaling_efficiency"], 1.0)


def test_the_concurrent_processes_wait_for_each_other_at_the_gate(benchmark, tmp_path):
    """The ceiling's processes start their timed steps together: one ready alone waits for the
    other, and a partner that never comes is named, not waited on for ever."""
    import threading
    import time

    gate = tmp_path / "gate"
    late = threading.Timer(0.3, lambda: (gate / "partner").touch())
    start = time.monotonic()
    late.start()
    benchmark.wait_at_gate(gate, 2)
    assert time.monotonic() - start >= 0.3
    late.join()
    with pytest.raises(RuntimeError, match="never reached"):
        benchmark.wait_at_gate(tmp_path / "alone", 2, timeout_s=0.05)
