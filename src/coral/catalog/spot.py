"""Spot offers: an instance type's spot price with the preemption and availability process behind it.

The process comes from `coral/data/availability/spot_fit_aws_v100.csv`, which
`tools/fit_spot.py` fits from SkyPilot's *Can't Be Late* traces (AWS V100, NSDI'24; the data
README says where from). Those traces cover V100 and K80 only: **no public trace covers L4,
A10G, L40S, A100, H100 or B200**, so every GPU's spot offer in a region uses that region's V100
fit as its proxy, and a region with no trace (aws:ap-northeast-2, gcp:us-central1) the V100
pool of every traced zone. The `source` of each process says which; a scenario may give its own
rate and correlation instead (`regions[].spot_preemption_per_h`, `spot_co_loss_share`).
"""
from __future__ import annotations

import csv
import functools
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from coral.errors import CoralError

FIT_FILE = "availability/spot_fit_aws_v100.csv"
POOL = "pool"
PROXY_NOTE = "V100 proxy: no public trace covers L4/A10G/L40S/A100/H100/B200"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotProcess:
    """How spot nodes of one offer come and go.

    Attributes:
        preemption_per_node_h: rate of the Poisson process that takes one held node (per node-hour).
        co_loss_share: correlation within a zone, in [0, 1]: for a node that is lost, the share of
            the other held nodes lost with it (0: independent, 1: all fall together).
        availability: share of the requested spot capacity that can be held, in (0, 1].
        recovery_s: mean time from a loss until the capacity is back (the cloud gives it again).
        source: where the numbers come from (the fit's row and the proxy, or the scenario).
    """

    preemption_per_node_h: float
    co_loss_share: float
    availability: float
    recovery_s: float
    source: str

    def __post_init__(self) -> None:
        if not (self.preemption_per_node_h >= 0 and math.isfinite(self.preemption_per_node_h)):
            raise ValueError(f"preemption_per_node_h must be a finite number >= 0, got {self.preemption_per_node_h}")
        if not 0 <= self.co_loss_share <= 1:
            raise ValueError(f"co_loss_share must be in [0, 1], got {self.co_loss_share}")
        if not 0 < self.availability <= 1:
            raise ValueError(f"availability must be in (0, 1], got {self.availability}")
        if not (self.recovery_s >= 0 and math.isfinite(self.recovery_s)):
            raise ValueError(f"recovery_s must be a finite number >= 0, got {self.recovery_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotOffer:
    """The spot offer of a configuration in a region, beside its on-demand one."""

    region: str
    config: str
    instance_type: str
    spot_usd_per_h: float
    on_demand_usd_per_h: float
    process: SpotProcess

    @property
    def discount(self) -> float:
        """Spot price as a share of the on-demand price (0.3: 70 % off)."""
        return self.spot_usd_per_h / self.on_demand_usd_per_h if self.on_demand_usd_per_h else 1.0


def parse_spot_fits(text: str, where: str = FIT_FILE) -> dict[str, SpotProcess]:
    """The region and pool rows of a fit CSV (`tools/fit_spot.py`'s columns), by region
    (`aws:us-east-1`, ..., and `pool`).

    Raises:
        CoralError: naming the row and column of a missing or bad value.
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    out: dict[str, SpotProcess] = {}
    for i, row in enumerate(csv.DictReader(io.StringIO("\n".join(lines))), start=2):
        if row.get("scope") not in ("region", "pool"):
            continue
        at = f"{where} row {i}"
        values = {}
        for key in ("preemption_per_node_h", "co_loss_share", "availability", "recovery_mean_s"):
            try:
                values[key] = float(row.get(key) or "")
            except ValueError:
                raise CoralError(f"{at}: column {key!r} is {row.get(key)!r}, not a number") from None
        name = row["name"]
        try:
            out[name] = SpotProcess(
                preemption_per_node_h=values["preemption_per_node_h"], co_loss_share=values["co_loss_share"],
                availability=values["availability"], recovery_s=values["recovery_mean_s"],
                source=f"fit {name} ({PROXY_NOTE})")
        except ValueError as exc:
            raise CoralError(f"{at}: {exc}") from None
    if POOL not in out:
        raise CoralError(f"{where}: no `pool` row; rewrite it with tools/fit_spot.py")
    return out


@functools.cache
def builtin_spot_fits() -> Mapping[str, SpotProcess]:
    """The shipped fit's processes by region (and `pool`)."""
    return parse_spot_fits(resources.files("coral").joinpath("data", FIT_FILE).read_text())


def fitted_process(region: str, fits: Mapping[str, SpotProcess] | None = None) -> SpotProcess:
    """The spot process of `region`: its own fitted row where the traces cover it, else the pool's."""
    table = builtin_spot_fits() if fits is None else fits
    if region in table:
        return table[region]
    pool = table[POOL]
    return SpotProcess(preemption_per_node_h=pool.preemption_per_node_h, co_loss_share=pool.co_loss_share,
                       availability=pool.availability, recovery_s=pool.recovery_s,
                       source=f"fit pool of every traced AWS zone; {region} has no trace ({PROXY_NOTE})")
