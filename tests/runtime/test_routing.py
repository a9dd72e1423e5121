"""The router's choices are the shared policies of ``coral.policy`` (smooth WRR, decode same region first)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from coral.policy import SmoothWRR
from coral.runtime.serving.coordinator import InstanceView, RouteStates, pick_decode, pick_prefill


def _view(i: str, phase: str, region: str, tp: float = 1.0, index: int = 0) -> InstanceView:
    return InstanceView(instance_id=i, model="m", phase=phase, region=region, throughput_tok_per_s=tp, index=index)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_prefill_pick_is_the_policy_wrr(weights: list[int]) -> None:
    views = [_view(f"i{k}", "mixed", "r", float(w), k) for k, w in enumerate(weights)]
    states: RouteStates = {}
    picks = []
    for _ in range(sum(weights) * 3):
        v, states = pick_prefill(views, states)
        assert v is not None
        picks.append(v.index)
    wrr = SmoothWRR([float(w) for w in weights])
    assert [wrr.pick() for _ in picks] == picks  # same sequence as the shared policy
    assert {k: 3 * w for k, w in enumerate(weights)} == dict(Counter(picks))


def test_prefill_by_throughput_and_decode_same_region_first() -> None:
    views = [_view("p1", "prefill", "eu", 3.0, 1), _view("p2", "mixed", "us", 1.0, 2), _view("d-us", "decode", "us", 1.0, 3), _view("d-eu", "decode", "eu", 1.0, 4)]
    states: RouteStates = {}
    firsts = Counter()
    for _ in range(8):
        v, states = pick_prefill(views, states)
        firsts[v.instance_id] += 1  # type: ignore[union-attr]
    assert {"p1": 6, "p2": 2} == dict(firsts)
    for _ in range(5):
        d, states = pick_decode(views, "eu", states)
        assert "d-eu" == d.instance_id  # type: ignore[union-attr]
    d, states = pick_decode(views, "us", states)
    assert "d-us" == d.instance_id  # type: ignore[union-attr]
    only_us = [v for v in views if v.instance_id != "d-eu"]
    d, states = pick_decode(only_us, "eu", states)
    assert "d-us" == d.instance_id  # type: ignore[union-attr]  # falls back across regions
    assert (None, states) == pick_decode([views[0]], "eu", states)
    assert (None, {}) == pick_prefill([views[2]], {})


def test_least_work_routing_is_the_policy_the_simulator_uses():
    # A has 6,000 prompt tokens queued at 1,000 tok/s (6 s to clear), B 1,000 at 500 tok/s (2 s):
    # a 1,000-token prompt finishes first on B (4 s) rather than A (7 s), whatever the weights say.
    views = [InstanceView(instance_id="a", model="m", phase="prefill", region="us", throughput_tok_per_s=1000.0, index=0),
             InstanceView(instance_id="b", model="m", phase="prefill", region="us", throughput_tok_per_s=500.0, index=1),
             InstanceView(instance_id="d1", model="m", phase="decode", region="us", throughput_tok_per_s=100.0, index=2),
             InstanceView(instance_id="d2", model="m", phase="decode", region="eu", throughput_tok_per_s=100.0, index=3),
             InstanceView(instance_id="d3", model="m", phase="decode", region="us", throughput_tok_per_s=200.0, index=4)]
    v, states = pick_prefill(views, {}, load={"a": 6000.0, "b": 1000.0}, new_work=1000.0)
    assert v is not None and v.instance_id == "b" and states == {}
    # decode: same region first, least held per unit of throughput: d3 holds 3 at 200 (2 / 100 after one more)
    d, _ = pick_decode(views, "us", {}, held={"d1": 2.0, "d3": 3.0})
    assert d is not None and d.instance_id == "d3"
    d, _ = pick_decode(views, "eu", {}, held={"d2": 50.0})
    assert d is not None and d.instance_id == "d2"
