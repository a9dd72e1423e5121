"""The simulator against closed-form queueing results and the performance model."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sim_helpers import ConstPerf, const_template, poisson_trace

from coral.perf.model import Phase
from coral.policy import InstanceSpec
from coral.sim import simulate
from coral.sim.synthetic import hand_template
from coral.workload import Trace


def keep(now, demand, running, window):  # noqa: ANN001, ANN201
    return running


def test_md1_mean_wait_matches_closed_form(core) -> None:  # noqa: ANN001
    # One node, one stage, micro-batch 1, service D = 10 layers x 0.01 s = 0.1 s, so mu = 10/s.
    # lambda = 6/s -> rho = 0.6; M/D/1: Wq = rho / (2 mu (1 - rho)) = 0.6 / (2*10*0.4) = 0.075 s.
    sc = dataclasses.replace(core, perf=ConstPerf(0.01))
    model = sc.models[0].name
    t = const_template(model, Phase.PREFILL, layers=10, layer_s=0.01)
    duration = 20_000.0
    trace = poisson_trace(model, 6.0, duration, seed=7, output=1)
    r = simulate(sc, {model: trace}, [InstanceSpec(template=t, region=sc.regions[0])], keep,
                 duration_s=duration, epoch_s=duration, init_s=0.0, seed=7, prefill_batching="requests")
    wq = r.queue_s[~np.isnan(r.queue_s)]
    assert wq.size > 100_000
    expected = 0.6 / (2 * 10 * 0.4)
    assert abs(wq.mean() - expected) / expected < 0.05
    # service is deterministic: TTFT = wait + 0.1 s for every request that got a first token
    ttft = r.ttft_s[~np.isnan(r.ttft_s)]
    np.testing.assert_allclose(ttft - r.queue_s[~np.isnan(r.ttft_s)], 0.1, rtol=1e-9)


@pytest.mark.parametrize(("nodes", "stages"), [(["1xL40S"], 1), (["1xL40S", "1xL40S"], 2)])
def test_idle_ttft_equals_template_prefill_latency(core, nodes, stages) -> None:  # noqa: ANN001
    model = "phi-4"
    prompt = 700
    t = hand_template(core, model, Phase.PREFILL, nodes, stages=stages, batch=1, prompt_tokens=prompt)
    assert t is not None and len(t.placement.stages) == stages
    trace = Trace(name=model, arrival_s=np.array([1.0]), prompt_tokens=np.array([prompt]),
                  output_tokens=np.array([1]))
    r = simulate(core, {model: trace}, [InstanceSpec(template=t, region=core.regions[0])], keep,
                 duration_s=30.0, epoch_s=30.0, init_s=0.0, seed=0)
    assert r.ttft_s[0] == pytest.approx(t.placement.latency_s, rel=1e-9)
    assert r.queue_s[0] == 0.0


def test_decode_steps_one_token_per_pass(core) -> None:  # noqa: ANN001
    # Constant times: prefill 10 layers x 0.01 = 0.1 s; decode 1 stage of 10 layers = 0.1 s per
    # step; no transfer. One request with 5 output tokens: first token at 0.1 s after arrival,
    # then 4 decode steps -> done at 0.5 s, TPOT = 0.1 s.
    sc = dataclasses.replace(core, perf=ConstPerf(0.01))
    model = sc.models[0].name
    p = const_template(model, Phase.PREFILL)
    d = const_template(model, Phase.DECODE, batch=4)
    trace = Trace(name=model, arrival_s=np.array([2.0]), prompt_tokens=np.array([50]), output_tokens=np.array([5]))
    r = simulate(sc, {model: trace}, [InstanceSpec(template=p, region=sc.regions[0]),
                                      InstanceSpec(template=d, region=sc.regions[0])], keep,
                 duration_s=10.0, epoch_s=10.0, init_s=0.0, seed=0)
    assert r.ttft_s[0] == pytest.approx(0.1)
    assert r.e2e_s[0] == pytest.approx(0.5)
    assert r.tpot_s[0] == pytest.approx(0.1)


def test_prefill_batches_by_tokens(core) -> None:  # noqa: ANN001
    # Micro-batch 2 at the scenario's mean prompt length P̄ = a budget of 2·P̄ tokens; one node,
    # 0.1 s per pass whatever the batch, 2 lanes. p0 arrives at 0 (runs 0-0.1); p1..p4 of P̄/2
    # arrive at 0.01: p1 takes the free lane (runs 0.1-0.2). At 0.1 a lane frees:
    #   by tokens: p2+p3+p4 (1.5·P̄ <= 2·P̄) run together 0.2-0.3 -> TTFT 0.29 each;
    #   by requests: p2+p3 (b = 2) run 0.2-0.3, p4 waits for p1's lane (0.2) and the node: 0.3-0.4.
    sc = dataclasses.replace(core, perf=ConstPerf(0.01))
    model = sc.models[0].name
    half = int(sc.models[0].prompt_tokens_mean // 2)
    t = const_template(model, Phase.PREFILL, layers=10, layer_s=0.01, batch=2)
    trace = Trace(name=model, arrival_s=np.array([0.0, 0.01, 0.01, 0.01, 0.01]),
                  prompt_tokens=np.array([2 * half] + [half] * 4), output_tokens=np.ones(5, dtype=int))
    runs = {mode: simulate(sc, {model: trace}, [InstanceSpec(template=t, region=sc.regions[0])], keep,
                           duration_s=10.0, epoch_s=10.0, init_s=0.0, prefill_batching=mode)
            for mode in ("tokens", "requests")}
    np.testing.assert_allclose(runs["tokens"].ttft_s, [0.1, 0.19, 0.29, 0.29, 0.29])
    np.testing.assert_allclose(runs["requests"].ttft_s, [0.1, 0.19, 0.29, 0.29, 0.39])
