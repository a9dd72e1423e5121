"""Tests of trace transformations: rate scaling, cutting, rotating, tiling, replay, thinning, assignment."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.workload import (
    Trace,
    assign_datasets,
    cut,
    load_azure,
    replay,
    rotate,
    scale_time,
    scale_to_rate,
    thin,
    tile,
)


def make(arrival, window_s=None) -> Trace:
    n = len(arrival)
    return Trace(name="t", arrival_s=arrival, prompt_tokens=np.arange(n) + 100, output_tokens=np.arange(n) + 1,
                 window_s=window_s)


def pairs(trace: Trace) -> Counter:
    return Counter(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist(), strict=True))


def test_scale_to_rate_by_hand():
    # 4 requests over a 4 s window = 1 req/s; at 2 req/s every time halves.
    scaled = scale_to_rate(make([0.0, 1.0, 2.0, 3.0], window_s=4.0), 2.0)
    assert [0.0, 0.5, 1.0, 1.5] == scaled.arrival_s.tolist()
    assert (2.0, 2.0) == (scaled.duration_s, scaled.rate_per_s)
    assert [100, 101, 102, 103] == scaled.prompt_tokens.tolist()


def test_scale_to_rate_on_the_azure_trace(traces_dir: Path):
    trace = load_azure(traces_dir / "azure_llm_2023_conv.csv.gz").trace
    scaled = scale_to_rate(trace, 25.0)
    assert 25.0 == pytest.approx(scaled.rate_per_s)
    assert len(trace) == len(scaled)


def test_scale_to_rate_rejects_bad_input():
    with pytest.raises(ValueError, match="target rate_per_s"):
        scale_to_rate(make([0.0, 1.0]), 0.0)
    with pytest.raises(ValueError, match="no arrival rate"):
        scale_to_rate(make([0.0]), 1.0)
    with pytest.raises(ValueError, match="factor"):
        scale_time(make([0.0, 1.0]), -2.0)


def test_cut_rebases_and_sets_window():
    trace = make([float(t) for t in range(10)], window_s=10.0)
    window = cut(trace, 2.5, 6.0)
    assert [0.5, 1.5, 2.5] == window.arrival_s.tolist()  # 3, 4, 5 (6 is excluded)
    assert [103, 104, 105] == window.prompt_tokens.tolist()
    assert 3.5 == window.duration_s
    assert 2.0 == cut(trace, 8.0, 100.0).duration_s  # clipped to the trace's end
    with pytest.raises(ValueError, match="must be >= start_s"):
        cut(trace, 5.0, 1.0)


def test_rotate_by_hand():
    rotated = rotate(make([0.0, 1.0, 2.0, 3.0], window_s=4.0), 1.5)
    assert [0.5, 1.5, 2.5, 3.5] == rotated.arrival_s.tolist()
    assert [102, 103, 100, 101] == rotated.prompt_tokens.tolist()
    assert 4.0 == rotated.duration_s


def test_tile_by_hand():
    tiled = tile(make([0.0, 1.0], window_s=2.0), 5.0)
    assert [0.0, 1.0, 2.0, 3.0, 4.0] == tiled.arrival_s.tolist()
    assert [100, 101, 100, 101, 100] == tiled.prompt_tokens.tolist()
    assert 5.0 == tiled.duration_s


arrivals = st.lists(st.floats(0, 1000, allow_nan=False), min_size=2, max_size=40).map(sorted).filter(
    lambda a: a[-1] > 0)


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(arrival=arrivals, offset=st.floats(-5000, 5000, allow_nan=False))
def test_rotate_keeps_every_request_and_the_window(arrival, offset):
    trace = make(arrival)
    rotated = rotate(trace, offset)
    assert pairs(trace) == pairs(rotated)
    assert trace.duration_s == rotated.duration_s
    assert np.all(np.diff(rotated.arrival_s) >= 0)


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(arrival=arrivals, copies=st.integers(1, 5))
def test_tile_to_whole_periods_repeats_every_request(arrival, copies):
    trace = make(arrival, window_s=arrival[-1] + 1.0)
    tiled = tile(trace, copies * trace.duration_s)
    assert copies * len(trace) == len(tiled)
    assert Counter({k: copies * v for k, v in pairs(trace).items()}) == pairs(tiled)


def test_replay_for_the_scaled_duration_keeps_every_request(traces_dir: Path):
    trace = load_azure(traces_dir / "azure_llm_2023_code.csv.gz").trace
    rate = 20.0
    full = len(trace) / rate  # the scaled trace's duration
    replayed = replay(trace, rate_per_s=rate, duration_s=full, offset_s=1234.5)
    assert len(trace) == len(replayed)
    assert pairs(trace) == pairs(replayed)
    assert rate == pytest.approx(replayed.rate_per_s)
    twice = replay(trace, rate_per_s=rate, duration_s=2 * full)
    assert 2 * len(trace) == len(twice)


def test_replay_at_zero_rate_is_empty():
    empty = replay(make([0.0, 1.0]), rate_per_s=0.0, duration_s=10.0)
    assert (0, 10.0) == (len(empty), empty.duration_s)


def test_thin_keeps_the_expected_share():
    trace = make(np.linspace(0, 100, 20_001))
    half = thin(trace, lambda t: np.where(t < 50, 1.0, 0.0), np.random.default_rng(0))
    assert 10_000 == len(half)  # t = 0, 0.005, ..., 49.995
    coin = thin(trace, lambda t: np.full_like(t, 0.25), np.random.default_rng(0))
    # Binomial(20001, 0.25): sd 61; allow 5 sd.
    assert abs(len(coin) - 5000) < 5 * 61
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        thin(trace, lambda t: np.full_like(t, 1.5), np.random.default_rng(0))


def test_assign_datasets_round_robin():
    assert {"a": "code", "b": "conv", "c": "code", "d": "conv", "e": "code"} == assign_datasets(
        ["a", "b", "c", "d", "e"], ["code", "conv"])
    with pytest.raises(ValueError, match="at least one dataset"):
        assign_datasets(["a"], [])
