"""Tests of the length distributions: lognormal maths, the Azure fits, fitting and empirical resampling."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.workload import (
    AZURE_CODE_LENGTHS,
    AZURE_CONV_LENGTHS,
    EmpiricalLengths,
    Lognormal,
    LognormalLengths,
    Trace,
)


def test_from_mean_median_by_hand():
    # median e^mu = 100 -> mu = ln 100 = 4.60517; mean/median = e^(sigma^2/2) = e^0.5 -> sigma = 1.
    dist = Lognormal.from_mean_median(100 * math.exp(0.5), 100)
    assert (pytest.approx(math.log(100)), pytest.approx(1.0)) == (dist.mu, dist.sigma)
    assert pytest.approx(100 * math.exp(0.5)) == dist.mean_tok
    assert pytest.approx(100.0) == dist.median_tok


def test_from_mean_median_rejects_mean_below_median():
    with pytest.raises(ValueError, match="cannot be below its median"):
        Lognormal.from_mean_median(10, 20)


# The module documents the published Azure statistics; the fits must reproduce them exactly
# (continuous distribution) and, sampled, to within sampling error.
@pytest.mark.parametrize(
    ("lengths", "prompt_mean", "prompt_median", "output_mean", "output_median"),
    [(AZURE_CODE_LENGTHS, 2047.8, 1469, 27.9, 13), (AZURE_CONV_LENGTHS, 1154.7, 1020, 211.1, 129)],
)
def test_azure_fits_reproduce_published_mean_and_median(lengths, prompt_mean, prompt_median, output_mean, output_median):
    assert pytest.approx(prompt_mean) == lengths.mean_prompt_tok
    assert pytest.approx(output_mean) == lengths.mean_output_tok
    assert pytest.approx(prompt_median) == lengths.prompt.median_tok
    assert pytest.approx(output_median) == lengths.output.median_tok
    prompt, output = lengths.sample(200_000, np.random.default_rng(7))
    # Sampling error of the mean is <= 0.5 % here (CV <= 1.9, n = 200k); rounding moves it by < 0.5 token.
    assert prompt_mean == pytest.approx(prompt.mean(), rel=0.02)
    assert output_mean == pytest.approx(output.mean(), rel=0.03)
    assert prompt_median == pytest.approx(np.median(prompt), rel=0.02)
    assert output_median == pytest.approx(np.median(output), rel=0.05)
    assert prompt.min() >= 1 and output.min() >= 1


def test_azure_code_sigmas_by_hand():
    # sigma = sqrt(2 ln(mean/median)): prompt sqrt(2 ln(2047.8/1469)) = 0.8151, output sqrt(2 ln(27.9/13)) = 1.2359.
    assert pytest.approx(0.8151, abs=1e-4) == AZURE_CODE_LENGTHS.prompt.sigma
    assert pytest.approx(1.2359, abs=1e-4) == AZURE_CODE_LENGTHS.output.sigma


def test_sampling_is_seeded():
    first = AZURE_CONV_LENGTHS.sample(100, np.random.default_rng(3))
    second = AZURE_CONV_LENGTHS.sample(100, np.random.default_rng(3))
    other = AZURE_CONV_LENGTHS.sample(100, np.random.default_rng(4))
    assert first[0].tolist() == second[0].tolist() and first[1].tolist() == second[1].tolist()
    assert first[0].tolist() != other[0].tolist()


def test_min_and_max_clip():
    dist = Lognormal(mu=math.log(100), sigma=3.0, min_tok=5, max_tok=200)
    values = dist.sample(10_000, np.random.default_rng(0))
    assert (5, 200) == (values.min(), values.max())


@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(mu=st.floats(3.0, 7.0), sigma=st.floats(0.1, 1.2))
def test_mle_fit_recovers_parameters(mu, sigma):
    values = Lognormal(mu=mu, sigma=sigma).sample(20_000, np.random.default_rng(11))
    fitted = Lognormal.fit(values, method="mle")
    # Medians of >= 20 tokens: rounding to whole tokens barely moves the logs (it does below ~5).
    assert mu == pytest.approx(fitted.mu, abs=0.05)
    assert sigma == pytest.approx(fitted.sigma, abs=0.05)


@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(mu=st.floats(5.0, 7.0), sigma=st.floats(0.3, 1.2))
def test_mean_median_fit_recovers_parameters(mu, sigma):
    # The sample median of whole tokens is off by up to half a token, which matters for small sigma
    # (sigma^2 = 2 ln(mean/median)); medians >= 148 tokens and sigma >= 0.3 keep that below 0.05.
    values = Lognormal(mu=mu, sigma=sigma).sample(20_000, np.random.default_rng(11))
    fitted = Lognormal.fit(values, method="mean-median")
    assert mu == pytest.approx(fitted.mu, abs=0.05)
    assert sigma == pytest.approx(fitted.sigma, abs=0.05)


def test_mean_median_fit_keeps_the_sample_mean():
    values = np.array([1, 2, 2, 3, 50, 400])
    fitted = Lognormal.fit(values)
    assert pytest.approx(values.mean()) == fitted.mean_tok
    assert pytest.approx(np.median(values)) == fitted.median_tok


def test_fit_of_left_skewed_data_falls_back_to_mle():
    values = np.array([1, 100, 100, 100])  # mean 75.25 < median 100
    logs = np.log(values)
    fitted = Lognormal.fit(values)
    assert (pytest.approx(logs.mean()), pytest.approx(logs.std())) == (fitted.mu, fitted.sigma)


def test_fit_to_trace_and_unknown_method():
    trace = Trace(name="t", arrival_s=[0, 1, 2], prompt_tokens=[10, 20, 90], output_tokens=[1, 2, 3])
    fitted = LognormalLengths.fit(trace)
    assert pytest.approx(40.0) == fitted.mean_prompt_tok
    with pytest.raises(ValueError, match="unknown fit method"):
        Lognormal.fit(trace.prompt_tokens, method="moments")


def test_empirical_resampling_keeps_pairs():
    trace = Trace(name="t", arrival_s=[0, 1, 2], prompt_tokens=[10, 20, 30], output_tokens=[1, 2, 3])
    prompt, output = EmpiricalLengths(source=trace).sample(1000, np.random.default_rng(5))
    assert {(10, 1), (20, 2), (30, 3)} == set(zip(prompt.tolist(), output.tolist(), strict=True))
    assert 1000 == len(prompt)


def test_empirical_needs_requests():
    with pytest.raises(ValueError, match="empty"):
        EmpiricalLengths(source=Trace(name="e", arrival_s=[], prompt_tokens=[], output_tokens=[]))
