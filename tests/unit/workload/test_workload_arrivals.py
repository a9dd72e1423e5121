"""Tests of the synthetic arrival processes and synthetic traces."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coral.workload import AZURE_CODE_LENGTHS, gamma_arrivals, poisson_arrivals, synthesize


def gaps_cv(arrival: np.ndarray) -> float:
    gaps = np.diff(arrival)
    return float(gaps.std() / gaps.mean())


def test_poisson_count_rate_and_cv():
    arrival = poisson_arrivals(50.0, 400.0, np.random.default_rng(1))
    # Expected 20,000 arrivals, standard deviation sqrt(20000) = 141; allow 5 sigma.
    assert abs(len(arrival) - 20_000) < 5 * 141
    assert 1.0 == pytest.approx(gaps_cv(arrival), abs=0.03)
    assert arrival[0] >= 0 and arrival[-1] < 400.0
    assert np.all(np.diff(arrival) >= 0)


def test_same_seed_same_arrivals_different_seed_different():
    first = poisson_arrivals(3.0, 100.0, np.random.default_rng(42))
    assert first.tolist() == poisson_arrivals(3.0, 100.0, np.random.default_rng(42)).tolist()
    assert first.tolist() != poisson_arrivals(3.0, 100.0, np.random.default_rng(43)).tolist()


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv_and_rate(cv):
    arrival = gamma_arrivals(20.0, 2000.0, cv, np.random.default_rng(2))
    assert cv == pytest.approx(gaps_cv(arrival), rel=0.1)
    # Counts of a renewal process vary with variance ~ cv^2 * expected; 5 sigma.
    expected = 40_000
    assert abs(len(arrival) - expected) < 5 * cv * math.sqrt(expected)


def test_gamma_cv_one_is_exactly_poisson():
    assert (poisson_arrivals(5.0, 60.0, np.random.default_rng(9)).tolist()
            == gamma_arrivals(5.0, 60.0, 1.0, np.random.default_rng(9)).tolist())


def test_gamma_cv_zero_is_evenly_spaced():
    assert [0.5, 1.0, 1.5] == gamma_arrivals(2.0, 2.0, 0.0, np.random.default_rng(0)).tolist()


def test_zero_rate_or_duration_gives_no_arrivals():
    rng = np.random.default_rng(0)
    assert 0 == len(poisson_arrivals(0.0, 10.0, rng)) == len(poisson_arrivals(5.0, 0.0, rng))


@pytest.mark.parametrize(("rate", "duration", "cv"), [(-1, 10, 1), (1, float("nan"), 1), (1, 10, -0.5)])
def test_bad_numbers_are_rejected(rate, duration, cv):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        gamma_arrivals(rate, duration, cv, np.random.default_rng(0))


def test_synthesize_is_seeded_and_has_the_window():
    def make(seed):
        return synthesize(name="s", rate_per_s=4.0, duration_s=30.0, lengths=AZURE_CODE_LENGTHS,
                          rng=np.random.default_rng(seed), arrival="gamma", cv=2.0)

    trace = make(1)
    assert trace == make(1)
    assert trace != make(2)
    assert 30.0 == trace.duration_s
    assert len(trace) == len(trace.prompt_tokens) == len(trace.output_tokens) > 0


def test_synthesize_unknown_process():
    with pytest.raises(ValueError, match="unknown arrival process 'uniform'"):
        synthesize(name="s", rate_per_s=1, duration_s=1, lengths=AZURE_CODE_LENGTHS,
                   rng=np.random.default_rng(0), arrival="uniform")
