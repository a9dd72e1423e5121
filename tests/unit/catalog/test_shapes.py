"""Only shapes that exist, unless a scenario opts in to derived ones; suspect prices are flagged."""
import json

import pytest
import yaml
from click.testing import CliRunner

from coral.catalog import builtin_catalog
from coral.cli import main
from coral.scenario import builtin_scenario_names, load_scenario

CAT = builtin_catalog()


def _sold(region: str, config: str) -> bool:
    return (region, config) in CAT.offers


@pytest.mark.parametrize("name", [n for n in builtin_scenario_names() if n != "helix"])
def test_no_builtin_offer_is_an_unmarked_unsold_shape(name):
    s = load_scenario(name)
    assert s.prices  # the scenario offers something
    for (region, config) in s.prices:
        assert _sold(region, config) or s.is_derived(region, config), (region, config)
        assert not (_sold(region, config) and s.is_derived(region, config)), (region, config)


def test_helix_offers_are_marked_too(data_dir):  # helix's perf model reads the Helix profiles
    s = load_scenario("helix")
    for (region, config) in s.prices:
        assert _sold(region, config) or s.is_derived(region, config), (region, config)
    assert s.is_derived("aws:us-east-2", "2xT4") and not s.is_derived("aws:us-east-2", "4xT4")


def test_derived_price_comes_from_the_nearest_larger_sold_shape():
    s = load_scenario("extended", {"derive_missing_prices": True})  # the built-in offers only sold shapes
    # aws:us-east-2 sells A100-40GB only as 8x (p4d): every smaller shape is 1/8 of it per GPU
    p8 = CAT.offers[("aws:us-east-2", "8xA100-40GB")].price_usd_per_h
    for n in (1, 2, 4):
        assert s.prices[("aws:us-east-2", f"{n}xA100-40GB")] == pytest.approx(p8 / 8 * n)
    # 2xL4 from 4xL4, not from the cheaper-per-GPU 1xL4
    p4 = CAT.offers[("aws:us-east-2", "4xL4")].price_usd_per_h
    p1 = CAT.offers[("aws:us-east-2", "1xL4")].price_usd_per_h
    assert s.prices[("aws:us-east-2", "2xL4")] == pytest.approx(p4 / 2) != pytest.approx(2 * p1)
    # no A10G node larger than 4 GPUs in ap-northeast-2: 8xA10G is not offered there
    assert ("aws:ap-northeast-2", "8xA10G") not in s.prices


def _write(tmp_path, **extra):
    data = {"name": "t", "models": [{"name": "phi-4", "ttft_ms": 1000, "tpot_ms": 50,
                                     "workload": {"rate_per_s": 1, "dataset": "azure-conv"}}],
            "configs": ["1xL40S", "2xL40S", "4xL40S", "1xH100", "8xH100"],
            "regions": [{"name": "aws:us-east-2"}, {"name": "gcp:us-central1"}], **extra}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_default_offers_only_sold_shapes(tmp_path):
    s = load_scenario(_write(tmp_path))
    assert ("aws:us-east-2", "2xL40S") not in s.prices and not s.derived
    assert set(s.prices) == {k for k in [(r, c) for r in s.regions for c in (x.name for x in s.configs)] if _sold(*k)}


def test_price_override_of_an_unsold_shape_is_still_derived(tmp_path):
    s = load_scenario(_write(tmp_path, derive_missing_prices=True,
                             regions=[{"name": "aws:us-east-2", "prices": {"2xL40S": 4.0}}]))
    assert s.prices[("aws:us-east-2", "2xL40S")] == 4.0 and s.is_derived("aws:us-east-2", "2xL40S")


def test_suspect_rows_warn(tmp_path):
    s = load_scenario(_write(tmp_path))
    warned = s.warnings()
    # GCP us-central1 H100 x1 and x8 (and its other 8-GPU type) are priced from rows tagged [SUSPECT]
    assert [w.split(" is priced")[0] for w in warned] == ["gcp:us-central1 1xH100", "gcp:us-central1 8xH100",
                                                          "gcp:us-central1 8xH100@a3-megagpu-8g"]
    assert all("SUSPECT" in w for w in warned)
    # an offer with no nodes available cannot be rented: no warning
    s = load_scenario(_write(tmp_path, regions=[{"name": "gcp:us-central1", "availability": {"1xH100": 0, "8xH100": 0}}]))
    assert s.warnings() == []
    # a price the scenario sets itself is not the suspect row's
    # (a shape's price is its default type's; another type of it keeps its own price)
    s = load_scenario(_write(tmp_path, regions=[{"name": "gcp:us-central1", "prices": {
        "1xH100": 11.0, "8xH100": 88.0, "8xH100@a3-megagpu-8g": 99.0}}]))
    assert s.warnings() == []


@pytest.mark.parametrize("name", [n for n in builtin_scenario_names() if n != "helix"])
def test_builtins_avoid_suspect_rows(name):
    assert load_scenario(name).warnings() == []


def test_scenario_show_marks_and_warns(tmp_path):
    path = _write(tmp_path, derive_missing_prices=True)
    res = CliRunner().invoke(main, ["scenario", "show", path, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    offers = {(r["name"], o["config"]): o for r in data["regions"] for o in r["offers"]}
    assert offers[("aws:us-east-2", "2xL40S")]["derived"] is True
    assert offers[("aws:us-east-2", "4xL40S")]["derived"] is False
    assert "SUSPECT" in offers[("gcp:us-central1", "8xH100")]["suspect"]
    assert len(data["warnings"]) == 3 and "warning: gcp:us-central1 1xH100" in res.stderr
    table = CliRunner().invoke(main, ["scenario", "show", path])
    assert table.exit_code == 0 and "derived" in table.stdout and "SUSPECT" in table.stdout


def test_plan_marks_derived_shapes(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny", "models": [{"name": "phi-4", "ttft_ms": 3000, "tpot_ms": 80,
                                    "workload": {"rate_per_s": 2, "dataset": "azure-conv"}}],
        "configs": ["g6e.xlarge", "2xL40S"], "regions": [{"name": "aws:us-east-2"}],
        "derive_missing_prices": True, "planner": {"n_max": 2}}))
    args = ["plan", "--scenario", str(path), "--method", "homo", "--cache-dir", str(tmp_path / "cache")]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    derived = {n["config"]: n["derived"] for n in data["nodes"]}
    assert derived["2xL40S"] is True and derived.get("1xL40S", False) is False  # 1xL40S (2.5 Gbps) may go unused
    for i in data["instances"]:
        assert i["derived"] == ("2xL40S" in i["nodes"])
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0 and "2xL40S (derived)" in table.stdout
