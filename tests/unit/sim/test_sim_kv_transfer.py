"""The simulator's prefill -> decode KV transfer: each decode stage receives only its own layers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sim_helpers import ConstPerf

from coral.perf.model import PerfModel, Phase
from coral.policy import InstanceSpec
from coral.sim import simulate
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template
from coral.workload import Trace


class NicPerf(ConstPerf):
    """Constant layer times, no activation transfer, and the base model's KV transfer (bytes / NIC)."""

    kv_transfer_s = PerfModel.kv_transfer_s


def template(model: str, phase: Phase, stages: list[tuple[str, int]], layer_s: float) -> Template:
    nodes = tuple(sorted(n for n, _ in stages))
    st = tuple(Stage(nodes=(n,), node_index=(nodes.index(n),), layers=j, time_s=j * layer_s,
                     throughput_tok_per_s=1.0 / (j * layer_s)) for n, j in stages)
    pl = Placement(stages=st, micro_batch=1, throughput_tok_per_s=min(s.throughput_tok_per_s for s in st),
                   latency_s=sum(s.time_s for s in st), comm_s=0.0)
    return Template(model=model, phase=phase, slo_ms=1e6, budget_ms=1e6, nodes=nodes, placement=pl)


def test_each_decode_stage_receives_only_its_layers_kv(core) -> None:  # noqa: ANN001
    # phi-4: 40 layers, 5,120 KV bytes per token and layer. One request of 1,000 prompt tokens
    # arrives at 1 s; the prefill (one stage on an 8xL40S, 400 Gbit/s) takes 40 x 0.01 = 0.4 s.
    # The decode pipeline holds layers 0-3 on a 1xL4 (2.5 Gbit/s) and 4-39 on an 8xL4 (100 Gbit/s).
    # The 1xL4 receives 4 layers: 4 x 5,120 x 1,000 B = 20.48 MB at 312.5 MB/s = 65.536 ms, plus
    # the 0.2 ms hop latency; the 8xL4's 36 layers take 14.7 ms and the sender's 40 layers at
    # 400 Gbit/s 4.3 ms, both in parallel with it. So the KV is in at 1.4 + 0.065736 s. Sending
    # all 40 layers through the 1xL4's NIC would take 655.56 ms.
    sc = dataclasses.replace(core, perf=NicPerf(0.01))
    model = "phi-4"
    pre = template(model, Phase.PREFILL, [("8xL40S", 40)], 0.01)
    dec = template(model, Phase.DECODE, [("1xL4", 4), ("8xL4", 36)], 0.01)
    trace = Trace(name=model, arrival_s=np.array([1.0]), prompt_tokens=np.array([1000]), output_tokens=np.array([3]))
    r = simulate(sc, {model: trace}, [InstanceSpec(template=pre, region=sc.regions[0]),
                                      InstanceSpec(template=dec, region=sc.regions[0])],
                 lambda now, demand, running, window: running, duration_s=30.0, epoch_s=30.0, init_s=0.0, seed=0)
    assert r.kv_arrival_s[0] == pytest.approx(1.4 + 0.065736, abs=1e-9)


def test_a_busy_nic_does_not_hold_the_other_end_idle(core) -> None:  # noqa: ANN001
    # Two requests of 1,000 prompt tokens at 1.0 s and 1.0 s + 1 us, each prefilled alone on its
    # own 8xL40S instance (done at 1.4 s and 1.4 s + 1 us), decoded on one 1xL4 stage (2.5 Gbit/s)
    # holding all 40 layers: 40 x 5,120 x 1,000 B = 204.8 MB = 655.36 ms + 0.2 ms each. The 1xL4's
    # NIC takes them one after the other: in at 1.4 + 0.65556 and 1.4 + 2 x 0.65556 s.
    sc = dataclasses.replace(core, perf=NicPerf(0.01))
    model = "phi-4"
    pre = template(model, Phase.PREFILL, [("8xL40S", 40)], 0.01)
    dec = template(model, Phase.DECODE, [("1xL4", 40)], 0.01)
    trace = Trace(name=model, arrival_s=np.array([1.0, 1.000001]), prompt_tokens=np.array([1000, 1000]),
                  output_tokens=np.array([3, 3]))
    region = sc.regions[0]
    r = simulate(sc, {model: trace}, [InstanceSpec(template=pre, region=region), InstanceSpec(template=pre, region=region),
                                      InstanceSpec(template=dec, region=region)],
                 lambda now, demand, running, window: running, duration_s=30.0, epoch_s=30.0, init_s=0.0, seed=0)
    np.testing.assert_allclose(np.sort(r.kv_arrival_s), [1.4 + 0.65556, 1.4 + 2 * 0.65556], atol=2e-6)
