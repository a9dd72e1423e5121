"""Spot per region in a scenario (issue 30): offers listed when on, nothing when off, bad input
named with its fix through the CLI (exit 2)."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from coral.cli import main
from coral.scenario import load_scenario

MODEL = {"name": "phi-4", "ttft_ms": 1000, "tpot_ms": 50, "workload": {"rate_per_s": 1, "dataset": "azure-conv"}}


def _write(tmp_path, regions, configs=("1xL40S", "1xL4")):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"name": "t", "models": [MODEL], "configs": list(configs), "regions": regions}))
    return str(p)


def _show(path):
    return CliRunner().invoke(main, ["scenario", "show", path, "--json"])


def test_spot_offers_listed_per_region_when_on(tmp_path):
    path = _write(tmp_path, [{"name": "aws:us-east-2", "spot": True, "spot_share_cap": 0.5},
                             {"name": "gcp:us-central1", "spot": True, "spot_preemption_per_h": 0.2},
                             {"name": "aws:us-east-1"}])
    r = _show(path)
    assert 0 == r.exit_code, r.output
    regions = {x["name"]: x for x in json.loads(r.output)["regions"]}
    assert "spot" not in regions["aws:us-east-1"]
    east = regions["aws:us-east-2"]["spot"]
    assert {"phi-4": 0.5} == east["share_cap"]
    l40s = {o["config"]: o for o in east["offers"]}["1xL40S"]
    assert ("g6e.xlarge", 0.5261, 1.861) == (l40s["instance_type"], l40s["spot_usd_per_h"], l40s["on_demand_usd_per_h"])
    assert "V100 proxy" in east["process"]["source"]
    gcp = regions["gcp:us-central1"]["spot"]["process"]
    assert 0.2 == gcp["preemption_per_node_h"]
    assert gcp["source"].startswith("scenario (spot_preemption_per_h)")


def test_the_on_demand_price_override_carries_to_the_spot_offer(tmp_path):
    s = load_scenario(_write(tmp_path, [{"name": "aws:us-east-2", "spot": True, "prices": {"1xL40S": 1.5}}]))
    assert 1.5 == s.spot[("aws:us-east-2", "1xL40S")].on_demand_usd_per_h


def test_spot_fields_change_nothing_while_spot_is_off(tmp_path):
    plain = load_scenario(_write(tmp_path, [{"name": "aws:us-east-2"}]))
    off = load_scenario(_write(tmp_path, [{"name": "aws:us-east-2", "spot": False, "spot_share_cap": 0.3,
                                           "spot_preemption_per_h": 2.0}]))
    assert {} == off.spot and {} == off.spot_share_cap
    assert (plain.prices, plain.availability) == (off.prices, off.availability)


@pytest.mark.parametrize(("entry", "message"), [
    ({"spot_share_cap": 1.5}, r"regions\.0\.spot_share_cap: .*must be in \(0, 1\], got 1.5; give the largest share"),
    ({"spot_share_cap": 0}, r"regions\.0\.spot_share_cap: .*must be in \(0, 1\], got 0.0"),
    ({"spot_preemption_per_h": -0.1}, r"regions\.0\.spot_preemption_per_h: .*finite number >= 0 .*got -0.1; give e.g."),
    ({"spot_preemption_per_h": float("inf")}, r"regions\.0\.spot_preemption_per_h: .*got inf"),
    ({"spot_share_cap": {"phi-4": 2}}, r"regions\.0\.spot_share_cap: .*spot_share_cap of phi-4 must be in \(0, 1\], got 2"),
    ({"spot_co_loss_share": 1.2}, r"regions\.0\.spot_co_loss_share: .*must be in \[0, 1\], got 1.2"),
])
def test_bad_spot_fields_exit_2_naming_the_field(tmp_path, entry, message):
    r = _show(_write(tmp_path, [{"name": "aws:us-east-2", "spot": True, **entry}]))
    assert 2 == r.exit_code
    assert re.search(message, r.output), r.output


def test_spot_where_no_configuration_has_a_spot_price_exits_2(tmp_path):
    # AWS sells 1xH100 (p5.4xlarge) in us-east-2 with no spot quote in the price data
    r = _show(_write(tmp_path, [{"name": "aws:us-east-2", "spot": True}], configs=("1xH100",)))
    assert 2 == r.exit_code
    assert ("error: scenario t: regions.0.spot is true but aws:us-east-2 has no spot price for any of its "
            "configurations (1xH100); set spot: false there, or give prices_csv with a spot_price_per_hour column"
            ) == " ".join(r.output.split())


def test_a_cap_per_model_and_a_cap_for_a_model_not_served(tmp_path):
    s = load_scenario(_write(tmp_path, [{"name": "aws:us-east-2", "spot": True, "spot_share_cap": {"phi-4": 0.25}},
                                        {"name": "aws:us-east-1", "spot": True}]))
    assert {("aws:us-east-2", "phi-4"): 0.25, ("aws:us-east-1", "phi-4"): 1.0} == s.spot_share_cap
    r = _show(_write(tmp_path, [{"name": "aws:us-east-2", "spot": True, "spot_share_cap": {"phi4": 0.5}}]))
    assert 2 == r.exit_code
    assert ("error: scenario t: regions.0.spot_share_cap names model 'phi4', which the scenario does not serve "
            "(phi-4); did you mean 'phi-4'?") == " ".join(r.output.split())
