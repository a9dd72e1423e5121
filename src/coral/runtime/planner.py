"""The allocator as the runtime's live planner: observed demand -> the cheapest set of the
cluster's instance shapes that serves it (DESIGN §4 on the runtime's own shapes)."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

from coral.allocator import allocate_inputs
from coral.allocator.inputs import AllocationInputs
from coral.perf.model import Phase
from coral.runtime.cluster_config import InstanceSpec
from coral.runtime.lifecycle import Demand, shape_key
from coral.solver import SolveOptions
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template

LOCAL_NODE = "1xLOCAL"  # the configuration name the local provisioner's nodes are counted under


def _template(spec: InstanceSpec) -> Template:
    """One shape as a template: its declared throughput, one node per engine process."""
    nodes = sum(len(st.node_throughputs) for st in spec.stages)
    stages = tuple(Stage(nodes=(LOCAL_NODE,) * len(st.node_throughputs), node_index=tuple(range(len(st.node_throughputs))),
                         layers=st.layer_end - st.layer_start, time_s=0.0, throughput_tok_per_s=spec.throughput_tok_per_s)
                   for st in spec.stages)
    placement = Placement(stages=stages, micro_batch=1, throughput_tok_per_s=spec.throughput_tok_per_s, latency_s=0.0,
                          comm_s=0.0)
    # A cluster-file shape has no SLO: its latency is not planned, only its throughput.
    return Template(model=spec.model, phase=Phase(spec.phase), slo_ms=math.inf, budget_ms=math.inf,
                    nodes=(LOCAL_NODE,) * nodes, placement=placement)


@dataclasses.dataclass(slots=True)
class AllocatorPlanner:
    """`planner(observed_demand, running) -> desired` for `Controller`, backed by the allocation ILP.

    The candidate instances are the distinct shapes of the cluster file (prefill and decode;
    `mixed` instances are kept as they are). Each engine process is one node of price
    `node_usd_per_h`; at most `max_nodes` run per region. Demand is the observed tokens/s over
    `target_utilization` with a floor of `min_instances` instance per (model, phase) that has one.
    """

    shapes: Sequence[InstanceSpec]
    node_usd_per_h: float = 1.0
    max_nodes: int = 64
    target_utilization: float = 0.8
    init_s: float = 10.0
    min_instances: int = 1
    options: SolveOptions = dataclasses.field(default_factory=lambda: SolveOptions(time_limit_s=10.0))

    def __call__(self, demand: Demand, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        # Shapes with the same model, phase and node count are the same template to the
        # allocator: keep the one that serves most.
        best: dict[str, tuple[Template, InstanceSpec]] = {}
        for s in self.shapes:
            if s.phase not in ("prefill", "decode"):
                continue
            t = _template(s)
            if t.key not in best or t.throughput_tok_per_s > best[t.key][0].throughput_tok_per_s:
                best[t.key] = (t, s)
        groups: dict[tuple[str, Phase], list[Template]] = {}
        for t, _ in best.values():
            groups.setdefault((t.model, t.phase), []).append(t)
        regions = sorted({s.region for _, s in best.values()})
        want = {}
        for (model, phase), ts in groups.items():
            observed = float(demand.get(model, {}).get(phase.value, 0.0)) / self.target_utilization
            want[(model, phase)] = max(observed, self.min_instances * min(t.throughput_tok_per_s for t in ts))
        models = tuple(sorted({m for m, _ in groups}))
        for m in models:  # a phase without a shape has no demand to meet here
            for ph in Phase:
                want.setdefault((m, ph), 0.0)
        inputs = AllocationInputs(
            models=models, regions=tuple(regions), configs=(LOCAL_NODE,),
            prices={(r, LOCAL_NODE): self.node_usd_per_h for r in regions},
            availability={(r, LOCAL_NODE): self.max_nodes for r in regions},
            demand=want, allowed_regions={m: tuple(regions) for m in models},
            slo_ms={g: 0.0 for g in want}, templates={g: tuple(ts) for g, ts in groups.items()}, init_s=self.init_s)
        key_of = {shape_key(s): t.key for t, s in best.values()}
        prev = Counter((s.region, key_of[shape_key(s)]) for s in running if shape_key(s) in key_of)
        plan = allocate_inputs(inputs, prev=dict(prev), options=self.options)
        desired: list[InstanceSpec] = [s for s in running if s.phase == "mixed"]
        for inst in plan.instances:
            spec = best[inst.template.key][1]
            desired.extend(dataclasses.replace(spec, region=inst.region) for _ in range(inst.count))
        if not desired and running:
            return list(running)  # never plan the cluster away entirely
        return desired


__all__ = ["LOCAL_NODE", "AllocatorPlanner"]
