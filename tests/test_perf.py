"""The benchmark: derived figures and the ring-model fit on fixed inputs; --quick end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS
from ddp_tutorial import perf


def test_percentile_matches_linear_interpolation():
    assert perf.percentile([1, 2, 3, 4], 50) == 2.5
    assert perf.percentile([10.0], 90) == 10.0
    assert perf.percentile([0, 10], 90) == pytest.approx(9.0)


def test_summarize_steps():
    s = perf.summarize_steps([0.1, 0.1, 0.2, 0.2], samples_per_step=64)
    assert s["samples_per_sec"] == pytest.approx(64 * 4 / 0.6)
    assert s["step_ms_p50"] == pytest.approx(150.0)


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
    times = [alpha + perf.ring_factor(n) * s / bandwidth for s in sizes]
    fit = perf.fit_ring_model(sizes, times, n)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["bandwidth_Bps"] == pytest.approx(bandwidth, rel=1e-6)
    assert fit["max_rel_error"] < 1e-6
    assert perf.bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)  # 2(N-1)/N = 1 for N=2


def test_benchmark_quick_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in (
        "plain_1thread",
        "plain_all_cores",
        "ddp_world1",
        "ddp_world2",
        "ddp_overhead",
        "scaling_efficiency",
        "speedup_vs_all_cores",
        "allreduce",
        "ring_fit",
        "knobs",
        "template",
        "machine",
        "hardware_ceiling",
    ):
        assert key in r, key
    for key in ("cores", "threads_per_rank", "torch", "backend", "device"):
        assert key in r["machine"]
    for key in ("samples_per_sec", "step_ms_p50", "step_ms_p90"):
        assert r["ddp_world2"][key] > 0
    # the derived figures are computed from the raw ones
    d = perf.derive(
        r["plain_1thread"]["samples_per_sec"],
        r["plain_all_cores"]["samples_per_sec"],
        r["ddp_world1"]["samples_per_sec"],
        r["ddp_world2"]["samples_per_sec"],
        2,
    )
    assert r["scaling_efficiency"] == pytest.approx(d["scaling_efficiency"])
    assert [a["bytes"] for a in r["allreduce"]][0] == 1024
    knobs = {k["knob"]: k for k in r["knobs"]}
    assert knobs["find_unused_parameters (not needed)"]["allreduces_per_step"] >= 1
    assert "ddp_overhead" in proc.stdout and "scaling_efficiency" in proc.stdout
