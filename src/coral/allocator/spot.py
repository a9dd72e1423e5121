"""Spot capacity in the plan (issue 30): the discount rule, and the spot markets of the ILP.

A template of `n` spot nodes serves only while every one of its nodes is held: a pipeline
replica dies with any one node. Its capacity therefore counts at

    P(all n nodes survive the exposure window)

where

- the exposure window is one epoch plus a replacement's start-up, `epoch_s + init_s`: a replica
  lost during an epoch is replaced at the next plan at the earliest, and the replacement serves
  only `init_s` after that;
- survival follows a common-shock model of preemptions within a zone. Each node is lost at rate
  `r` per node-hour (Poisson). A share `rho` of that rate (`SpotProcess.co_loss_share`) comes
  from zone-wide events that take every held node at once, the rest, `(1 - rho) r`, hits each
  node on its own. All n nodes survive a window of `T` hours with probability

      exp(-rho r T) x exp(-(1 - rho) r T n)  =  exp(-r T n_eff),   n_eff = 1 + (1 - rho)(n - 1)

  rho = 0 gives independent nodes, exp(-r T n); rho = 1 gives one event for all, exp(-r T).
  In this model a lost node's every other held node is lost with it with probability rho, which
  is how `tools/fit_spot.py` measures `co_loss_share` from the multi-node traces.

The planner rents spot nodes it can have now (a pool lost to a preemption is "down" until the
capacity comes back, and the plan then falls back to on-demand or another region), so what it
counts is the capacity it holds *given that it holds it now*: the survival probability. The
fitted `availability` (the long-run share of requested nodes held) is the outcome of the same
preemption-and-recovery process, which the simulator replays; multiplying it in as well would
count the losses twice and make the plan pay for nodes it never needs.

The rule is conservative where it counts a replica that falls at any moment of the window as
lost for all of it (the expected up-time of such a replica is higher), and optimistic where the
fitted V100 process is the proxy for a GPU whose own spot market no public trace covers. The
model and where it holds: docs/reference/allocator.md, "Spot capacity".

Inside the ILP a region's spot offers are a market of their own, `spot_region(region)`, with
the spot prices, the same node availability as the region's on-demand offers, and each column's
capacity times the discount of its template's node count.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coral.catalog.spot import SpotProcess
from coral.errors import CoralError
from coral.scenario import Scenario

HOUR_S = 3600.0
SPOT_SUFFIX = "#spot"  # `spot_region`: never part of a real region name (names are `cloud:region`)


def spot_region(region: str) -> str:
    """The key of `region`'s spot market inside the allocator (`prev` keys of spot instances too)."""
    return region + SPOT_SUFFIX


def is_spot_region(market: str) -> bool:
    return market.endswith(SPOT_SUFFIX)


def base_region(market: str) -> str:
    """The region of a market key: `spot_region(r)` and `r` both give `r`."""
    return market[: -len(SPOT_SUFFIX)] if is_spot_region(market) else market


def effective_nodes(nodes: int, co_loss_share: float) -> float:
    """n_eff = 1 + (1 - rho)(n - 1): how many independent nodes' worth of risk `nodes` carry."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if not 0 <= co_loss_share <= 1:
        raise ValueError(f"co_loss_share must be in [0, 1], got {co_loss_share}")
    return 1.0 + (1.0 - co_loss_share) * (nodes - 1)


def survival_probability(nodes: int, preemption_per_node_h: float, co_loss_share: float, window_s: float) -> float:
    """P(all `nodes` survive `window_s`) under the common-shock model: exp(-r T n_eff), T in hours."""
    if not (preemption_per_node_h >= 0 and math.isfinite(preemption_per_node_h)):
        raise ValueError(f"preemption_per_node_h must be a finite number >= 0, got {preemption_per_node_h}")
    if not (window_s >= 0 and math.isfinite(window_s)):
        raise ValueError(f"window_s must be a finite number >= 0, got {window_s}")
    return math.exp(-preemption_per_node_h * window_s / HOUR_S * effective_nodes(nodes, co_loss_share))


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotDiscount:
    """What a spot template's capacity counts for, and why.

    Attributes:
        nodes: the template's nodes (all spot, all needed).
        window_s: epoch_s + init_s, the time every node must be held.
        survival: P(all nodes survive the window).
        availability: the process's long-run share of requested spot capacity held (reported,
            not multiplied in: the plan rents only pools it can have now; see the module).
        factor: the share the template's capacity counts at (= survival).
    """

    nodes: int
    window_s: float
    survival: float
    availability: float
    factor: float


def spot_discount(nodes: int, process: SpotProcess, epoch_s: float, init_s: float) -> SpotDiscount:
    """The discount of a template of `nodes` spot nodes under `process`, re-planned every `epoch_s`
    with replacements that take `init_s` to start."""
    if not (epoch_s > 0 and math.isfinite(epoch_s)):
        raise ValueError(f"epoch_s must be a finite number > 0, got {epoch_s}")
    if not (init_s >= 0 and math.isfinite(init_s)):
        raise ValueError(f"init_s must be a finite number >= 0, got {init_s}")
    window_s = epoch_s + init_s
    survival = survival_probability(nodes, process.preemption_per_node_h, process.co_loss_share, window_s)
    return SpotDiscount(nodes=nodes, window_s=window_s, survival=survival, availability=process.availability,
                        factor=survival)


def discounted_capacity_tok_per_s(capacity_tok_per_s: float, nodes: int, process: SpotProcess,
                                  epoch_s: float, init_s: float) -> float:
    """A spot template's capacity as the plan may count it: its on-demand capacity x the discount."""
    if not (capacity_tok_per_s >= 0 and math.isfinite(capacity_tok_per_s)):
        raise ValueError(f"capacity_tok_per_s must be a finite number >= 0, got {capacity_tok_per_s}")
    return capacity_tok_per_s * spot_discount(nodes, process, epoch_s, init_s).factor


def share_table(processes: Sequence[SpotProcess | None], max_nodes: int, epoch_s: float,
                init_s: float) -> np.ndarray:
    """The discount per market and node count: `out[r, n]` is what a template of `n` nodes counts
    at in market `r` (`spot_discount(n, processes[r], ...).factor`; 1 for on-demand markets, whose
    process is None, and for n = 0, which no template has)."""
    out = np.ones((len(processes), max_nodes + 1))
    for r, process in enumerate(processes):
        if process is not None:
            for n in range(1, max_nodes + 1):
                out[r, n] = spot_discount(n, process, epoch_s, init_s).factor
    out.setflags(write=False)
    return out


def add_spot_markets(scenario: Scenario, regions: tuple[str, ...], prices: dict[tuple[str, str], float]
                     ) -> tuple[tuple[str, ...], dict[str, SpotProcess], dict[tuple[str, str], float]]:
    """Add each spot offer's price to `prices` under its region's spot market; return the spot
    markets (in region order), their processes, and the share caps below 1 by (market, model)."""
    processes: dict[str, SpotProcess] = {}
    for (r, c), offer in scenario.spot.items():
        if r in regions:
            if not (math.isfinite(offer.spot_usd_per_h) and offer.spot_usd_per_h >= 0):
                raise CoralError(f"spot price [{r}, {c}] must be a finite number >= 0, got {offer.spot_usd_per_h}")
            prices[(spot_region(r), c)] = offer.spot_usd_per_h
            processes[spot_region(r)] = offer.process
    markets = tuple(spot_region(r) for r in regions if spot_region(r) in processes)
    caps = {(spot_region(r), m): float(v) for (r, m), v in scenario.spot_share_cap.items()
            if spot_region(r) in processes and v < 1.0}
    return markets, processes, caps
