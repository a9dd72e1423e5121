"""A scenario's spot offers: per region with `spot: true`, each configuration's spot instance
beside its on-demand one (issue 30). With spot off nowhere, a scenario has none and nothing
else changes."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from coral.catalog.catalog import Catalog, did_you_mean
from coral.catalog.spot import SpotOffer, SpotProcess, fitted_process
from coral.errors import CoralError
from coral.scenario.schema import RegionEntry, ScenarioFile


def region_process(entry: RegionEntry) -> SpotProcess:
    """The region's spot process: the fit, with the scenario's own rate and correlation where given."""
    fit = fitted_process(entry.name)
    if entry.spot_preemption_per_h is None and entry.spot_co_loss_share is None:
        return fit
    own = [f for f, v in (("spot_preemption_per_h", entry.spot_preemption_per_h),
                          ("spot_co_loss_share", entry.spot_co_loss_share)) if v is not None]
    return dataclasses.replace(
        fit,
        preemption_per_node_h=fit.preemption_per_node_h if entry.spot_preemption_per_h is None
        else entry.spot_preemption_per_h,
        co_loss_share=fit.co_loss_share if entry.spot_co_loss_share is None else entry.spot_co_loss_share,
        source=f"scenario ({', '.join(own)}); the rest: {fit.source}")


def share_caps(file: ScenarioFile, i: int) -> dict[str, float]:
    """Model -> its spot share cap in `file.regions[i]` (every model; 1 where none is set).

    Raises:
        CoralError: a cap for a model the scenario does not serve.
    """
    entry = file.regions[i]
    models = [m.name for m in file.models]
    if not isinstance(entry.spot_share_cap, dict):
        return {m: entry.spot_share_cap for m in models}
    for name in entry.spot_share_cap:
        if name not in models:
            raise CoralError(f"scenario {file.name}: regions.{i}.spot_share_cap names model {name!r}, which the "
                             f"scenario does not serve ({', '.join(models)}){did_you_mean(name, models)}")
    return {m: entry.spot_share_cap.get(m, 1.0) for m in models}


def spot_offers(file: ScenarioFile, catalog: Catalog, prices: Mapping[tuple[str, str], float],
                derived: frozenset[tuple[str, str]] | set[tuple[str, str]]
                ) -> tuple[dict[tuple[str, str], SpotOffer], dict[tuple[str, str], float]]:
    """The spot offers of the regions with `spot: true`, by (region, configuration), and each
    model's `spot_share_cap` there, by (region, model). A configuration gets one where the region
    sells it with a spot price (a derived shape has none); its on-demand price is the scenario's.

    Raises:
        CoralError: a region with `spot: true` where none of the scenario's configurations has a spot
            price, or a cap for a model the scenario does not serve.
    """
    offers: dict[tuple[str, str], SpotOffer] = {}
    caps: dict[tuple[str, str], float] = {}
    for i, entry in enumerate(file.regions):
        if not entry.spot:
            continue
        process = region_process(entry)
        found = 0
        for (region, config), price in sorted(prices.items()):
            if region != entry.name or (region, config) in derived:
                continue
            offer = catalog.spot_offer(region, config, process)
            if offer is not None:
                offers[(region, config)] = dataclasses.replace(offer, on_demand_usd_per_h=price)
                found += 1
        if not found:
            sold = sorted(c for r, c in prices if r == entry.name)
            raise CoralError(
                f"scenario {file.name}: regions.{i}.spot is true but {entry.name} has no spot price for any of its "
                f"configurations ({', '.join(sold) or 'none'}); set spot: false there, or give prices_csv "
                "with a spot_price_per_hour column")
        caps.update({(entry.name, m): cap for m, cap in share_caps(file, i).items()})
    return offers, caps
