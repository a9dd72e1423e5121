"""The spot discount rule (issue 30) on a hand-computed case, and its limits."""
from __future__ import annotations

import math

import pytest

from coral.allocator.spot import (
    discounted_capacity_tok_per_s,
    effective_nodes,
    spot_discount,
    survival_probability,
)
from coral.catalog import SpotProcess

PROCESS = SpotProcess(preemption_per_node_h=0.4, co_loss_share=0.5, availability=0.6, recovery_s=3600.0, source="test")


def test_two_templates_by_hand():
    """Rate r = 0.4 per node-hour, co-loss share rho = 0.5, epoch 360 s, init 120 s.
    Window T = (360 + 120) / 3600 = 0.13333 h. (The availability, 0.6, is reported, not multiplied
    in: the plan rents only pools it can have now.)

    Template A, 1 node, 1,000 tok/s: n_eff = 1; r T n_eff = 0.053333; survival e^-0.053333 = 0.948064
        (1 - 0.053333 + 0.001422 - 0.000025); counts 948.06 tok/s.
    Template B, 4 nodes, 5,000 tok/s: n_eff = 1 + 0.5 x 3 = 2.5; r T n_eff = 0.133333;
        survival e^-0.133333 = 0.875173; counts 4,375.87 tok/s.
    """
    a = spot_discount(1, PROCESS, epoch_s=360, init_s=120)
    b = spot_discount(4, PROCESS, epoch_s=360, init_s=120)
    assert (480.0, 480.0) == (a.window_s, b.window_s)
    assert pytest.approx(0.948064, abs=1e-6) == a.survival
    assert pytest.approx(0.948064, abs=1e-6) == a.factor
    assert pytest.approx(0.875173, abs=1e-6) == b.survival
    assert pytest.approx(0.875173, abs=1e-6) == b.factor
    assert (0.6, 0.6) == (a.availability, b.availability)
    assert pytest.approx(948.06, abs=0.01) == discounted_capacity_tok_per_s(1000, 1, PROCESS, 360, 120)
    assert pytest.approx(4375.87, abs=0.01) == discounted_capacity_tok_per_s(5000, 4, PROCESS, 360, 120)


def test_correlation_bounds():
    # rho = 0: independent nodes, exp(-r T n); rho = 1: one event takes all, exp(-r T)
    assert pytest.approx(math.exp(-0.4 * 1 * 4)) == survival_probability(4, 0.4, 0.0, 3600)
    assert pytest.approx(math.exp(-0.4)) == survival_probability(4, 0.4, 1.0, 3600)
    assert 1.0 == survival_probability(8, 0.0, 0.3, 3600)
    assert pytest.approx(3.1) == effective_nodes(4, 0.3)


def test_more_nodes_never_survive_better():
    probs = [survival_probability(n, 0.39, 0.88, 480) for n in range(1, 9)]
    assert probs == sorted(probs, reverse=True)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: survival_probability(2, -0.1, 0.5, 60), "preemption_per_node_h must be a finite number >= 0"),
    (lambda: survival_probability(2, 0.1, 1.5, 60), r"co_loss_share must be in \[0, 1\]"),
    (lambda: survival_probability(0, 0.1, 0.5, 60), "nodes must be >= 1"),
    (lambda: spot_discount(2, PROCESS, epoch_s=0, init_s=0), "epoch_s must be a finite number > 0"),
    (lambda: spot_discount(2, PROCESS, epoch_s=60, init_s=-1), "init_s must be a finite number >= 0"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
