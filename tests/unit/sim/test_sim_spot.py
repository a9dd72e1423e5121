"""Spot preemptions in the simulator (issue 30): notice, loss, re-queue, replacement, bill, draws."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from sim_helpers import ConstPerf, const_template, poisson_trace

from coral.catalog.spot import SpotOffer, SpotProcess
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.policy import InstanceSpec
from coral.scenario import load_scenario
from coral.sim import AWS_SPOT_NOTICE_S, PREEMPTION_REASON, Hosts, SpotMarket, simulate
from coral.sim.spot import region_seed

EAST, ASIA = "aws:us-east-2", "aws:ap-northeast-2"


def _scenario(rate_per_h: float, co_loss: float, recovery_s: float | None = None):  # noqa: ANN202
    """core with spot on in both regions at the given process (and mean recovery), every layer 1 ms."""
    regions = [{"name": r, "spot": True, "spot_preemption_per_h": rate_per_h, "spot_co_loss_share": co_loss}
               for r in (EAST, ASIA)]
    sc = load_scenario("core", {"regions": regions})
    if recovery_s is not None:
        sc = dataclasses.replace(sc, spot={k: dataclasses.replace(o, process=dataclasses.replace(
            o.process, recovery_s=recovery_s)) for k, o in sc.spot.items()})
    return dataclasses.replace(sc, perf=ConstPerf(0.001))


def _first_draw(seed: int, region: str, mean_s: float) -> float:
    return float(np.random.default_rng(region_seed(seed, region)).exponential(mean_s))


class NoticeReplan:
    """Keeps the plan at epoch boundaries; at a notice, adds `extra` and records what it saw."""

    def __init__(self, market: SpotMarket, extra: list[InstanceSpec]) -> None:
        self.market, self.extra, self.calls = market, extra, []

    def __call__(self, now, demand, running, window):  # noqa: ANN001, ANN204
        at_notice = self.market.notice_at == now
        self.calls.append((now, at_notice, sorted(s.key for s in running), self.market.down_at(now)))
        return list(running) + (self.extra if at_notice else [])


def test_a_zone_event_loses_the_decode_instance_and_its_requests_are_served_by_the_replacement() -> None:
    # rho = 1: only zone-wide events, at r = 180 /h, so the first comes after Exp(mean 20 s),
    # drawn first from the region's generator (one spot instance starts at 0).
    seed = 3
    sc = _scenario(180.0, 1.0)
    model = sc.models[0].name
    notice = _first_draw(seed, EAST, 3600.0 / 180.0)
    assert 10.0 < notice < 60.0  # the seed puts it after the arrivals (< 10 s), inside the run
    p = InstanceSpec(template=const_template(model, Phase.PREFILL, batch=4), region=EAST)
    d_spot = InstanceSpec(template=const_template(model, Phase.DECODE, batch=16), region=EAST, spot=True)
    d_new = InstanceSpec(template=const_template(model, Phase.DECODE, batch=16), region=EAST)
    # decode steps take 10 layers x 1 ms: 15 000 tokens keep a request decoding 150 s > the notice
    trace = poisson_trace(model, 1.0, 10.0, seed, output=15_000)
    market = SpotMarket(sc.spot)
    replan = NoticeReplan(market, [d_new])
    r = simulate(sc, {model: trace}, [p, d_spot], replan, duration_s=500.0, epoch_s=1000.0, init_s=30.0,
                 seed=seed, spot=market)

    n = trace.num_requests
    assert r.spot is not None
    assert [(notice, notice + AWS_SPOT_NOTICE_S, EAST, "zone", (1,), 1)] == [
        (e.t_s, e.loss_s, e.region, e.kind, e.instances, e.nodes) for e in r.spot.notices]
    # the re-planner was called at the notice, without the noticed instance, with its pool down
    assert [(notice, True, [p.key], frozenset({(EAST, "1xL40S")}))] == replan.calls
    lost, new = r.instances[1], r.instances[2]
    assert (d_spot.key, "failed", notice + AWS_SPOT_NOTICE_S) == (lost.key, lost.state, lost.stop_s)
    assert (d_new.key, notice, notice + 30.0) == (new.key, new.start_s, new.ready_s)
    # every request was decoding on the lost instance at the loss: re-queued once, then all served
    # by the replacement; their first token stays the one the client got before the notice
    assert (n, n) == (r.spot.requeued, r.spot.requeued_requests)
    assert {"arrived": n, "finished": n, "failed": 0, "in_flight": 0} == r.summary(timing=False)["requests"]
    assert [new.id] * n == r.decode_instance.tolist()
    assert np.all(r.first_token_s < notice)
    assert np.all(r.done_s > notice + AWS_SPOT_NOTICE_S + 150.0 * 0.99)
    spot = r.summary(timing=False)["spot"]
    assert (1, 1, 0, 1, 1, 1, 1, n, 0) == (spot["notices"], spot["zone_events"], spot["node_events"],
                                           spot["instances_noticed"], spot["nodes_noticed"], spot["instances_lost"],
                                           spot["nodes_lost"], spot["requests_requeued"], spot["requests_failed"])


def test_spot_instances_pay_the_spot_price() -> None:
    sc = _scenario(0.0, 0.5)  # never preempted
    model = sc.models[0].name
    t = const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=256)
    specs = [InstanceSpec(template=t, region=EAST, spot=True), InstanceSpec(template=t, region=EAST)]
    market = SpotMarket(sc.spot)
    r = simulate(sc, {model: poisson_trace(model, 2.0, 30.0, 1)}, specs, lambda *a: a[2], duration_s=36.0,
                 epoch_s=12.0, init_s=0.0, spot=market)
    spot_h, od_h = sc.spot[(EAST, "1xL40S")].spot_usd_per_h, sc.prices[(EAST, "1xL40S")]
    assert spot_h < od_h
    assert [(True, spot_h), (False, od_h)] == [(i.spot, i.price_usd_per_h) for i in r.instances]
    assert [f"{t.key}@{EAST}#spot", f"{t.key}@{EAST}"] == [i.key for i in r.instances]
    s = r.summary(timing=False)
    hours = 36.0 / 3600.0
    assert math.isclose((spot_h + od_h), s["cost_usd_per_h"])
    assert {"spot": 36.0 / 3600.0, "on_demand": 36.0 / 3600.0} == s["spot"]["node_hours"]
    assert [spot_h * hours, od_h * hours] == pytest.approx([s["spot"]["cost_usd"]["spot"],
                                                            s["spot"]["cost_usd"]["on_demand"]])
    assert 0 == s["spot"]["notices"]


def test_the_independent_event_is_redrawn_when_the_held_nodes_change() -> None:
    # rho = 0: independent events only. One spot node from 0: the first draw has mean 3600 / r;
    # at the boundary (12 s) a second spot instance starts: redrawn with mean 3600 / (2 r) from there,
    # then the event picks a holder (a uniform draw over the 2 held nodes).
    rate = 36.0  # mean 100 s for one node
    sc = _scenario(rate, 0.0)
    model = sc.models[0].name
    t = const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=256)
    spec = InstanceSpec(template=t, region=EAST, spot=True)
    seed = next(s for s in range(100) if _first_draw(s, EAST, 100.0) > 12.0)  # no event before the boundary
    rng = np.random.default_rng(region_seed(seed, EAST))
    rng.exponential(100.0)
    expected = 12.0 + float(rng.exponential(50.0))
    victim = 0 if rng.random() * 2 < 1 else 1
    market = SpotMarket(sc.spot)
    calls = []

    def replan(now, demand, running, window):  # noqa: ANN001, ANN202
        calls.append(now)
        return [spec, spec] if now == 12.0 else list(running)

    r = simulate(sc, {model: poisson_trace(model, 1.0, 10.0, seed)}, [spec], replan,
                 duration_s=expected + 1.0, epoch_s=12.0, init_s=1.0, seed=seed, spot=market)
    assert r.spot is not None
    first = r.spot.notices[0]
    assert (expected, "node", (victim,)) == (first.t_s, first.kind, first.instances)


def test_draws_follow_the_common_shock_rates() -> None:
    # wide, non-flaky tolerances: 20 000 draws put the mean within 1 % (one standard error 0.7 %)
    process = SpotProcess(preemption_per_node_h=2.0, co_loss_share=0.25, availability=1.0, recovery_s=600.0,
                          source="test")
    offer = SpotOffer(region=EAST, config="1xL40S", instance_type="g6e.xlarge", spot_usd_per_h=0.5,
                      on_demand_usd_per_h=1.8, process=process)
    market = SpotMarket({(EAST, "1xL40S"): offer})
    market.begin(7)
    zone = np.array([market.next_zone_event_s(EAST, 0.0) for _ in range(20_000)])
    node = np.array([market.next_node_event_s(EAST, 0.0, 3) for _ in range(20_000)])
    assert 3600.0 / (0.25 * 2.0) == pytest.approx(zone.mean(), rel=0.05)
    assert 3600.0 / (0.75 * 2.0 * 3) == pytest.approx(node.mean(), rel=0.05)
    picks = np.bincount([market.pick(EAST, [1, 3]) for _ in range(20_000)], minlength=2) / 20_000
    assert [0.25, 0.75] == pytest.approx(picks.tolist(), abs=0.03)
    market.take_down(EAST, ["1xL40S"], 10.0, 130.0)
    assert market.is_down(EAST, "1xL40S", 10.0) and frozenset({(EAST, "1xL40S")}) == market.down_at(129.0)
    until = market.down_spells[0][3]
    assert not market.is_down(EAST, "1xL40S", until)


def test_a_spot_start_is_refused_while_its_pool_is_down_and_requests_fail_cleanly() -> None:
    # One colocated spot instance, lost at its notice + 120 s; the re-planner asks for the same
    # spot instance again while its pool is down (recovery mean 7 200 s): refused, so the
    # requests it held fail with the preemption's reason, and none is lost.
    seed = 5
    sc = _scenario(360.0, 1.0, recovery_s=7200.0)
    model = sc.models[0].name
    t = const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=256)
    spec = InstanceSpec(template=t, region=EAST, spot=True)
    trace = poisson_trace(model, 2.0, 5.0, seed, output=30_000)  # decodes 300 s
    market = SpotMarket(sc.spot)
    replan = NoticeReplan(market, [spec])
    r = simulate(sc, {model: trace}, [spec], replan, duration_s=400.0, epoch_s=1000.0, init_s=10.0, seed=seed,
                 spot=market)
    assert r.spot is not None and 1 == len(r.spot.notices)
    s = r.summary(timing=False)
    n = trace.num_requests
    assert {"arrived": n, "finished": 0, "failed": n, "in_flight": 0} == s["requests"]
    assert {PREEMPTION_REASON: n} == s["per_model"][model]["failed_reasons"]
    assert (1, n, 0) == (s["spot"]["spot_starts_refused"], s["spot"]["requests_failed"],
                         s["spot"]["requests_requeued"])
    assert 0.0 == s["spot"]["worst_epoch_attainment"][model]


def test_a_market_without_spot_instances_changes_nothing() -> None:
    sc = _scenario(1000.0, 0.5)
    model = sc.models[0].name
    specs = [InstanceSpec(template=const_template(model, Phase.PREFILL, batch=2), region=EAST),
             InstanceSpec(template=const_template(model, Phase.DECODE, batch=8), region=EAST)]
    trace = poisson_trace(model, 20.0, 30.0, 2, output=(1, 40))
    kw = {"duration_s": 40.0, "epoch_s": 10.0, "init_s": 2.0, "seed": 3}
    plain = simulate(sc, {model: trace}, specs, lambda *a: a[2], **kw).summary(timing=False)
    with_market = simulate(sc, {model: trace}, specs, lambda *a: a[2], spot=SpotMarket(sc.spot), **kw)
    summary = with_market.summary(timing=False)
    assert "spot" not in plain
    spot = summary.pop("spot")
    assert plain == summary
    assert (0, 0.0) == (spot["notices"], spot["node_hours"]["spot"])


def test_spot_is_deterministic_per_seed() -> None:
    sc = _scenario(3600.0, 0.5)
    model = sc.models[0].name
    t = const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=256)
    specs = [InstanceSpec(template=t, region=EAST, spot=True), InstanceSpec(template=t, region=ASIA, spot=True)]
    market = SpotMarket(sc.spot)
    replan = NoticeReplan(market, specs)

    def notices(seed: int) -> list[tuple[float, str, str]]:
        r = simulate(sc, {model: poisson_trace(model, 2.0, 20.0, 1)}, specs, replan, duration_s=20.0,
                     epoch_s=10.0, init_s=1.0, seed=seed, spot=market)
        assert r.spot is not None
        return [(n.t_s, n.region, n.kind) for n in r.spot.notices]

    a = notices(5)
    assert a == notices(5)
    assert a != notices(6)
    assert {EAST, ASIA} <= {region for _, region, _ in a}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, r"spot instance .*#spot needs a spot market"),
    ({"spot": "market", "hosts": Hosts.single(4.0)}, r"spot preemptions and a host model"),
    ({"spot": "market", "spot_notice_s": -1.0}, r"spot_notice_s must be a finite number >= 0"),
])
def test_bad_spot_input(kwargs, message) -> None:  # noqa: ANN001
    sc = _scenario(1.0, 0.5)
    model = sc.models[0].name
    if kwargs.get("spot") == "market":
        kwargs = {**kwargs, "spot": SpotMarket(sc.spot)}
    spec = InstanceSpec(template=const_template(model, Phase.COLOCATED, chunk_tokens=64), region=EAST, spot=True)
    with pytest.raises(CoralError, match=message):
        simulate(sc, {}, [spec], lambda *a: a[2], duration_s=10.0, epoch_s=5.0, init_s=0.0, **kwargs)


def test_a_spot_instance_needs_a_spot_offer() -> None:
    sc = _scenario(1.0, 0.5)
    model = sc.models[0].name
    market = SpotMarket({k: o for k, o in sc.spot.items() if k[0] == ASIA})
    spec = InstanceSpec(template=const_template(model, Phase.COLOCATED, chunk_tokens=64), region=EAST, spot=True)
    with pytest.raises(CoralError, match=r"no spot offer for 1xL40S in region 'aws:us-east-2'"):
        simulate(sc, {}, [spec], lambda *a: a[2], duration_s=10.0, epoch_s=5.0, init_s=0.0, spot=market)


@pytest.mark.parametrize("layout", ["disaggregated", "decode-at-arrival", "colocated"])
def test_many_preemptions_lose_no_request(layout) -> None:  # noqa: ANN001
    # A preemption every ~10 s per node over spot prefill, decode and colocated instances, with a
    # 5 s notice (decodes last up to 15 s: many are cut), replaced on-demand at the notice and on
    # spot again at the next boundary: every request is accounted for at every epoch, and none
    # finished on an instance after its nodes left.
    sc = _scenario(360.0, 0.5, recovery_s=5.0)
    model = sc.models[0].name
    if layout == "colocated":
        ts = [const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=128)]
    else:
        ts = [const_template(model, Phase.PREFILL, batch=2), const_template(model, Phase.DECODE, batch=8, stages=2)]
    spot = [InstanceSpec(template=t, region=r, spot=True) for t in ts for r in (EAST, ASIA)]
    od = [InstanceSpec(template=t, region=EAST) for t in ts]
    market = SpotMarket(sc.spot)

    def replan(now, demand, running, window):  # noqa: ANN001, ANN202
        return list(running) + (od if market.notice_at == now else [x for x in spot if x not in running])

    trace = poisson_trace(model, 10.0, 60.0, 2, output=(1, 1500))
    r = simulate(sc, {model: trace}, spot + od, replan, duration_s=300.0, epoch_s=20.0, init_s=5.0, seed=2,
                 spot=market, spot_notice_s=5.0, decode_at_arrival=layout == "decode-at-arrival")
    s = r.summary(timing=False)
    assert r.spot is not None and len(r.spot.notices) >= 10 and r.spot.requeued > 0
    assert all(e["conserved"] for e in s["per_epoch"])
    assert {"arrived": trace.num_requests, "in_flight": 0} == {k: s["requests"][k] for k in ("arrived", "in_flight")}
    assert set(s["per_model"][model]["failed_reasons"]) <= {PREEMPTION_REASON}
    stop = np.array([i.stop_s for i in r.instances])
    fin = r.finished
    assert np.all(r.done_s[fin] <= stop[r.decode_instance[fin]])
    assert np.all(r.first_token_s[fin] <= r.done_s[fin])


def test_the_epoch_replanner_plans_around_down_pools_and_keys_spot_instances_apart(monkeypatch) -> None:  # noqa: ANN001
    from coral.experiments import pipeline

    sc = _scenario(1.0, 0.5)
    model = sc.models[0].name
    t = const_template(model, Phase.COLOCATED, chunk_tokens=64)
    calls = []

    class Planned:
        instances = ()

    def fake_allocate(scenario, library, **kw):  # noqa: ANN001, ANN202
        calls.append(kw)
        return Planned()

    monkeypatch.setattr(pipeline, "allocate", fake_allocate)
    market = SpotMarket(sc.spot)
    setup = pipeline.Setup(scenario=sc, library=None, availability={}, availability_mode="abundant", library_s=0.0)
    replan = pipeline.EpochReplanner(setup=setup, method="coral", options=None, forecast=None, market=market)
    replan.demands.append({(model, Phase.PREFILL): 5.0})
    market.take_down(EAST, ["1xL40S", "1xL4"], 10.0, 130.0)
    market.notice_at = 10.0
    running = [InstanceSpec(template=t, region=EAST, spot=True), InstanceSpec(template=t, region=EAST),
               InstanceSpec(template=t, region=ASIA, spot=True)]
    assert [] == replan(10.0, {}, running, {})
    kw = calls[0]
    # both pools are down: the allocator starts no spot instance there (what runs there stays, `prev`)
    assert {(EAST, "1xL4"), (EAST, "1xL40S")} == set(kw["spot_down"])
    assert {} == kw["availability"]  # the setup's, unchanged
    assert {(model, Phase.PREFILL): 5.0} == kw["demand"]  # the last plan's demand, solved again
    assert {(f"{EAST}#spot", t.key): 1, (EAST, t.key): 1, (f"{ASIA}#spot", t.key): 1} == kw["prev"]
    assert (1, 0) == (len(replan.notice_plans), len(replan.plans))


def test_the_timelines_mark_every_notice() -> None:
    from coral.sim.plots import cost_goodput_figure, instances_figure

    rows = [{"t_start_s": 0.0, "t_end_s": 360.0, "cost_usd_per_h": 3.0, "goodput_tok_per_s": 10.0,
             "instances": {"a/prefill/r/x#spot": {"active": 1}}}]
    fig = cost_goodput_figure(rows, [100.0, 250.0])
    ax = fig.axes[0]
    assert "spot preemption notice" == ax.get_legend().get_texts()[-1].get_text()
    assert [[100.0, 100.0], [250.0, 250.0]] == [list(ln.get_xdata()) for ln in ax.get_lines()[1:]]
    assert 2 == sum(1 for ln in instances_figure(rows, [100.0, 250.0]).axes[0].get_lines())
    assert "spot preemption notice" not in [t.get_text() for t in cost_goodput_figure(rows).axes[0].get_legend().get_texts()]


def test_kv_waiting_on_a_lost_prefill_instance_is_prefilled_again() -> None:
    # The model's decode instance starts at the first boundary (10 s) and takes 200 s to be
    # ready, so every prefill the spot prefill instance ends waits there with its KV. A zone event
    # notices it at `notice` (~15.6 s); the re-plan starts an on-demand prefill instance, ready
    # only 200 s later, so the noticed one keeps serving until its loss (notice + 120 s; make
    # before break): every request (all arrive in the first 30 s) is prefilled there, and at the
    # loss those waiting with their KV lose it: re-queued, prefilled again on the new instance
    # (but those of one output token, done at their prefill).
    seed = 3
    sc = _scenario(180.0, 1.0)
    model = sc.models[0].name
    notice = _first_draw(seed, EAST, 20.0)
    p_spot = InstanceSpec(template=const_template(model, Phase.PREFILL, batch=4), region=EAST, spot=True)
    p_new = InstanceSpec(template=const_template(model, Phase.PREFILL, batch=4), region=EAST)
    d = InstanceSpec(template=const_template(model, Phase.DECODE, batch=16), region=EAST)
    market = SpotMarket(sc.spot)

    def replan(now, demand, running, window):  # noqa: ANN001, ANN202
        return list(running) + ([d] if now == 10.0 else [p_new] if market.notice_at == now else [])

    trace = poisson_trace(model, 1.0, 30.0, seed, output=(1, 10))
    r = simulate(sc, {model: trace}, [p_spot], replan, duration_s=300.0, epoch_s=10.0, init_s=200.0, seed=seed,
                 spot=market)
    before = trace.arrival_s < notice + AWS_SPOT_NOTICE_S
    one = trace.output_tokens == 1
    assert r.spot is not None and before.all() and 0 < (~one).sum() and one.any()
    assert (int((~one).sum()),) * 2 == (r.spot.requeued, r.spot.requeued_requests)
    assert {"arrived": trace.num_requests, "finished": trace.num_requests, "failed": 0, "in_flight": 0} == \
        r.summary(timing=False)["requests"]
    ids = {i.key: i.id for i in r.instances}
    assert np.array_equal(np.where(before & one, ids[p_spot.key], ids[p_new.key]), r.prefill_instance)
    assert np.all(r.done_s[~(before & one)] >= notice + 200.0)


def test_preemptions_in_a_run_come_at_the_common_shock_rates() -> None:
    # One spot instance of 2 nodes, replaced on spot at every notice (no notice delay, pools back
    # at once), so the region always holds 2 spot nodes: at r = 3600 /h (1 /s) and rho = 0.5, zone
    # events come at rho r = 0.5 /s and single-node ones at (1 - rho) r x 2 nodes = 1 /s. Over
    # 400 s: 200 and 400 expected (standard deviations 14 and 20); 25 % is over 3.5 of them.
    sc = _scenario(3600.0, 0.5, recovery_s=0.0)
    model = sc.models[0].name
    spec = InstanceSpec(template=const_template(model, Phase.COLOCATED, stages=2, chunk_tokens=64), region=EAST,
                        spot=True)
    market = SpotMarket(sc.spot)
    replan = NoticeReplan(market, [spec])
    r = simulate(sc, {}, [spec], replan, duration_s=400.0, epoch_s=2000.0, init_s=0.0, seed=11, spot=market,
                 spot_notice_s=0.0)
    assert r.spot is not None
    kinds = [n.kind for n in r.spot.notices]
    assert 200 == pytest.approx(kinds.count("zone"), rel=0.25)
    assert 400 == pytest.approx(kinds.count("node"), rel=0.25)
    assert all(2 == n.nodes and 1 == len(n.instances) for n in r.spot.notices)


def test_a_run_without_spot_gives_the_summary_it_gave_before_spot_existed(core) -> None:  # noqa: ANN001
    # data/spot_off_summary.json: this run's summary printed by the simulator as it was before
    # spot preemptions (P/D, a switch to colocated and back, drains). Re-record only for a change
    # that means to alter a spot-off run.
    from pathlib import Path

    sc = dataclasses.replace(core, perf=ConstPerf(0.002, xfer_s=0.001))
    model = sc.models[0].name
    region = sc.regions[0]
    p = const_template(model, Phase.PREFILL, batch=2)
    d = const_template(model, Phase.DECODE, batch=8)
    c = const_template(model, Phase.COLOCATED, batch=8, chunk_tokens=256)
    spec = {k: InstanceSpec(template=t, region=region) for k, t in (("p", p), ("d", d), ("c", c))}
    plans = [[spec["p"], spec["d"], spec["d"]], [spec["c"]], [spec["p"], spec["d"]]]
    r = simulate(sc, {model: poisson_trace(model, 30.0, 60.0, 3, output=(1, 40))}, [spec["p"], spec["d"]],
                 lambda now, demand, running, window: plans.pop(0) if plans else running,
                 duration_s=90.0, epoch_s=15.0, init_s=5.0, seed=1)
    golden = (Path(__file__).parent / "data" / "spot_off_summary.json").read_text()
    assert golden == json.dumps(r.summary(timing=False), indent=1, sort_keys=True) + "\n"


def test_plan_verification_runs_a_spot_plan_without_preemptions() -> None:
    from types import SimpleNamespace

    from coral.experiments.pipeline import Setup
    from coral.experiments.verify import verify_plan

    sc = _scenario(3600.0, 1.0)  # a preemption every second, were it replayed
    t = {m.name: const_template(m.name, Phase.COLOCATED, batch=8, chunk_tokens=512) for m in sc.models}
    plan = SimpleNamespace(instances=[SimpleNamespace(template=t[m], region=EAST, spot=True, count=2) for m in t])
    setup = Setup(scenario=sc, library=None, availability={}, availability_mode="abundant", library_s=0.0)
    verdicts = verify_plan(setup, plan, duration_s=5.0)  # a spot instance in `simulate` needs a market: not here
    assert verdicts and {v.model for v in verdicts} <= {m.name for m in sc.models}
