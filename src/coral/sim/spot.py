"""The spot market a simulated run replays preemptions from (issue 30): per region, when the
cloud takes spot nodes back, which spot pools are gone for how long, and what a spot node costs.

The model is the planner's (`coral.allocator.spot`): a "zone" is a scenario region, and its
spot nodes follow a common-shock process with a per-node rate `r` per hour and a co-loss share
`rho` (`SpotProcess.preemption_per_node_h`, `co_loss_share`). Zone-wide events come at rate
`rho r` per hour and take every spot instance the region holds; independent events come at rate
`(1 - rho) r` per held spot node-hour and take the instance holding that node (a pipeline
replica dies with any one node). Both waits are exponential, so redrawing them whenever the
number of held nodes changes is exact (memoryless). What is drawn is the cloud's notice; the
node leaves `notice_s` later. From the loss, the spot pool (region, configuration) of each of
the lost nodes' configurations stays down for an exponential time with mean
`SpotProcess.recovery_s` (the fitted mean time until spot capacity is back).

Every draw comes from one `numpy.random.Generator` per region, seeded by the run's seed and a
stable hash of the region's name (`region_seed`), so a run is deterministic and the draws of
one region do not depend on what happens in another.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from coral.catalog.spot import SpotOffer, SpotProcess
from coral.errors import CoralError

# AWS gives a spot instance a two-minute interruption notice before it reclaims it (EC2 User
# Guide, "Spot Instance interruption notices"). GCP gives 30 s; pass `spot_notice_s` for that.
AWS_SPOT_NOTICE_S = 120.0
HOUR_S = 3600.0
PREEMPTION_REASON = "spot preemption"  # why a request failed when no instance could take it again


def region_seed(seed: int, region: str) -> list[int]:
    """The entropy of `region`'s generator in a run seeded `seed`: the seed (as an unsigned
    64-bit number) and the first 8 bytes of the SHA-256 of the region's name (Python's `hash`
    of a string changes from one process to the next)."""
    digest = int.from_bytes(hashlib.sha256(region.encode()).digest()[:8], "little")
    return [seed & (2**64 - 1), digest]


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotNotice:
    """One preemption event: the cloud's notice and what it takes.

    Attributes:
        t_s: when the notice came.
        loss_s: when the nodes leave (`t_s + notice_s`).
        region: the zone (scenario region).
        kind: "zone" (a correlated event: every held spot instance of the region) or "node" (one node's).
        instances: ids of the instances noticed.
        nodes: their rented nodes.
    """

    t_s: float
    loss_s: float
    region: str
    kind: str
    instances: tuple[int, ...]
    nodes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotRecord:
    """What the spot market did in a run.

    Attributes:
        notice_s: the notice the cloud gave.
        notices: every preemption event, in time order.
        lost: ids of the noticed instances still running at the loss (draining the work they
            held; the others had drained and stopped before it).
        requeued: re-queue events (a request whose instance was lost, sent to a new prefill).
        requeued_requests: distinct requests re-queued at least once.
        refused: spot instances a plan asked for while their pool was down (not started).
        down: (region, configuration, from_s, until_s) of every spell a spot pool was down.
    """

    notice_s: float
    notices: tuple[SpotNotice, ...]
    lost: tuple[int, ...]
    requeued: int
    requeued_requests: int
    refused: int
    down: tuple[tuple[str, str, float, float], ...]


class SpotMarket:
    """The spot side of the clouds during one simulated run: the preemption draws per region,
    and the pools that are down. `run_simulation` hands the same object to `simulate` (which
    draws from it) and to the re-planner (which plans around `down_at(now)`).

    Attributes:
        notice_at: while the simulator re-plans at a notice, that notice's time; else None. A
            re-planner reads it to tell this unscheduled re-plan from an epoch's.
    """

    def __init__(self, offers: Mapping[tuple[str, str], SpotOffer]) -> None:
        """
        Args:
            offers: (region, configuration) -> its spot offer (`Scenario.spot`).

        Raises:
            CoralError: two configurations of one region with different spot processes (the
                process is the region's: a correlated event takes all of its spot nodes).
        """
        self.offers = dict(offers)
        self.processes: dict[str, SpotProcess] = {}
        for (region, config), offer in self.offers.items():
            seen = self.processes.setdefault(region, offer.process)
            if seen != offer.process:
                raise CoralError(f"spot offers of region {region!r} have different preemption processes "
                                 f"({config} differs); the simulator takes one process per region")
        self.notice_at: float | None = None
        self.begin(0)

    def begin(self, seed: int) -> None:
        """Start a run seeded `seed`: fresh generators, every pool up, nothing recorded."""
        self._seed = seed
        self._rngs: dict[str, np.random.Generator] = {}
        self._down_until: dict[tuple[str, str], float] = {}
        self.down_spells: list[tuple[str, str, float, float]] = []
        self.notice_at = None

    def rng(self, region: str) -> np.random.Generator:
        g = self._rngs.get(region)
        if g is None:
            g = self._rngs[region] = np.random.default_rng(region_seed(self._seed, region))
        return g

    def process(self, region: str) -> SpotProcess:
        """`region`'s spot process.

        Raises:
            CoralError: the region has no spot offer.
        """
        p = self.processes.get(region)
        if p is None:
            raise CoralError(f"region {region!r} has no spot offer; turn spot on there (regions[].spot: true)")
        return p

    def price_usd_per_h(self, region: str, config: str) -> float:
        """What one spot node of `config` costs in `region`.

        Raises:
            CoralError: no spot offer for it.
        """
        offer = self.offers.get((region, config))
        if offer is None:
            raise CoralError(f"no spot offer for {config} in region {region!r}")
        return offer.spot_usd_per_h

    # -- draws ------------------------------------------------------------------------------------
    def next_zone_event_s(self, region: str, now_s: float) -> float:
        """When the next zone-wide event comes, drawn at `now_s` (rate `rho r` per hour); inf if never."""
        p = self.process(region)
        rate_per_s = p.co_loss_share * p.preemption_per_node_h / HOUR_S
        return now_s + float(self.rng(region).exponential(1.0 / rate_per_s)) if rate_per_s > 0 else math.inf

    def next_node_event_s(self, region: str, now_s: float, nodes: int) -> float:
        """When the next independent event takes one of the region's `nodes` held spot nodes,
        drawn at `now_s` (rate `(1 - rho) r` per node-hour); inf if never."""
        p = self.process(region)
        rate_per_s = (1.0 - p.co_loss_share) * p.preemption_per_node_h * nodes / HOUR_S
        return now_s + float(self.rng(region).exponential(1.0 / rate_per_s)) if rate_per_s > 0 else math.inf

    def pick(self, region: str, nodes: Sequence[int]) -> int:
        """Which holder an independent event hits: index `k` with probability `nodes[k] / sum(nodes)`
        (every held node equally likely)."""
        total = sum(nodes)
        if total <= 0:
            raise ValueError("pick needs at least one held node")
        u = float(self.rng(region).random()) * total
        acc = 0
        for k, n in enumerate(nodes):
            acc += n
            if u < acc:
                return k
        return len(nodes) - 1

    def take_down(self, region: str, configs: Collection[str], t_s: float, loss_s: float) -> None:
        """Nodes of `configs` in `region` got their notice at `t_s` and leave at `loss_s`: each
        pool is down from the notice until the loss plus an exponential recovery (mean
        `recovery_s`), one draw per pool (in `configs`' order)."""
        mean = self.process(region).recovery_s
        for c in configs:
            until = loss_s + (float(self.rng(region).exponential(mean)) if mean > 0 else 0.0)
            key = (region, c)
            self._down_until[key] = max(self._down_until.get(key, -math.inf), until)
            self.down_spells.append((region, c, t_s, until))

    # -- state ------------------------------------------------------------------------------------
    def is_down(self, region: str, config: str, now_s: float) -> bool:
        """The pool has lost nodes that are not back at `now_s` (down from the notice on)."""
        return self._down_until.get((region, config), -math.inf) > now_s

    def down_at(self, now_s: float) -> frozenset[tuple[str, str]]:
        """The (region, configuration) spot pools that cannot be had at `now_s` (the planner's `spot_down`)."""
        return frozenset(k for k, until in self._down_until.items() if until > now_s)
