"""Smooth WRR, decode choice and the lifecycle state machine."""
from __future__ import annotations

import pytest

from coral.policy import (
    Candidate,
    Lifecycle,
    LifecycleEvent,
    SmoothWRR,
    choose_decode,
    next_state,
    wrr_next,
    wrr_start,
)


def _picks(weights, n):  # noqa: ANN001, ANN202
    state = wrr_start(weights)
    out = []
    for _ in range(n):
        i, state = wrr_next(state)
        out.append(i)
    return out


def test_wrr_nginx_sequence_and_exact_proportions() -> None:
    # nginx's example: weights 5, 1, 1 -> a a b a c a a, spread out, repeating every 7 picks
    assert _picks([5, 1, 1], 7) == [0, 0, 1, 0, 2, 0, 0]
    picks = _picks([3.0, 2.0, 1.0], 600)
    assert [picks.count(i) for i in range(3)] == [300, 200, 100]
    # every prefix stays within one pick of the ideal share
    for n in range(1, 601):
        for i, w in enumerate((3, 2, 1)):
            assert abs(picks[:n].count(i) - n * w / 6) < 1.0 + 1e-9


def test_wrr_fractional_weights_proportional() -> None:
    picks = _picks([6145.2, 31297.8, 7140.0], 10_000)
    total = 6145.2 + 31297.8 + 7140.0
    for i, w in enumerate((6145.2, 31297.8, 7140.0)):
        assert abs(picks.count(i) - 10_000 * w / total) <= 1.0


def test_smooth_wrr_class_matches_pure_function() -> None:
    w = [2.5, 1.0, 4.0, 0.5]
    wrr = SmoothWRR(w)
    assert [wrr.pick() for _ in range(200)] == _picks(w, 200)


def test_wrr_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        wrr_start([1.0, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        SmoothWRR([])


def test_decode_same_region_first_then_anywhere() -> None:
    cands = [Candidate(id=10, region="a", weight=1.0), Candidate(id=11, region="b", weight=3.0),
             Candidate(id=12, region="a", weight=1.0)]
    states: dict = {}
    got = []
    for _ in range(4):
        k, states = choose_decode(cands, "a", states)
        got.append(k)
    assert got == [10, 12, 10, 12]  # never region b while region a has one
    got = []
    for _ in range(5):
        k, states = choose_decode(cands, "c", states)
        got.append(k)
    assert sorted(got) == [10, 11, 11, 11, 12]  # no instance in c: WRR over all, 1:3:1 per 5 picks
    before = dict(states)
    choose_decode(cands, "a", states)
    assert states == before  # pure: the caller's state is not modified
    assert choose_decode([], "a", states) == (None, states)


def test_lifecycle_transitions() -> None:
    S, E = Lifecycle, LifecycleEvent
    assert next_state(S.STARTING, E.READY, in_flight=0) is S.ACTIVE
    assert next_state(S.STARTING, E.REMOVE, in_flight=0) is S.STOPPED
    assert next_state(S.ACTIVE, E.REMOVE, in_flight=3) is S.DRAINING
    assert next_state(S.ACTIVE, E.REMOVE, in_flight=0) is S.STOPPED
    assert next_state(S.DRAINING, E.IDLE, in_flight=1) is S.DRAINING
    assert next_state(S.DRAINING, E.IDLE, in_flight=0) is S.STOPPED
    assert next_state(S.DRAINING, E.READY, in_flight=0) is S.DRAINING
    assert next_state(S.STOPPED, E.READY, in_flight=0) is S.STOPPED
    assert next_state(S.ACTIVE, E.IDLE, in_flight=0) is S.ACTIVE
    with pytest.raises(ValueError, match="in_flight"):
        next_state(S.ACTIVE, E.REMOVE, in_flight=-1)


def test_lifecycle_drain_waits_for_the_holders_idle_and_fail_ends_any_live_state() -> None:
    S, E = Lifecycle, LifecycleEvent
    # DRAIN: the runtime's coordinator does not know what the instance holds until it says so
    assert next_state(S.ACTIVE, E.DRAIN, in_flight=0) is S.DRAINING
    assert next_state(S.ACTIVE, E.DRAIN, in_flight=4) is S.DRAINING
    assert next_state(S.STARTING, E.DRAIN, in_flight=0) is S.STOPPED  # holds nothing yet
    assert next_state(S.DRAINING, E.DRAIN, in_flight=2) is S.DRAINING
    for live in (S.STARTING, S.ACTIVE, S.DRAINING):
        assert next_state(live, E.FAIL, in_flight=1) is S.FAILED
    assert next_state(S.STOPPED, E.FAIL, in_flight=0) is S.STOPPED
    assert next_state(S.FAILED, E.READY, in_flight=0) is S.FAILED
