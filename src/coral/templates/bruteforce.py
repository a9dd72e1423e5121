"""A brute-force oracle for tiny placement problems: every assignment × every layer split."""
from __future__ import annotations

import itertools
from collections.abc import Iterator

from coral.errors import CoralError
from coral.templates.problem import Placement, PlacementProblem, evaluate

MAX_LAYERS = 12
MAX_NODES = 4


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """All ways to write `total` as an ordered sum of `parts` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def assignments(nodes: int, stages: int) -> Iterator[list[list[int]]]:
    """All maps of `nodes` nodes onto `stages` stages with no empty stage, as node lists."""
    for owner in itertools.product(range(stages), repeat=nodes):
        groups: list[list[int]] = [[] for _ in range(stages)]
        for k, s in enumerate(owner):
            groups[s].append(k)
        if all(groups):
            yield groups


def solve_bruteforce(problem: PlacementProblem) -> Placement | None:
    """The best placement by exhaustive search (ties on Θ: lower latency, then first found).

    Args:
        problem: a tiny problem (L ≤ 12, ≤ 4 nodes).

    Returns:
        The best placement, or None when none is feasible.

    Raises:
        CoralError: the problem is too large to enumerate.
    """
    p = problem
    if p.num_layers > MAX_LAYERS or len(p.nodes) > MAX_NODES:
        raise CoralError(f"brute force is for L <= {MAX_LAYERS} and <= {MAX_NODES} nodes; "
                         f"got L={p.num_layers}, {len(p.nodes)} nodes")
    best: Placement | None = None
    splits = list(compositions(p.num_layers, p.stages))
    for groups in assignments(len(p.nodes), p.stages):
        for layers in splits:
            cand = evaluate(p, groups, list(layers))
            if cand is None:
                continue
            if best is None or (cand.throughput_tok_per_s, -cand.latency_s) > (best.throughput_tok_per_s, -best.latency_s):
                best = cand
    return best
