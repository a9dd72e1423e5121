"""Spot offers (issue 30): every sold instance type with a spot price gets one, with the fitted
process; the fit's arithmetic is checked on a hand-made trace."""
from __future__ import annotations

import csv
import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

from coral.catalog import SpotProcess, builtin_catalog, builtin_spot_fits, fitted_process
from coral.catalog.spot import parse_spot_fits
from coral.errors import CoralError

REPO = Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("fit_spot", REPO / "tools" / "fit_spot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fit_spot"] = module
    spec.loader.exec_module(module)
    return module


def test_every_offer_with_a_spot_price_has_a_spot_offer():
    catalog = builtin_catalog()
    for (region, config), offer in catalog.offers.items():
        spot = catalog.spot_offer(region, config)
        if offer.spot_usd_per_h is None:
            assert spot is None
            continue
        assert spot is not None
        assert (offer.spot_usd_per_h, offer.price_usd_per_h, offer.instance_type) == (
            spot.spot_usd_per_h, spot.on_demand_usd_per_h, spot.instance_type)
        assert "V100 proxy" in spot.process.source


def test_traced_regions_use_their_row_and_the_others_the_pool():
    fits = builtin_spot_fits()
    assert {"aws:us-east-1", "aws:us-east-2", "aws:us-west-2", "pool"} == set(fits)
    assert fits["aws:us-east-2"] == fitted_process("aws:us-east-2")
    gcp = fitted_process("gcp:us-central1")
    assert fits["pool"].preemption_per_node_h == gcp.preemption_per_node_h
    assert "gcp:us-central1 has no trace" in gcp.source


def test_a_users_process_replaces_the_fit():
    mine = SpotProcess(preemption_per_node_h=0.1, co_loss_share=0.0, availability=1.0, recovery_s=0.0, source="scenario")
    spot = builtin_catalog().spot_offer("aws:us-east-2", "1xL40S", mine)
    assert spot is not None and mine == spot.process
    assert pytest.approx(0.5261 / 1.861) == spot.discount


def test_a_bad_fit_row_is_named():
    text = ("scope,name,preemption_per_node_h,co_loss_share,availability,recovery_mean_s\n"
            "pool,pool,-1,0.5,0.5,10\n")
    with pytest.raises(CoralError, match=r"fit.csv row 2: preemption_per_node_h must be a finite number >= 0"):
        parse_spot_fits(text, "fit.csv")
    with pytest.raises(CoralError, match="no `pool` row"):
        parse_spot_fits("scope,name\n", "fit.csv")


def test_the_fit_on_a_hand_made_trace(tmp_path):
    """A 4-node series, 1 h ticks: held 4, 4, 2 (lose 2 of 4), 2, 1 (lose 1 of 2), 4.
    node-hours held 4+4+2+2+1+4 = 17; nodes lost 3 -> 3/17 per node-hour; co-loss share
    (2*1 + 1*0) / (2*3 + 1*1) = 2/7; availability 17 / 24; one spell below 4, from the first
    loss (t=2 h) back to full (t=5 h): 3 h."""
    tool = _tool()
    values = [4, 4, 2, 2, 1, 4]
    cols = ["series_id", "kind", "nodes_requested", "cloud", "region", "zone", "gpu", "gpus_per_instance",
            "instance_type", "trace_start_date", "gap_seconds", "start_tick", "end_tick", "start_s", "end_s", "value"]
    path = tmp_path / "trace.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for t, v in enumerate(values):  # one run per tick; equal neighbours are fine for the fit
            w.writerow(["s", "preemption", 4, "aws", "us-east-1", "us-east-1f", "V100", 1, "p3.2xlarge",
                        "2023-08-03", 3600, t, t + 1, t * 3600, (t + 1) * 3600, v])
    rows = {r["name"]: r for r in csv.DictReader(
        ln for ln in tool.fit_table(path).splitlines() if not ln.startswith("#"))}
    s = rows["s"]
    assert ("17", "3", "2") == (s["node_hours_held"], s["nodes_lost"], s["loss_events"])
    assert pytest.approx(3 / 17, rel=1e-3) == float(s["preemption_per_node_h"])
    assert pytest.approx(2 / 7, rel=1e-3) == float(s["co_loss_share"])
    assert pytest.approx(17 / 24, rel=1e-3) == float(s["availability"])
    assert ("1.08e+04", "1") == (s["recovery_mean_s"], s["recovery_spells"])
    assert "0.5" == s["multi_node_event_share"]
    # per-hour losses 0,0,2,0,1,0: mean 0.5, sample variance (4*0.25 + 2.25 + 0.25) / 5 = 0.7
    hourly = [0, 0, 2, 0, 1, 0]
    var = sum((x - 0.5) ** 2 for x in hourly) / 5
    assert pytest.approx(var / 0.5, rel=1e-3) == float(s["dispersion_index"])
    assert rows["aws:us-east-1"]["preemption_per_node_h"] == s["preemption_per_node_h"]
