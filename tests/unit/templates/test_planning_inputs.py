"""The per-model planning input (`coral.templates.planning.plan_inputs`): built once per scenario
content, frozen, and the one source of the budgets, the KV model and the queueing SLOs."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from coral.perf.model import Phase
from coral.scenario import load_scenario
from coral.slo import component_quantile
from coral.templates.planning import plan_inputs

SMALL = {
    "name": "small", "description": "one model, Poisson, three configurations",
    "models": [{"name": "phi-4", "ttft_ms": 2500, "tpot_ms": 80,
                "workload": {"rate_per_s": 2, "dataset": "synthetic", "prompt_tokens_mean": 600,
                             "output_tokens_mean": 60}}],
    "configs": ["1xL40S", "4xL40S", "1xL4"],
    "regions": [{"name": "aws:us-east-2"}],
    "planner": {"n_max": 2, "batch_grid": [1, 4, 16, 64], "history_s": 900, "epoch_s": 120},
}


def _load(tmp_path, data, name="s.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return load_scenario(str(p))


def test_one_value_per_scenario_content_and_it_is_frozen(tmp_path):
    a, b = _load(tmp_path, SMALL, "a.yaml"), _load(tmp_path, SMALL, "b.yaml")
    assert a is not b
    assert plan_inputs(a) is plan_inputs(b)  # keyed on the content, not on the object
    tighter = _load(tmp_path, {**SMALL, "models": [{**SMALL["models"][0], "tpot_ms": 60}]}, "c.yaml")
    assert plan_inputs(tighter) is not plan_inputs(a)
    mp = plan_inputs(a).of("phi-4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.decode_budget_ms = 1.0  # type: ignore[misc]
    with pytest.raises(KeyError, match="no-such-model"):
        plan_inputs(a).of("no-such-model")


def test_budgets_and_queueing_slos_take_the_kv_allowance_from_one_phase(tmp_path):
    s = _load(tmp_path, SMALL)
    mp = plan_inputs(s).of("phi-4")
    planner = s.planner
    assert component_quantile(s.model("phi-4").slo.attainment) == mp.quantile == mp.lengths.quantile
    assert mp.slo.ttft_ms * planner.ttft_headroom == mp.budget_ms(Phase.PREFILL)
    in_tpot = mp.kv.allowance_ms if mp.kv.owner is Phase.DECODE else 0.0
    assert mp.slo.tpot_ms * planner.tpot_headroom - in_tpot == mp.budget_ms(Phase.DECODE)
    # the queueing model gets the SLO less the allowance, in the one phase the transfer counts in
    taken = {ph: mp.slo.ms(ph) / 1e3 - mp.queueing_slo_s(ph) for ph in (Phase.PREFILL, Phase.DECODE)}
    assert sorted(taken.values()) == pytest.approx([0.0, mp.kv.allowance_ms / 1e3])
    assert taken[mp.kv.owner] == pytest.approx(mp.kv.allowance_ms / 1e3)
    spec = s.model("phi-4").spec
    assert spec.num_layers * spec.kv_bytes_per_token_layer == mp.kv_bytes_per_token
    assert tuple(c.name for c in s.configs) == tuple(c.name for c in mp.configs)
    assert s.planner.history_s == mp.history.window_s
