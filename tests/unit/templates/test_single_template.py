"""One template outside a library (`coral templates solve`): its problem, and why a multiset has none."""
import pytest

from coral.catalog import builtin_catalog, builtin_model
from coral.perf import DEMAND_PHASES, Phase, RooflinePerf
from coral.templates.library import (
    infeasible_reason,
    single_template_spec,
    solve_multiset,
    template_timings,
)

CAT = builtin_catalog()
QWEN = builtin_model("qwen3-32b")


def _spec(phase, names, budget_ms, batches=(1, 2, 4, 8)):
    configs = tuple({c.name: c for c in (CAT.config(n) for n in names)}.values())
    return single_template_spec(QWEN, phase, budget_ms * 2, budget_ms, configs, names, prompt_tokens=1024.0,
                                output_tokens=256.0, n_max=2, batches=batches)


def test_prefill_tries_micro_batches_up_to_8_and_n_max_covers_the_multiset():
    assert (1, 2) == _spec(Phase.PREFILL, ["1xL40S"], 100.0, (1, 2, 16)).batches
    assert (1,) == _spec(Phase.PREFILL, ["1xL40S"], 100.0, (16, 32)).batches
    assert (1, 2, 16) == _spec(Phase.DECODE, ["1xL40S"], 100.0, (1, 2, 16)).batches
    assert 3 == _spec(Phase.DECODE, ["1xL40S", "1xL40S", "1xL4"], 100.0).n_max


def test_memory_short_names_the_missing_gib():
    perf, names = RooflinePerf(), ["1xL4"]
    timings = template_timings(perf, _spec(Phase.DECODE, names, 100.0))
    assert solve_multiset(timings, names) is None
    short = (QWEN.weights_bytes - CAT.config("1xL4").memory_bytes * perf.system.memory_utilization) / 2**30
    assert (f"memory short by {short:.1f} GiB (weights {QWEN.weights_bytes / 2**30:.1f} GiB)"
            == infeasible_reason(perf, timings, names))


def test_budget_below_the_fastest_latency_names_both():
    perf, names = RooflinePerf(), ["2xL40S", "2xL40S"]
    timings = template_timings(perf, _spec(Phase.PREFILL, names, 0.5))
    assert solve_multiset(timings, names) is None
    fastest_ms = QWEN.num_layers * timings.t[("2xL40S", 1)] * 1e3
    assert fastest_ms > 0.5
    assert (f"the latency budget 0.5 ms (SLO 1 ms) is below the minimum achievable latency {fastest_ms:.1f} ms "
            "(micro-batch 1)") == infeasible_reason(perf, timings, names)


@pytest.mark.parametrize("phase", list(DEMAND_PHASES))
def test_a_feasible_multiset_solves(phase):
    names = ["2xL40S", "2xL40S"]
    placement = solve_multiset(template_timings(RooflinePerf(), _spec(phase, names, 5000.0)), names)
    assert placement is not None and placement.throughput_tok_per_s > 0
