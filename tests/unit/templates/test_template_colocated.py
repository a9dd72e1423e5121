"""The colocated template's fields: Θ_P and Θ_D, its chunk, and what it counts towards each demand."""
import pytest

from coral.perf import Phase
from coral.templates.library import template_from_dict, template_to_dict
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template

PLACEMENT = Placement(stages=(Stage(nodes=("2xL40S",), node_index=(0,), layers=64, time_s=0.08,
                                    throughput_tok_per_s=400.0),), micro_batch=32, throughput_tok_per_s=400.0,
                      latency_s=0.08, comm_s=0.0)


def colocated(**kw):
    args = dict(model="qwen3-32b", phase=Phase.COLOCATED, slo_ms=100.0, budget_ms=90.0, nodes=("2xL40S",),
                placement=PLACEMENT, realized_tok_per_s=1500.0, decode_tok_per_s=380.0, chunk_tokens=256)
    args.update(kw)
    return Template(**args)


def test_colocated_serves_both_demands():
    t = colocated()
    assert 1500.0 == t.throughput_tok_per_s
    assert (1500.0, 380.0) == (t.serves_tok_per_s(Phase.PREFILL), t.serves_tok_per_s(Phase.DECODE))
    d = Template(model="qwen3-32b", phase=Phase.DECODE, slo_ms=100.0, budget_ms=90.0, nodes=("2xL40S",),
                 placement=PLACEMENT)
    assert (0.0, 400.0) == (d.serves_tok_per_s(Phase.PREFILL), d.serves_tok_per_s(Phase.DECODE))
    assert "qwen3-32b/colocated/2xL40S" == t.key


def test_colocated_roundtrip():
    t = colocated()
    d = template_to_dict(t)
    assert (256, 380.0) == (d["chunk_tokens"], d["decode_tok_per_s"])
    assert t == template_from_dict(d)


def test_colocated_fields_are_checked():
    with pytest.raises(ValueError, match="decode_tok_per_s > 0"):
        colocated(decode_tok_per_s=None)
    with pytest.raises(ValueError, match="chunk_tokens >= 1"):
        colocated(chunk_tokens=0)
    with pytest.raises(ValueError, match="colocated templates only"):
        Template(model="qwen3-32b", phase=Phase.PREFILL, slo_ms=100.0, budget_ms=90.0, nodes=("2xL40S",),
                 placement=PLACEMENT, chunk_tokens=256)


def test_library_names_the_nodes_a_model_is_not_colocatable_on():
    from coral.scenario import load_scenario
    from coral.templates.library import build_library

    core = load_scenario("core")
    lib = build_library(core, n_max=1, models=["phi-4"])
    st = next(s for s in lib.stats if s.phase is Phase.COLOCATED)
    spec = core.model("phi-4")
    step_budget = spec.slo.tpot_ms * core.planner.tpot_headroom
    for note in st.notes:  # each named node's one-decode, one-token step is over the step budget
        node = note.split(" on ", 1)[1].split(":", 1)[0]
        step_ms = float(note.split("takes ", 1)[1].split(" ms", 1)[0])
        assert step_ms > step_budget
        assert not any(t.nodes == (node,) for t in lib.of("phi-4", Phase.COLOCATED))
    assert any("not colocatable on 2xL4" in n for n in st.notes)
