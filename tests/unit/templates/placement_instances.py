"""Seeded random tiny placement problems shared by the ILP / oracle / exact-search tests."""
from __future__ import annotations

import random

from coral.templates.problem import PlacementProblem


def random_problem(seed: int) -> PlacementProblem:
    """A tiny problem (≤ 4 nodes, L ≤ 10) from a few node types, so identical nodes are common;
    about a fifth come out infeasible (tight memory or budget)."""
    rng = random.Random(seed)
    kinds = []
    for i in range(rng.randint(1, 3)):
        t = rng.uniform(0.5e-3, 4e-3)
        first, last = rng.uniform(0, 1e-3), rng.uniform(0, 5e-3)
        layers_fit = rng.randint(4, 16)
        # first/last stages hold the embedding / LM head, so they fit fewer layers
        cap = (layers_fit - rng.randint(0, 1), layers_fit, layers_fit - rng.randint(0, 1), layers_fit - rng.randint(0, 2))
        kinds.append((f"cfg{i}", t, (first, 0.0, last, first + last), cap))
    k = rng.randint(1, 4)
    picked = [rng.choice(kinds) for _ in range(k)]
    stages = rng.randint(1, k)
    layers = rng.randint(max(stages, 2), 10)
    comm = rng.choice([0.0, rng.uniform(0, 2e-3)]) if stages > 1 else 0.0
    # a budget around the time of the whole model on the average node
    mean_t = sum(kd[1] for kd in picked) / k
    budget = rng.uniform(0.6, 2.2) * layers * mean_t + 3e-3
    return PlacementProblem(
        num_layers=layers, stages=stages, batch=rng.choice([1, 4, 16]),
        nodes=tuple(kd[0] for kd in picked), t=tuple(kd[1] for kd in picked), o=tuple(kd[2] for kd in picked),
        cap=tuple(kd[3] for kd in picked), u=float(rng.choice([1, 8, 512])), budget_s=budget, comm_s=comm)
