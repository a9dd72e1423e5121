"""Routing policies: weighted round-robin proportions, decode placement by region."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coral.runtime.routing import InstanceView, WeightedRoundRobin, pick_decode, pick_prefill


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_wrr_exact_proportions_over_a_window(weights: list[int]) -> None:
    wrr = WeightedRoundRobin({i: float(w) for i, w in enumerate(weights)})
    picks = Counter(wrr.pick() for _ in range(sum(weights) * 3))
    assert {i: 3 * w for i, w in enumerate(weights)} == dict(picks)


def test_wrr_interleaves_smoothly() -> None:
    wrr = WeightedRoundRobin({"a": 5.0, "b": 1.0, "c": 1.0})
    # nginx's smooth WRR example: a a b a c a a
    assert ["a", "a", "b", "a", "c", "a", "a"] == [wrr.pick() for _ in range(7)]


def test_wrr_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="positive"):
        WeightedRoundRobin({"a": 0.0})


def _view(i: str, phase: str, region: str, tp: float = 1.0) -> InstanceView:
    return InstanceView(instance_id=i, model="m", phase=phase, region=region, throughput_tok_per_s=tp)


def test_prefill_by_throughput_and_decode_same_region_first() -> None:
    views = [_view("p1", "prefill", "eu", 3.0), _view("p2", "mixed", "us", 1.0), _view("d-us", "decode", "us"), _view("d-eu", "decode", "eu")]
    wrr = WeightedRoundRobin({v.instance_id: v.throughput_tok_per_s for v in views})
    firsts = Counter(pick_prefill(views, wrr).instance_id for _ in range(8))  # type: ignore[union-attr]
    assert {"p1": 6, "p2": 2} == dict(firsts)
    assert all("d-eu" == pick_decode(views, "eu", wrr).instance_id for _ in range(5))  # type: ignore[union-attr]
    assert "d-us" == pick_decode(views, "us", wrr).instance_id  # type: ignore[union-attr]
    only_us = [v for v in views if v.instance_id != "d-eu"]
    assert "d-us" == pick_decode(only_us, "eu", wrr).instance_id  # type: ignore[union-attr]  # falls back across regions
    assert pick_decode([views[0]], "eu", wrr) is None
