"""The queueing model behind plan capacity: closed forms, the recursions, the sizing and the forecast."""
import math

import numpy as np
import pytest

from coral.allocator.capacity import (
    decode_capacity,
    erlang_c,
    fcfs_waits,
    fluid_waits,
    prefill_capacity,
)
from coral.allocator.demand import Forecaster
from coral.errors import CoralError
from coral.slo import component_quantile


def test_erlang_c_hand_values():
    # M/M/1: P(wait) = rho. M/M/2 at a = 1: C = (a^2/2 * 2/(2-1)) / (1 + a + a^2/2 * 2) = 1 / 3
    assert erlang_c(1, 0.7) == pytest.approx(0.7)
    assert erlang_c(2, 1.0) == pytest.approx(1.0 / 3.0)
    with pytest.raises(ValueError, match="offered load"):
        erlang_c(2, 2.0)


def test_fcfs_recursion_matches_erlang_c_on_mmc():
    # M/M/3, lambda = 2.4, mu = 1: P(wait) and the mean wait C / (c mu - lambda) from Erlang C
    rng = np.random.default_rng(0)
    n, lam, c = 200_000, 2.4, 3
    arr = np.cumsum(rng.exponential(1 / lam, n))
    w = fcfs_waits(arr, rng.exponential(1.0, n), c)[5000:]
    pw = erlang_c(c, lam)
    assert float(np.mean(w > 0)) == pytest.approx(pw, rel=0.03)
    assert float(np.mean(w)) == pytest.approx(pw / (c - lam), rel=0.05)


def test_fluid_lindley_hand_case():
    # work 2, 2, 2 arriving at 0, 1, 5 on a rate-1 server: waits 0, 1, 0
    assert fluid_waits(np.array([0.0, 1.0, 5.0]), np.array([2.0, 2.0, 2.0]), 1.0).tolist() == [0.0, 1.0, 0.0]


def test_prefill_capacity_grows_with_burstiness_and_meets_its_quantile():
    rng = np.random.default_rng(1)
    n = 4000
    smooth = np.sort(rng.uniform(0, 400, n))
    bursty = np.sort(np.concatenate([rng.uniform(0, 400, n // 2), rng.uniform(100, 104, n // 2)]))
    p = np.full(n, 1000)
    kw = dict(window_s=400.0, ttft_s=1.0, budget_s=0.5, prompt_q=1000.0, attainment=0.95)
    a, b = prefill_capacity(smooth, p, **kw), prefill_capacity(bursty, p, **kw)
    assert a.mean_tok_per_s == pytest.approx(b.mean_tok_per_s) == pytest.approx(10_000)
    assert b.capacity_tok_per_s > 3 * a.capacity_tok_per_s
    for t, arr in ((a, smooth), (b, bursty)):  # the returned capacity attains; 5 % less does not
        assert t.predicted_attainment >= 0.95
        assert np.mean(fluid_waits(arr, p, t.capacity_tok_per_s * 0.95) + 0.5 <= 1.0) < 0.95


def test_unreachable_targets_name_the_model_and_the_fix():
    arr, p = np.arange(100.0), np.full(100, 1000)
    with pytest.raises(CoralError, match=r"model m: the p95 TTFT is 2 s with no queueing .* relax ttft_ms"):
        prefill_capacity(arr, p, window_s=100.0, ttft_s=1.0, budget_s=2.0, prompt_q=1000.0, attainment=0.95, model="m")
    with pytest.raises(CoralError, match=r"model m: the p95 TPOT is .* faster NICs"):
        decode_capacity(arr, p, np.full(100, 3), window_s=100.0, tpot_s=0.05, cadence_s=0.04, kv_s_per_token=1e-4,
                        kv_latency_s=0.0, attainment=0.95, model="m")


def test_decode_capacity_counts_the_kv_transfer():
    rng = np.random.default_rng(2)
    arr = np.sort(rng.uniform(0, 100, 1000))
    p, d = np.full(1000, 2000), np.full(1000, 11)
    kw = dict(window_s=100.0, tpot_s=0.1, cadence_s=0.05, kv_latency_s=0.0, attainment=0.95)
    fast = decode_capacity(arr, p, d, kv_s_per_token=0.0, **kw)
    # 2000 tokens at 1e-5 s = 20 ms over 10 steps: 2 ms per token; the quantile TPOT rises by it
    slow = decode_capacity(arr, p, d, kv_s_per_token=1e-5, **kw)
    assert slow.quantile_latency_s >= fast.quantile_latency_s + 0.002 - 1e-9
    assert fast.mean_tok_per_s == pytest.approx(110.0)  # 1000 requests x 11 output tokens over 100 s


def test_component_quantile_splits_the_misses():
    assert component_quantile(0.95) == pytest.approx(0.975)


def test_forecast_follows_a_step_up_at_once_and_a_small_drop_not_at_all():
    f = Forecaster(quantile=0.9, alpha=0.5, scale_down_margin=0.15)
    assert f.update({"m": 10.0})["m"] >= 10.0  # no history: above the observation
    for _ in range(5):
        steady = f.update({"m": 10.0})["m"]
    assert steady >= 10.0
    up = f.update({"m": 20.0})["m"]
    assert up >= 20.0  # never below what was just seen
    held = f.update({"m": 19.0})["m"]
    assert held >= up  # within the 15 % margin the capacity does not come down (hysteresis)
    for _ in range(8):
        low = f.update({"m": 5.0})["m"]
    assert 5.0 <= low < 0.85 * up  # a clear drop does come down
    assert math.isfinite(low)


def test_forecast_of_a_burst_is_above_its_mean():
    f = Forecaster(quantile=0.9)
    seen = [f.update({"m": x})["m"] for x in (10, 10, 30, 10, 10)]
    assert seen[2] >= 30 and seen[3] > 10  # after a burst the forecast stays up for an epoch


def test_prefill_capacity_in_whole_instances_waits_for_a_whole_instance():
    rng = np.random.default_rng(3)
    n = 3000
    arr = np.sort(rng.uniform(0, 300, n))
    p = np.full(n, 4000)  # 40 k tok/s offered; one instance clears a prompt in 0.4 s at 10 k tok/s
    kw = dict(window_s=300.0, ttft_s=1.0, budget_s=0.5, prompt_q=4000.0, attainment=0.95)
    pooled = prefill_capacity(arr, p, **kw)
    whole = prefill_capacity(arr, p, instance_tok_per_s=10_000.0, **kw)
    servers = whole.capacity_tok_per_s / 10_000.0
    assert servers == int(servers) and whole.predicted_attainment >= 0.95
    # one server fewer misses the target; whole instances never need less than one pooled server (to the bisection)
    fewer = fcfs_waits(arr, p / 10_000.0, int(servers) - 1) + 0.5
    assert np.mean(fewer <= 1.0) < 0.95
    assert whole.capacity_tok_per_s >= 0.99 * pooled.capacity_tok_per_s


def test_a_window_beyond_reach_is_sized_for_what_latency_allows_not_refused():
    arr, p = np.arange(100.0), np.full(100, 1000)
    t = prefill_capacity(arr, p, window_s=100.0, ttft_s=1.0, budget_s=2.0, prompt_q=1000.0, attainment=0.95,
                         strict=False)
    # every request takes 2 s alone: nothing reaches a 1 s TTFT, and no capacity is bought for it
    assert t.predicted_attainment == 0.0 and t.capacity_tok_per_s == pytest.approx(t.mean_tok_per_s)


def test_a_model_with_no_traffic_gets_no_capacity_but_its_templates_still_have_lengths(tmp_path):
    import yaml

    from coral.allocator.demand import capacity_targets
    from coral.perf.model import Phase
    from coral.scenario import load_scenario
    from coral.templates.planning import plan_inputs

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "idle", "configs": ["1xL40S", "4xL40S"], "regions": [{"name": "aws:us-east-2"}],
        "models": [{"name": "phi-4", "ttft_ms": 3000, "tpot_ms": 150, "workload": {
            "rate_per_s": 1e-6, "dataset": "synthetic", "prompt_tokens_mean": 500, "output_tokens_mean": 50}}]}))
    s = load_scenario(str(path))
    planning = plan_inputs(s).of("phi-4")
    assert planning.lengths.requests > 100  # drawn at 1 req/s for the lengths
    assert len(planning.history) < 10  # while the history is at the model's own rate
    targets = capacity_targets(s)
    assert targets[("phi-4", Phase.PREFILL)].capacity_tok_per_s == 0.0
    assert targets[("phi-4", Phase.DECODE)].capacity_tok_per_s == 0.0
