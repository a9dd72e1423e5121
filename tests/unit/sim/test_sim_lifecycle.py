"""Epochs, draining, conservation, failures, determinism and output files."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from sim_helpers import ConstPerf, const_template, poisson_trace

from coral.perf.model import Phase
from coral.policy import InstanceSpec
from coral.sim import simulate


def _setup(core, rate=20.0, duration=60.0, seed=3):  # noqa: ANN001, ANN202
    sc = dataclasses.replace(core, perf=ConstPerf(0.002, xfer_s=0.001))
    model = sc.models[0].name
    region = sc.regions[0]
    p = const_template(model, Phase.PREFILL, batch=2)
    p2 = const_template(model, Phase.PREFILL, stages=2, batch=2, node="1xL4")
    d = const_template(model, Phase.DECODE, batch=8)
    d2 = const_template(model, Phase.DECODE, stages=2, batch=8, node="1xL4")
    trace = poisson_trace(model, rate, duration, seed, output=(1, 40))
    spec = {k: InstanceSpec(template=v, region=region) for k, v in (("p", p), ("p2", p2), ("d", d), ("d2", d2))}
    return sc, model, trace, spec


def test_plan_changes_and_draining_lose_no_request(core) -> None:  # noqa: ANN001
    sc, model, trace, s = _setup(core)
    plans = [[s["p2"], s["d2"]], [s["p"], s["p"], s["d"]], [], [s["p2"], s["d"], s["d2"]]]
    calls = []

    def replan(now, demand, running, window):  # noqa: ANN001, ANN202
        calls.append((now, demand, list(running)))
        return plans[len(calls) - 1] if len(calls) <= len(plans) else running

    # arrivals stop at 60 s (trace), the run goes on to 120 s so everything can drain
    r = simulate(sc, {model: trace}, [s["p"], s["d"]], replan, duration_s=120.0, epoch_s=12.0, init_s=3.0, seed=1)
    summ = r.summary(timing=False)
    assert summ["requests"] == {"arrived": trace.num_requests, "finished": trace.num_requests,
                                "failed": 0, "in_flight": 0}
    assert [round(c[0], 9) for c in calls] == [12.0 * k for k in range(1, 10)]
    # demand seen in the first epoch = prompt / output tokens of its arrivals / 12 s
    first = trace.arrival_s < 12.0
    assert calls[0][1][(model, Phase.PREFILL)] == trace.prompt_tokens[first].sum() / 12.0
    assert calls[0][1][(model, Phase.DECODE)] == trace.output_tokens[first].sum() / 12.0
    # every removed instance drained and stopped; none stopped while holding work
    removed = [i for i in r.instances if i.stop_s < 120.0]
    assert len(removed) >= 4
    for i in r.instances:
        served_p = np.flatnonzero(r.prefill_instance == i.id)
        served_d = np.flatnonzero(r.decode_instance == i.id)
        ends = [0.0]
        if served_p.size:
            ends.append(float(r.first_token_s[served_p].max()))
        if served_d.size:
            ends.append(float(r.done_s[served_d].max()))
        assert max(ends) <= i.stop_s + 1e-12
    # some removed instance really drained: it stopped after the boundary that removed it
    assert any(i.stop_s % 12.0 > 1e-9 for i in removed)
    # during the empty plan (epoch 3: 36 s .. 48 s + init) requests queued and were served later
    waited = (trace.arrival_s >= 36.0) & (trace.arrival_s < 48.0)
    assert np.all(r.queue_s[waited] > 0)
    for e in summ["per_epoch"]:
        assert e["conserved"]
        assert e["arrived"] == e["finished"] + e["failed"] + e["in_flight"]


def test_conservation_at_every_epoch_and_failures_with_reason(core) -> None:  # noqa: ANN001
    sc, model, trace, s = _setup(core, rate=200.0)  # overloaded: work is in flight at the boundaries
    other = sc.models[1].name
    t2 = dataclasses.replace(trace, name=other)
    r = simulate(sc, {model: trace, other: t2}, [s["p"], s["d"]], lambda n, d, run, w: run,
                 duration_s=60.0, epoch_s=10.0, init_s=0.0, seed=1)
    summ = r.summary(timing=False)
    epochs = summ["per_epoch"]
    assert [e["t_end_s"] for e in epochs] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert all(e["conserved"] for e in epochs)
    assert any(e["in_flight"] > 0 for e in epochs[:-1])
    assert [e["arrived"] for e in epochs] == [int((np.concatenate([trace.arrival_s] * 2) <= t).sum())
                                             for t in (10, 20, 30, 40, 50, 60)]
    pm = summ["per_model"][other]
    assert pm["requests"]["failed"] == t2.num_requests
    assert pm["failed_reasons"] == {"no prefill or colocated instance of the model was ever ready": t2.num_requests}
    assert summ["per_model"][model]["requests"]["in_flight"] > 0
    assert summ["requests"]["arrived"] == sum(summ["requests"][k] for k in ("finished", "failed", "in_flight"))


def test_cost_counts_starting_and_draining_nodes(core) -> None:  # noqa: ANN001
    sc, model, _, s = _setup(core)
    empty = dataclasses.replace(poisson_trace(model, 1.0, 1.0, 0), name=model)
    # p (1 node) serves 0..15 s: replaced at 10 s, it keeps taking traffic until p2 is ready at
    # 15 s (make before break), then drains (idle: stops at once); p2 (2 x 1xL4) is paid from 10 s
    # (starting for 5 s) to the end at 20 s
    r = simulate(sc, {model: empty}, [s["p"]], lambda n, d, run, w: [s["p2"]], duration_s=20.0, epoch_s=10.0,
                 init_s=5.0, seed=0)
    region = sc.regions[0]
    expected = (15 * sc.prices[(region, "1xL40S")] + 10 * 2 * sc.prices[(region, "1xL4")]) / 3600
    summ = r.summary(timing=False)
    assert abs(summ["cost_usd_per_h"] - expected / (20 / 3600)) < 1e-9
    assert abs(sum(e["cost_usd"] for e in summ["per_epoch"]) - expected) < 1e-12


def test_same_seed_same_bytes(core, tmp_path) -> None:  # noqa: ANN001
    sc, model, trace, s = _setup(core, rate=40.0)

    def replan(now, demand, running, window):  # noqa: ANN001, ANN202
        return [s["p"], s["p2"], s["d"], s["d2"]] if now < 30 else [s["p"], s["d2"]]

    runs = [simulate(sc, {model: trace}, [s["p"], s["d"]], replan, duration_s=60.0, epoch_s=15.0, init_s=2.0,
                     seed=5) for _ in range(2)]
    assert runs[0].summary(timing=False) == runs[1].summary(timing=False)
    out = [runs[k].write(tmp_path / f"run{k}") for k in range(2)]
    a, b = ((o / "summary.json").read_bytes() for o in out)
    assert a == b
    assert (out[0] / "requests.csv").read_bytes() == (out[1] / "requests.csv").read_bytes()
    summ = json.loads(a)
    for key in ("cost_usd_per_h", "goodput_tok_per_s", "slo_attainment", "requests", "per_model", "per_epoch"):
        assert key in summ
    assert "wall_s" in runs[0].summary()
    lines = (out[0] / "requests.csv").read_text().splitlines()
    assert len(lines) == 1 + trace.num_requests
    assert sorted(p.name for p in (out[0] / "plots").iterdir()) == ["cost_goodput.png", "instances.png",
                                                                      "latency_cdf.png"]
    # rewriting replaces the folder whole and leaves no temporary folder behind
    runs[0].write(out[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run0", "run1"]


def test_replaced_instance_serves_until_replacement_is_ready(core) -> None:  # noqa: ANN001
    sc, model, trace, s = _setup(core, rate=5.0)
    # At 10 s the plan swaps p for p2 (ready at 40 s): requests arriving in between must still be
    # served by p, not wait for p2.
    r = simulate(sc, {model: trace}, [s["p"], s["d"]], lambda n, d, run, w: [s["p2"], s["d"]], duration_s=60.0,
                 epoch_s=10.0, init_s=30.0, seed=0)
    between = (r.arrival_s >= 10.0) & (r.arrival_s < 30.0)
    assert between.any()
    assert float(np.nanmax(r.ttft_s[between])) < 5.0  # no request waited for the new instance


def _switch(core, first: str, then: str):  # noqa: ANN001, ANN202
    """A run whose plan switches the model's mode at 10 s (the new instances ready at 40 s)."""
    sc, model, trace, s = _setup(core, rate=5.0, duration=60.0)
    # and one request whose prefill (20 ms) is running when the new instances are ready
    at = np.searchsorted(trace.arrival_s, 39.99)
    trace = dataclasses.replace(trace, arrival_s=np.insert(trace.arrival_s, at, 39.99),
                                prompt_tokens=np.insert(trace.prompt_tokens, at, 100),
                                output_tokens=np.insert(trace.output_tokens, at, 5))
    c = InstanceSpec(template=const_template(model, Phase.COLOCATED, layer_s=0.002, batch=8, chunk_tokens=256,
                                             tok=256.0), region=sc.regions[0])
    plans = {"disagg": [s["p"], s["d"]], "colocated": [c]}
    r = simulate(sc, {model: trace}, plans[first], lambda n, d, run, w: plans[then], duration_s=120.0,
                 epoch_s=10.0, init_s=30.0, seed=0)
    return r, trace


@pytest.mark.parametrize(("first", "then"), [("disagg", "colocated"), ("colocated", "disagg")])
def test_mode_switch_keeps_serving_until_ready(core, first, then) -> None:  # noqa: ANN001
    # A switch of mode at 10 s: the old instances serve until the new ones are ready at 40 s, and
    # (disaggregated -> colocated) no request is left without a decode instance.
    r, trace = _switch(core, first, then)
    between = (r.arrival_s >= 10.0) & (r.arrival_s < 40.0)
    assert between.any()
    assert float(np.nanmax(r.ttft_s[between])) < 5.0
    assert {"arrived": trace.num_requests, "finished": trace.num_requests, "failed": 0, "in_flight": 0} == \
        r.summary(timing=False)["requests"]
