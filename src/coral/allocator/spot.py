"""The spot discount rule (issue 30, foundations): what a spot template's capacity counts for.

A template of `n` spot nodes serves only while every one of its nodes is held: a pipeline
replica dies with any one node. Its capacity therefore counts at

    availability x P(all n nodes survive the exposure window)

where

- `availability` is the spot process's expected share of requested capacity that can be held
  (`SpotProcess.availability`, fitted from the traces);
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

The rule is conservative where it counts a replica that falls at any moment of the window as
lost for all of it (the expected up-time of such a replica is higher), and optimistic where the
fitted V100 process is the proxy for a GPU whose own spot market no public trace covers. What
uses it, and what does not yet (the ILP, the simulator): docs/reference/allocator.md, "Spot
capacity (issue 30, foundations)".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from coral.catalog.spot import SpotProcess

HOUR_S = 3600.0


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
        availability: expected share of the requested spot capacity that can be held.
        factor: availability x survival; the template's capacity counts at this share.
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
                        factor=process.availability * survival)


def discounted_capacity_tok_per_s(capacity_tok_per_s: float, nodes: int, process: SpotProcess,
                                  epoch_s: float, init_s: float) -> float:
    """A spot template's capacity as the plan may count it: its on-demand capacity x the discount."""
    if not (capacity_tok_per_s >= 0 and math.isfinite(capacity_tok_per_s)):
        raise ValueError(f"capacity_tok_per_s must be a finite number >= 0, got {capacity_tok_per_s}")
    return capacity_tok_per_s * spot_discount(nodes, process, epoch_s, init_s).factor
