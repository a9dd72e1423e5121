"""The simulator's host model (processor sharing of a host's cores) and its lane / spread batching options."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sim_helpers import ConstPerf, const_template, poisson_trace

from coral.errors import CoralError
from coral.perf.model import Phase
from coral.policy import InstanceSpec
from coral.sim import Hosts, simulate
from coral.workload import Trace


def keep(now, demand, running, window):  # noqa: ANN001, ANN201
    return running


def _prefill_pair(core, arrivals, hosts, *, stages=1):  # noqa: ANN001, ANN202
    """Two prefill instances of one 1-s pass each (10 layers x 0.1 s); WRR sends request i to instance i % 2."""
    sc = dataclasses.replace(core, perf=ConstPerf(0.1))
    model = sc.models[0].name
    t = const_template(model, Phase.PREFILL, stages=stages, layers=10, layer_s=0.1)
    n = len(arrivals)
    trace = Trace(name=model, arrival_s=np.array(arrivals, dtype=float), prompt_tokens=np.full(n, 100),
                  output_tokens=np.ones(n, dtype=int))
    spec = InstanceSpec(template=t, region=sc.regions[0])
    return simulate(sc, {model: trace}, [spec, spec], keep, duration_s=10.0, epoch_s=10.0, init_s=0.0,
                    prefill_batching="requests", hosts=hosts)


def test_two_nodes_on_one_core_started_together_both_finish_at_2s(core) -> None:  # noqa: ANN001
    # 1 s of work each, both at speed 1/2 from t = 0: both done at 2 s.
    r = _prefill_pair(core, [0.0, 0.0], Hosts.single(1))
    np.testing.assert_allclose(r.ttft_s, [2.0, 2.0])
    # without a host model each node is its own server
    np.testing.assert_allclose(_prefill_pair(core, [0.0, 0.0], None).ttft_s, [1.0, 1.0])


def test_staggered_starts_on_one_core(core) -> None:  # noqa: ANN001
    # A starts at 0, B at 0.5, 1 s of work each, one core.
    # 0-0.5: A alone at speed 1 -> 0.5 left. From 0.5 both at 1/2: A ends at 0.5 + 0.5/0.5 = 1.5,
    # B has done 0.5 by then, runs alone at speed 1: ends at 2.0. TTFT A = 1.5, B = 2.0 - 0.5 = 1.5.
    r = _prefill_pair(core, [0.0, 0.5], Hosts.single(1))
    np.testing.assert_allclose(r.ttft_s, [1.5, 1.5])


def test_three_nodes_on_two_cores_staggered(core) -> None:  # noqa: ANN001
    # Four 1-node instances on 2 cores; requests at 0, 0, 0.5 (the fourth instance stays idle).
    # 0-0.5: A, B at speed 1 (2 busy <= 2 cores) -> 0.5 left each. From 0.5: 3 busy, speed 2/3:
    # A, B end at 0.5 + 0.5 / (2/3) = 1.25; C has done 0.75 * 2/3 = 0.5 by then, alone: ends 1.75.
    sc = dataclasses.replace(core, perf=ConstPerf(0.1))
    model = sc.models[0].name
    t = const_template(model, Phase.PREFILL, layers=10, layer_s=0.1)
    trace = Trace(name=model, arrival_s=np.array([0.0, 0.0, 0.5]), prompt_tokens=np.full(3, 100),
                  output_tokens=np.ones(3, dtype=int))
    spec = InstanceSpec(template=t, region=sc.regions[0])
    r = simulate(sc, {model: trace}, [spec] * 4, keep, duration_s=10.0, epoch_s=10.0, init_s=0.0,
                 prefill_batching="requests", hosts=Hosts.single(2))
    np.testing.assert_allclose(r.ttft_s, [1.25, 1.25, 1.25])


def test_pipeline_stages_share_the_core(core) -> None:  # noqa: ANN001
    # Two instances of 2 stages (5 layers x 0.1 s = 0.5 s per stage) on one core, requests at 0, 0:
    # both stage 0s at 1/2 -> 0-1.0; both stage 1s at 1/2 -> 1.0-2.0. TTFT 2.0 (alone: 1.0).
    r = _prefill_pair(core, [0.0, 0.0], Hosts.single(1), stages=2)
    np.testing.assert_allclose(r.ttft_s, [2.0, 2.0])


def test_nodes_on_different_hosts_do_not_share(core) -> None:  # noqa: ANN001
    # Instance i's node on host hi (one core each): no sharing, both done at 1 s.
    seen = []

    def place(spec, stage, node):  # noqa: ANN001, ANN202
        seen.append((stage, node))
        return f"h{len(seen) - 1}"

    r = _prefill_pair(core, [0.0, 0.0], Hosts(cores={"h0": 1, "h1": 1}, place=place))
    np.testing.assert_allclose(r.ttft_s, [1.0, 1.0])
    assert [(0, 0), (0, 0)] == seen


def test_enough_cores_gives_the_default_run_exactly(core) -> None:  # noqa: ANN001
    # With at least as many cores as nodes no node is ever slowed: same summary as no host model.
    sc = dataclasses.replace(core, perf=ConstPerf(0.002, xfer_s=0.001))
    model = sc.models[0].name
    p = const_template(model, Phase.PREFILL, stages=2, batch=2, layer_s=0.002)
    d = const_template(model, Phase.DECODE, stages=2, batch=8, layer_s=0.002)
    trace = poisson_trace(model, 30.0, 60.0, seed=5, output=(2, 20))
    initial = [InstanceSpec(template=p, region=sc.regions[0]), InstanceSpec(template=d, region=sc.regions[0])]
    runs = [simulate(sc, {model: trace}, initial, keep, duration_s=60.0, epoch_s=20.0, init_s=0.0, seed=5, hosts=h)
            for h in (None, Hosts.single(4))]
    assert runs[0].summary(timing=False) == runs[1].summary(timing=False)


def test_shared_core_slows_and_conserves(core) -> None:  # noqa: ANN001
    # Same cluster on one core: every request is still accounted for, and nothing gets faster.
    sc = dataclasses.replace(core, perf=ConstPerf(0.002, xfer_s=0.001))
    model = sc.models[0].name
    p = const_template(model, Phase.PREFILL, stages=2, batch=2, layer_s=0.002)
    d = const_template(model, Phase.DECODE, stages=2, batch=8, layer_s=0.002)
    trace = poisson_trace(model, 30.0, 60.0, seed=5, output=(2, 20))
    initial = [InstanceSpec(template=p, region=sc.regions[0]), InstanceSpec(template=d, region=sc.regions[0])]
    free, shared = (simulate(sc, {model: trace}, initial, keep, duration_s=60.0, epoch_s=20.0, init_s=0.0, seed=5, hosts=h)
                    for h in (None, Hosts.single(1)))
    req = shared.summary(timing=False)["requests"]
    assert req["arrived"] == req["finished"] + req["failed"] + req["in_flight"]
    both = np.isfinite(free.e2e_s) & np.isfinite(shared.e2e_s)
    assert both.sum() > 1000
    assert np.all(shared.e2e_s[both] >= free.e2e_s[both] - 1e-9)
    assert np.nanmean(shared.e2e_s) > np.nanmean(free.e2e_s)


def test_hosts_validation(core) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="at least one host"):
        Hosts(cores={})
    with pytest.raises(ValueError, match="cores must be"):
        Hosts.single(0)
    with pytest.raises(ValueError, match="needs a place function"):
        Hosts(cores={"a": 1, "b": 2})
    with pytest.raises(CoralError, match="unknown host 'c'"):
        _prefill_pair(core, [0.0], Hosts(cores={"a": 1, "b": 2}, place=lambda s, k, i: "c"))


def test_lanes_limit_micro_batches_in_flight(core) -> None:  # noqa: ANN001
    # One instance of 2 stages, 0.5 s each, micro-batch 1; requests at 0 and 0 (both to instance 0
    # here: a single instance). Default lanes (2·S = 4): p1 enters stage 0 at 0.5, done at 1.5.
    # lanes = 1: p1 waits for p0's whole pass (0-1.0), runs 1.0-2.0.
    sc = dataclasses.replace(core, perf=ConstPerf(0.1))
    model = sc.models[0].name
    t = const_template(model, Phase.PREFILL, stages=2, layers=10, layer_s=0.1)
    trace = Trace(name=model, arrival_s=np.array([0.0, 0.0]), prompt_tokens=np.full(2, 100),
                  output_tokens=np.ones(2, dtype=int))
    spec = InstanceSpec(template=t, region=sc.regions[0])
    ttft = {n: simulate(sc, {model: trace}, [spec], keep, duration_s=10.0, epoch_s=10.0, init_s=0.0,
                        prefill_batching="requests", lanes=None if n is None else (lambda _t, n=n: n)).ttft_s
            for n in (None, 1)}
    np.testing.assert_allclose(ttft[None], [1.0, 1.5])
    np.testing.assert_allclose(ttft[1], [1.0, 2.0])
    with pytest.raises(CoralError, match="needs >= 1"):
        simulate(sc, {model: trace}, [spec], keep, duration_s=10.0, epoch_s=10.0, init_s=0.0, lanes=lambda _t: 0)


def test_spread_caps_a_lane_at_its_share(core) -> None:  # noqa: ANN001
    # One node, 1 s per pass whatever the batch, micro-batch 4, 2 lanes. p0 at 0 runs 0-1 (lane 0);
    # p1 at 0.1 takes lane 1 and waits for the node (1-2); p2..p5 at 0.2 queue. At 1.0 lane 0 frees:
    #   FIFO: p2..p5 (4 <= b) run 2-3 -> p5's TTFT 2.8;
    #   spread: ceil((1 held + 4 queued) / 2) = 3: p2..p4 run 2-3, p5 waits for lane 1 (free at
    #   2.0) and the node: 3-4 -> TTFT 3.8.
    sc = dataclasses.replace(core, perf=ConstPerf(0.1))
    model = sc.models[0].name
    t = const_template(model, Phase.PREFILL, layers=10, layer_s=0.1, batch=4)
    arr = np.array([0.0, 0.1, 0.2, 0.2, 0.2, 0.2])
    trace = Trace(name=model, arrival_s=arr, prompt_tokens=np.full(6, 100), output_tokens=np.ones(6, dtype=int))
    spec = InstanceSpec(template=t, region=sc.regions[0])
    ttft = {s: simulate(sc, {model: trace}, [spec], keep, duration_s=10.0, epoch_s=10.0, init_s=0.0,
                        prefill_batching="requests", lanes=lambda _t: 2, spread=s).ttft_s for s in (False, True)}
    np.testing.assert_allclose(ttft[False], np.array([1.0, 2.0, 3.0, 3.0, 3.0, 3.0]) - arr)
    np.testing.assert_allclose(ttft[True], np.array([1.0, 2.0, 3.0, 3.0, 3.0, 4.0]) - arr)


def test_background_threads_compete_for_the_cores(core) -> None:  # noqa: ANN001
    # One node busy (1 s of work) on 2 cores with 3 outside threads always runnable: speed
    # min(1, 2 / (1 + 3)) = 1/2 -> done at 2 s. With 0.5 background: min(1, 2 / 1.5) = 1 -> 1 s.
    np.testing.assert_allclose(_prefill_pair(core, [0.0], Hosts.single(2, background=3)).ttft_s, [2.0])
    np.testing.assert_allclose(_prefill_pair(core, [0.0], Hosts.single(2, background=0.5)).ttft_s, [1.0])
    with pytest.raises(ValueError, match="background must be"):
        Hosts.single(2, background=-1)
    with pytest.raises(ValueError, match="background for unknown host"):
        Hosts(cores={"a": 1}, background={"b": 1})


def test_background_steps_change_the_speed_mid_run(core) -> None:  # noqa: ANN001
    # One core, 1 s of work from 0; an outside thread becomes runnable at 0.5 and leaves at 1.0:
    # 0-0.5 speed 1 (0.5 left); 0.5-1.0 speed 1/2 (0.25 done, 0.25 left); then speed 1: ends 1.25.
    hosts = Hosts.single(1, background=((0.0, 0.0), (0.5, 1.0), (1.0, 0.0)))
    np.testing.assert_allclose(_prefill_pair(core, [0.0], hosts).ttft_s, [1.25])
    with pytest.raises(ValueError, match="increasing time"):
        Hosts.single(1, background=((1.0, 0.0), (0.5, 1.0)))


def test_taken_cores_are_capacity_gone(core) -> None:  # noqa: ANN001
    # Two nodes busy from 0 (1 s of work each) on 2 cores of which outside processes use 1: they
    # share the one left, speed 1/2 -> both done at 2 s. Alone on 1.5 cores left: speed 1 -> 1 s.
    np.testing.assert_allclose(_prefill_pair(core, [0.0, 0.0], Hosts.single(2, taken=1.0)).ttft_s, [2.0, 2.0])
    np.testing.assert_allclose(_prefill_pair(core, [0.0], Hosts.single(2, taken=0.5)).ttft_s, [1.0])
    # one node on 2 cores with 1.5 taken: speed 0.5 -> 2 s (3 background threads would give min(1, 2/4) too,
    # but two nodes would then run at 2/5 each, not 1/4)
    np.testing.assert_allclose(_prefill_pair(core, [0.0], Hosts.single(2, taken=1.5)).ttft_s, [2.0])
    np.testing.assert_allclose(_prefill_pair(core, [0.0, 0.0], Hosts.single(2, taken=1.5)).ttft_s, [4.0, 4.0])
    with pytest.raises(ValueError, match=r"taken must be a finite number >= 0 and < its 2 cores"):
        Hosts.single(2, taken=2.0)
    with pytest.raises(ValueError, match="taken for unknown host"):
        Hosts(cores={"a": 1}, taken={"b": 0.5})


def test_taken_steps_change_the_speed_mid_run(core) -> None:  # noqa: ANN001
    # One core, 1 s of work from 0; outside processes use 0.5 of it from 0.5 to 1.0:
    # 0-0.5 speed 1 (0.5 left); 0.5-1.0 speed 1/2 (0.25 left); then speed 1: ends 1.25.
    hosts = Hosts.single(1, taken=((0.5, 0.5), (1.0, 0.0)))
    np.testing.assert_allclose(_prefill_pair(core, [0.0], hosts).ttft_s, [1.25])
    with pytest.raises(ValueError, match="taken steps must be in increasing time"):
        Hosts.single(1, taken=((1.0, 0.0), (0.5, 0.5)))


def test_frontend_work_competes_for_the_cores(core) -> None:  # noqa: ANN001
    # One request at 0 on a 1-s prefill pass, one core, 0.5 s of front-end work per request on
    # arrival. 0-1.0: the front end and the node share the core (speed 1/2): the front end's 0.5 s
    # ends at 1.0, the node has done 0.5 and finishes alone at 1.5.
    r = _prefill_pair(core, [0.0], Hosts.single(1, frontend_work=(0.5, 0.0)))
    np.testing.assert_allclose(r.ttft_s, [1.5])
    # two cores: no contention, 1.0
    np.testing.assert_allclose(_prefill_pair(core, [0.0], Hosts.single(2, frontend_work=(0.5, 0.0))).ttft_s, [1.0])
    with pytest.raises(ValueError, match="frontend_work"):
        Hosts.single(1, frontend_work=(-1.0, 0.0))
    with pytest.raises(ValueError, match="frontend host"):
        Hosts(cores={"a": 1}, frontend="b")


def test_decode_at_arrival_routes_like_the_runtime_coordinator(core) -> None:  # noqa: ANN001
    # One prefill node (1 s a pass, one prompt each: r0..r2 at 0, 0.1, 0.2 are done at 1, 2, 3) and
    # two decode instances, A (id 1, throughput 1000 tok/s) and B (id 2, 3000), 64 slots each;
    # decodes of 5 s, so every routed request is still held when the next one is routed.
    #   default, at the prefill's end, least held per slot: r0 -> A (tie, lower id), r1 -> B, r2 -> A;
    #   at arrival, least (held + 1) / throughput: r0 -> B (1/3000), r1 -> B (2/3000 < 1/1000),
    #   r2: A 1/1000 = B 3/3000, the tie to A.
    sc = dataclasses.replace(core, perf=ConstPerf(0.1))
    model = sc.models[0].name
    pre = const_template(model, Phase.PREFILL, layers=10, layer_s=0.1)
    dec_a = const_template(model, Phase.DECODE, layers=10, layer_s=0.01, batch=64, tok=100.0 / 64)
    dec_b = const_template(model, Phase.DECODE, layers=10, layer_s=0.01, batch=64, tok=300.0 / 64)
    arr = np.array([0.0, 0.1, 0.2])
    trace = Trace(name=model, arrival_s=arr, prompt_tokens=np.full(3, 100), output_tokens=np.full(3, 50))
    specs = [InstanceSpec(template=t, region=sc.regions[0]) for t in (pre, dec_a, dec_b)]
    for at_arrival, want in ((False, [1, 2, 1]), (True, [2, 2, 1])):
        r = simulate(sc, {model: trace}, specs, keep, duration_s=60.0, epoch_s=60.0, init_s=0.0,
                     prefill_batching="requests", decode_at_arrival=at_arrival)
        assert want == r.decode_instance.tolist()
        assert np.isfinite(r.tpot_s).all()
        assert [1.0, 2.0, 3.0] == pytest.approx((r.ttft_s + arr).tolist())
