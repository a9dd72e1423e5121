"""Scenario schema, built-ins and resolution."""
import pytest
import yaml

from coral.errors import CoralError, UnknownNameError
from coral.perf import Phase
from coral.scenario import builtin_scenario_names, load_scenario


def test_builtins_resolve():
    assert builtin_scenario_names() == ("core", "extended", "helix")
    core = load_scenario("core")
    assert [m.name for m in core.models] == ["qwen3-32b", "gpt-oss-20b", "phi-4"]
    assert core.regions == ("aws:us-east-2", "aws:ap-northeast-2")
    # the 12 shapes, and every other instance type of them sold in the two regions
    assert len({c.shape for c in core.configs}) == 12 and len(core.configs) == 22
    assert core.config("1xL40S@g6e.4xlarge").network_gbps == 20.0 and core.config("1xL40S").network_gbps == 2.5
    # 2xL40S is not sold on AWS, and the built-ins offer only sold shapes (a 2-GPU engine is a TP2
    # group of a 4xL40S): every plan of them can be rented
    assert ("aws:us-east-2", "2xL40S") not in core.prices and not core.derived
    assert core.prices[("aws:us-east-2", "4xL40S")] == pytest.approx(10.49264)
    ext = load_scenario("extended")
    assert len(ext.models) == 6 and len({c.shape for c in ext.configs}) == 20 and len(ext.regions) == 3


def test_helix_builtin_resolves(data_dir):  # its perf model reads Helix's measured profiles
    helix = load_scenario("helix")
    assert sum(helix.availability.values()) == 4 + 6 + 8 + 4 + 10 + 6 + 4


def test_demand():
    m = load_scenario("core").model("gpt-oss-20b")  # azure-code, as in the paper's Table 3
    # the raw demand: 10 req/s * 2047.8 prompt tokens (the capacity planned for it is the queueing model's)
    assert m.demand_tok_per_s(Phase.PREFILL) == pytest.approx(10 * 2047.8)
    assert m.slo.attainment == 0.95
    assert m.slo_ms(Phase.DECODE) == m.tpot_ms


def _write(tmp_path, data):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


BASE = {"name": "t", "models": [{"name": "phi-4", "ttft_ms": 1000, "tpot_ms": 50, "workload": {"rate_per_s": 1, "dataset": "azure-conv"}}],
        "configs": ["1xL40S"], "regions": [{"name": "aws:us-east-2"}]}


def test_field_paths_in_errors(tmp_path):
    bad = {**BASE, "models": [{**BASE["models"][0], "ttft_ms": -1}]}
    with pytest.raises(CoralError, match=r"models\.0\.ttft_ms: Input should be greater than 0"):
        load_scenario(_write(tmp_path, bad))
    with pytest.raises(CoralError, match="colour: unknown field; valid fields here: configs, default_availability"):
        load_scenario(_write(tmp_path, {**BASE, "colour": "red"}))
    with pytest.raises(CoralError, match=r"regions\.0\.prices: Value error, price of 1xL40S must be a finite number"):
        load_scenario(_write(tmp_path, {**BASE, "regions": [{"name": "aws:us-east-2", "prices": {"1xL40S": float("nan")}}]}))


def test_unknown_names(tmp_path):
    with pytest.raises(UnknownNameError, match="unknown scenario 'cor'; valid scenarios: core, extended, helix"):
        load_scenario("cor")
    with pytest.raises(UnknownNameError, match="unknown region 'aws:mars-1'"):
        load_scenario(_write(tmp_path, {**BASE, "regions": [{"name": "aws:mars-1"}]}))
    with pytest.raises(UnknownNameError, match="unknown model 'phi-5'"):
        load_scenario(_write(tmp_path, {**BASE, "models": [{**BASE["models"][0], "name": "phi-5"}]}))
    with pytest.raises(CoralError, match="names configuration '1xL4', which is not in configs"):
        load_scenario(_write(tmp_path, {**BASE, "regions": [{"name": "aws:us-east-2", "availability": {"1xL4": 3}}]}))
    with pytest.raises(CoralError, match="does not exist"):
        load_scenario(str(tmp_path / "missing.yaml"))


def test_overrides_and_price_override(tmp_path):
    s = load_scenario(_write(tmp_path, {**BASE, "regions": [{"name": "aws:us-east-2", "prices": {"1xL40S": 1.5},
                                                                 "availability": {"1xL40S": 3}}]}),
                      overrides={"planner": {"n_max": 3}})
    assert s.prices[("aws:us-east-2", "1xL40S")] == 1.5 and s.availability[("aws:us-east-2", "1xL40S")] == 3
    assert s.planner.n_max == 3
