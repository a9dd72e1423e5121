"""Hand-made templates and demand-sized clusters, so tests and benchmarks need no library build."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from coral.errors import CoralError
from coral.perf.model import Phase
from coral.policy.routing import InstanceSpec
from coral.templates.exact import solve_exact
from coral.templates.planning import plan_inputs
from coral.templates.problem import build_problem
from coral.templates.template import Template


def hand_template(scenario: Any, model: str, phase: Phase, nodes: Sequence[str], *, stages: int, batch: int,
                  prompt_tokens: float | None = None, output_tokens: float | None = None) -> Template | None:
    """The throughput-optimal template of `model` on exactly `nodes` for one `(stages, batch)`.

    Args:
        scenario: gives the model, its SLO, the node configurations and the performance model.
        model, phase: what to serve.
        nodes: config names (the multiset).
        stages, batch: pipeline depth and micro-batch.
        prompt_tokens, output_tokens: the shape to time (default: the model's workload means).

    Returns:
        The template, or None when no placement fits memory and the SLO.
    """
    served = scenario.model(model)
    budget = plan_inputs(scenario).of(model).budget_ms(phase)
    configs = [scenario.config(n) for n in sorted(nodes)]
    problem = build_problem(scenario.perf, served.spec, phase, configs, stages=stages, batch=batch,
                            prompt_tokens=problem_prompt(served, prompt_tokens),
                            output_tokens=output_tokens if output_tokens is not None else served.output_tokens_mean,
                            budget_ms=budget)
    placement = solve_exact(problem)
    if placement is None:
        return None
    return Template(model=model, phase=phase, slo_ms=served.slo_ms(phase), budget_ms=budget,
                    nodes=tuple(sorted(nodes)), placement=placement, prompt_tokens=problem_prompt(served, prompt_tokens))


def problem_prompt(served: Any, prompt_tokens: float | None) -> float:
    return prompt_tokens if prompt_tokens is not None else served.prompt_tokens_mean


def first_template(scenario: Any, model: str, phase: Phase, *, batches: Sequence[int],
                   shapes: Sequence[Sequence[str]]) -> Template:
    """The first feasible `hand_template` over `shapes` (node lists) × `batches` (largest batch first)
    × stage counts (fewest first).

    Raises:
        CoralError: none is feasible.
    """
    for nodes in shapes:
        for b in sorted(batches, reverse=True):
            for s in range(1, len(nodes) + 1):
                t = hand_template(scenario, model, phase, nodes, stages=s, batch=b)
                if t is not None:
                    return t
    raise CoralError(f"no feasible hand-made template for {model}/{phase.value}")


def sized_cluster(scenario: Any, templates: Sequence[Template], region: str, *, utilization: float = 0.7,
                  demand: dict[tuple[str, Phase], float] | None = None) -> list[InstanceSpec]:
    """Enough instances of each template (one per (model, phase)) for the demand at `utilization`.

    Args:
        scenario: the models' nominal demand when `demand` is None.
        templates: one per (model, phase).
        region: where to place them.
        utilization: target load of each instance.
        demand: (model, phase) -> tok/s.
    """
    out: list[InstanceSpec] = []
    for t in templates:
        if demand is not None:
            d = demand.get((t.model, t.phase), 0.0)
        else:
            d = scenario.model(t.model).demand_tok_per_s(t.phase)
        n = max(1, math.ceil(d / (t.throughput_tok_per_s * utilization)))
        out.extend(InstanceSpec(template=t, region=region) for _ in range(n))
    return out
