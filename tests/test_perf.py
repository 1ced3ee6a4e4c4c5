"""The benchmark: derived figures and the ring-model fit on fixed inputs; --quick end to end."""

from __future__ import annotations

import pytest

from ddp_tutorial.lessons import perf


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
