"""Tests of demand shifts: multipliers, large-/small-heavy splits and thinning to a shifted rate."""
from __future__ import annotations

import numpy as np
import pytest

from coral.workload import (
    AZURE_CONV_LENGTHS,
    ConstantShift,
    DiurnalShift,
    ProductShift,
    StepShift,
    apply_shift,
    combine,
    heavy_split_multipliers,
    synthesize,
)


def test_step_multiplier_and_peak():
    step = StepShift(at_s=10.0, factor=3.0)
    assert [1.0, 1.0, 3.0, 3.0] == step.multiplier(np.array([0.0, 9.9, 10.0, 50.0])).tolist()
    assert (1.0, 3.0) == (step.peak(10.0), step.peak(11.0))
    assert 0.5 == StepShift(at_s=0.0, factor=0.5).peak(100.0)
    assert 1.0 == StepShift(at_s=5.0, factor=0.5).peak(100.0)


def test_diurnal_multiplier():
    day = DiurnalShift(period_s=100.0, amplitude=0.5)
    assert pytest.approx([1.0, 1.5, 1.0, 0.5]) == day.multiplier(np.array([0.0, 25.0, 50.0, 75.0])).tolist()
    assert 1.0 == pytest.approx(day.multiplier(np.linspace(0, 100, 10_000, endpoint=False)).mean())
    with pytest.raises(ValueError, match="amplitude"):
        DiurnalShift(period_s=10.0, amplitude=1.5)


def test_product_and_combine():
    product = ProductShift(parts=(StepShift(at_s=1.0, factor=2.0), ConstantShift(factor=3.0)))
    assert [3.0, 6.0] == product.multiplier(np.array([0.0, 2.0])).tolist()
    assert 6.0 == product.peak(5.0)
    assert ConstantShift(factor=6.0) == combine(ConstantShift(factor=2.0), ConstantShift(factor=3.0))
    step = StepShift(at_s=1.0, factor=2.0)
    assert step == combine(ConstantShift(), step)


def test_heavy_split_equal_rates_by_hand():
    # 3 models x 10 req/s = 30 total; the heavy one gets 0.8 * 30 = 24 (x2.4), the others 6 / 2 = 3 each (x0.3).
    factors = heavy_split_multipliers({"big": 10.0, "s1": 10.0, "s2": 10.0}, ["big"])
    assert pytest.approx({"big": 2.4, "s1": 0.3, "s2": 0.3}) == factors


def test_heavy_split_keeps_proportions_within_groups():
    rates = {"big": 10.0, "s1": 5.0, "s2": 15.0}
    factors = heavy_split_multipliers(rates, ["s1", "s2"], heavy_share=0.8)
    shifted = {m: rates[m] * factors[m] for m in rates}
    # Total 30: smalls get 24 split 1:3 -> 6 and 18; big gets 6.
    assert pytest.approx({"big": 6.0, "s1": 6.0, "s2": 18.0}) == shifted


@pytest.mark.parametrize(
    ("heavy", "share", "match"),
    [(["nope"], 0.8, "not among the models"), ([], 0.8, "at least one"), (["a"], 1.2, r"in \[0, 1\]"),
     (["a", "b"], 0.8, "leave at least one")],
)
def test_heavy_split_errors(heavy, share, match):
    with pytest.raises(ValueError, match=match):
        heavy_split_multipliers({"a": 1.0, "b": 1.0}, heavy, share)


def test_apply_step_shift_by_thinning():
    # Base rate 10 req/s doubling at 500 s: generate at the peak (20 req/s), thin before 500 s by half.
    shift = StepShift(at_s=500.0, factor=2.0)
    rng = np.random.default_rng(12)
    peak = synthesize(name="x", rate_per_s=10.0 * shift.peak(1000.0), duration_s=1000.0,
                      lengths=AZURE_CONV_LENGTHS, rng=rng)
    shifted = apply_shift(peak, shift, rng)
    before = int((shifted.arrival_s < 500).sum())
    after = len(shifted) - before
    # Poisson counts: 5000 (sd 71) before, 10000 (sd 100) after; 5 sd.
    assert abs(before - 5000) < 5 * 71
    assert abs(after - 10_000) < 5 * 100
    assert 1000.0 == shifted.duration_s


def test_constant_shift_keeps_everything_and_draws_nothing():
    rng = np.random.default_rng(1)
    trace = synthesize(name="x", rate_per_s=5.0, duration_s=10.0, lengths=AZURE_CONV_LENGTHS, rng=rng)
    state = rng.bit_generator.state
    assert trace == apply_shift(trace, ConstantShift(factor=0.3), rng)
    assert state == rng.bit_generator.state
