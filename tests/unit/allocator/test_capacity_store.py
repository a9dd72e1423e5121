"""Capacity targets kept on disk: the same targets as computing them, keyed by content, and the
faster FCFS recursion giving the same waits as the plain one."""
import heapq
import json

import numpy as np
import pytest

from coral.allocator import capacity_store, demand
from coral.allocator.capacity import fcfs_waits
from coral.scenario import load_scenario


def _reference_waits(arrival_s, service_s, servers):
    """The textbook Kiefer–Wolfowitz recursion, one pop and one push per request."""
    out = np.zeros(len(arrival_s))
    if servers >= len(arrival_s):
        return out
    free = [0.0] * servers
    for i, (a, s) in enumerate(zip(arrival_s, service_s, strict=True)):
        f = heapq.heappop(free)
        start = max(f, a)
        out[i] = start - a
        heapq.heappush(free, start + s)
    return out


def test_fcfs_waits_hand_case():
    # 2 servers; jobs of 3 s at 0, 0, 1, 2: the third waits for the first to finish at 3 (2 s),
    # the fourth for the second at 3 (1 s)
    assert fcfs_waits(np.array([0.0, 0.0, 1.0, 2.0]), np.full(4, 3.0), 2).tolist() == [0.0, 0.0, 2.0, 1.0]


@pytest.mark.parametrize("servers", [1, 3, 17])
def test_fcfs_waits_equal_the_reference_recursion_bit_for_bit(servers):
    rng = np.random.default_rng(servers)
    arr = np.sort(rng.uniform(0, 100, 3000))
    svc = rng.lognormal(0, 1, 3000)
    assert np.array_equal(fcfs_waits(arr, svc, servers), _reference_waits(arr, svc, servers))


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CORAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CORAL_CAPACITY_CACHE", raising=False)
    demand._MEMO.clear()
    yield tmp_path / "capacity"
    demand._MEMO.clear()


def test_stored_targets_equal_computed_ones_and_are_read_back_without_a_replay(store, monkeypatch, data_dir):
    s = load_scenario("core")
    computed = demand.capacity_targets(s, store=False)
    assert not store.exists()  # store=False writes nothing
    demand._MEMO.clear()
    first = demand.capacity_targets(s)  # computes and stores one entry per model
    assert len(list(store.glob("*.json"))) == len(s.models)
    assert first == computed
    demand._MEMO.clear()

    def no_replay(*a, **k):
        raise AssertionError("the stored targets should have been read")

    monkeypatch.setattr(demand, "prefill_capacity", no_replay)
    monkeypatch.setattr(demand, "decode_capacity", no_replay)
    again = demand.capacity_targets(s)
    assert again == computed
    assert list(again) == list(computed)  # same (model, phase) order


def test_another_sample_is_another_key_and_a_broken_entry_is_recomputed(store, data_dir):
    s = load_scenario("core")
    base = demand.capacity_targets(s)
    names = {p.name for p in store.glob("*.json")}
    demand._MEMO.clear()
    changed = load_scenario("core", {"planner": {"history_s": s.planner.history_s / 2}})
    other = demand.capacity_targets(changed)
    assert {p.name for p in store.glob("*.json")} > names  # new entries, the old ones kept
    assert other != base
    # a truncated entry is ignored and rewritten
    for p in store.glob("*.json"):
        p.write_text(p.read_text()[:10])
    demand._MEMO.clear()
    assert demand.capacity_targets(s) == base
    assert all(json.loads(p.read_text())["format"] == capacity_store.FORMAT for p in store.glob("*.json")
               if p.name in names)


def test_the_store_can_be_turned_off(store, monkeypatch, data_dir):
    monkeypatch.setenv("CORAL_CAPACITY_CACHE", "0")
    demand.capacity_targets(load_scenario("core"))
    assert not store.exists()
