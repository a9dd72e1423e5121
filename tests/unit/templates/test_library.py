"""Library build: enumeration, dominance, cache."""
import dataclasses
import math

import pytest

from coral.errors import CoralError
from coral.perf import Phase
from coral.scenario import load_scenario
from coral.templates import kernel
from coral.templates.exact import solve_exact, solve_exact_numpy
from coral.templates.library import (
    _Solver,
    _Timings,
    build_library,
    enumerate_multisets,
    solve_multiset,
    specs_for,
    template_from_dict,
    template_to_dict,
)
from coral.templates.template import Template, drop_dominated


@pytest.fixture(scope="module")
def core():
    return load_scenario("core", overrides={"planner": {"n_max": 2, "batch_grid": [1, 8, 32]}})


def test_enumeration_counts(core):
    # 12 configurations: multisets of size 1..6 = C(12+6, 6) - 1 = 18,563 (DESIGN §3)
    spec = specs_for(core, n_max=6)[0]
    total, ok = enumerate_multisets(core.configs, spec.model, 6, 12.0)
    # + the 10 other instance types of those shapes, each a one-node multiset
    assert total == 18_563 + sum(1 for c in core.configs if c.instance_type)
    lo, hi = spec.model.weights_bytes, 12 * spec.model.weights_bytes
    mem = {c.name: c.memory_bytes for c in core.configs}
    assert all(lo <= sum(mem[n] for n in m) and (sum(mem[n] for n in m) <= hi or len(m) == 1) for m in ok)
    _, tight = enumerate_multisets(core.configs, spec.model, 6, 2.0)  # one big node is kept: its layout splits it
    assert any(len(m) == 1 and sum(mem[n] for n in m) > 2 * lo for m in tight)


def test_build_small_library_and_cache(core, tmp_path):
    lib = build_library(core, cache_dir=tmp_path)
    assert len(lib.stats) == 9 and all(not s.cached for s in lib.stats)  # 3 models x prefill, decode, colocated
    for st in lib.stats:
        assert st.kept <= st.feasible <= st.solved <= st.memory_ok <= st.multisets
    for t in lib.templates:  # every template re-verifies against the perf model
        m = core.model(t.model)
        spec = next(s for s in specs_for(core) if s.model.name == t.model and s.phase == t.phase)
        # re-solved over its own stage entries; its NIC ships the quantile KV within the allowance
        solver = _Solver(core.perf, spec)
        assert solver.kv_latency_ms(t.entries) <= spec.kv_allowance_ms
        timings = solver.timings(spec.budget_ms)
        p = timings.problem(t.entries, len(t.placement.stages), t.placement.micro_batch)
        best = solve_exact(p)
        assert best is not None and best.throughput_tok_per_s == pytest.approx(t.placement.throughput_tok_per_s)
        # the latency holds against the budget derived from the SLO, which is below the SLO itself
        assert t.budget_ms == spec.budget_ms < m.slo_ms(t.phase) and t.slo_ms == m.slo_ms(t.phase)
        assert t.placement.latency_s <= t.budget_ms / 1e3 * (1 + 1e-9)
        if t.phase is not Phase.PREFILL:  # steady-state cadence: S micro-batches share the slowest stage
            period = len(t.placement.stages) * max(st.time_s for st in t.placement.stages)
            assert period <= t.budget_ms / 1e3 * (1 + 1e-6)
        if t.phase is Phase.COLOCATED:  # the quantile prompt's chunks, one step budget each, fit the TTFT budget
            steps = math.ceil(spec.ttft_prompt_tokens / t.chunk_tokens)
            assert steps * t.budget_ms <= m.slo.ttft_ms * core.planner.ttft_headroom
            assert t.decode_tok_per_s * spec.prompt_per_output == pytest.approx(t.throughput_tok_per_s)
    again = build_library(core, cache_dir=tmp_path)  # unchanged inputs: nothing solved
    assert all(s.cached for s in again.stats)
    assert [template_to_dict(t) for t in again.templates] == [template_to_dict(t) for t in lib.templates]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written entry left behind
    # the key covers every input: same inputs, same key; a changed SLO or perf model, another key
    spec = specs_for(core)[0]
    assert spec.cache_key(core.perf) == specs_for(core)[0].cache_key(core.perf)
    assert dataclasses.replace(spec, budget_ms=spec.budget_ms / 2).cache_key(core.perf) != spec.cache_key(core.perf)
    assert dataclasses.replace(spec, lengths=()).cache_key(core.perf) != spec.cache_key(core.perf)
    from coral.perf import RooflinePerf, SystemParams

    assert spec.cache_key(RooflinePerf(system=SystemParams(memory_utilization=0.8))) != spec.cache_key(core.perf)


def test_dominance(core):
    lib = build_library(core, n_max=2, models=["phi-4"])
    kept = lib.of("phi-4", Phase.DECODE)
    assert kept
    for a in kept:
        for b in kept:
            if a is not b:
                sub = all(b.counts.get(c, 0) <= n for c, n in a.counts.items()) and all(c in a.counts for c in b.counts)
                assert not (sub and b.throughput_tok_per_s >= a.throughput_tok_per_s)
    # the build keeps only templates that beat all their sub-multisets: nothing left to drop
    assert drop_dominated(list(kept)) == sorted(kept, key=lambda t: (-t.throughput_tok_per_s, len(t.nodes), t.nodes))
    fake = [kept[0], Template(model="phi-4", phase=Phase.DECODE, slo_ms=1, budget_ms=1, nodes=tuple(sorted(kept[0].nodes + kept[0].nodes)),
                              placement=kept[0].placement)]  # twice the nodes, same throughput
    assert drop_dominated(fake) == [kept[0]]


def test_roundtrip(core):
    lib = build_library(core, n_max=1, models=["gpt-oss-20b"])
    for t in lib.templates:
        assert template_from_dict(template_to_dict(t)) == t


def test_bad_knobs(core):
    with pytest.raises(CoralError, match="--jobs must be >= 1"):
        build_library(core, jobs=0)
    with pytest.raises(CoralError, match="unknown executor"):
        build_library(core, executor="slurm")
    with pytest.raises(ValueError, match="sorted"):
        Template(model="m", phase=Phase.DECODE, slo_ms=1, budget_ms=1, nodes=("b", "a"), placement=None)  # type: ignore[arg-type]


def test_cache_key_ignores_unused_gpus(core):
    from coral.perf import Efficiency, RooflinePerf
    from coral.perf.roofline import FITTED_EFFICIENCY

    spec = specs_for(core)[0]  # L40S / L4 / A10G only
    other = dict(FITTED_EFFICIENCY, H100=Efficiency(flops=0.1, bandwidth=0.1))
    assert spec.cache_key(RooflinePerf(efficiency=other)) == spec.cache_key(RooflinePerf())
    changed = dict(FITTED_EFFICIENCY, L4=Efficiency(flops=0.1, bandwidth=0.1))
    assert spec.cache_key(RooflinePerf(efficiency=changed)) != spec.cache_key(RooflinePerf())


@pytest.mark.skipif(not kernel.HAVE_JIT, reason="numba is not installed")
@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_compiled_multiset_loop_matches_numpy(phase):
    # The compiled loop over depths and micro-batches (kernel.solve_multiset) against the Python
    # loop around the numpy search, on core multisets of up to 5 nodes, with and without a floor.
    import random

    scenario = load_scenario("core")
    rng = random.Random(7)
    for spec in specs_for(scenario, n_max=5, phases=[phase]):
        timings = _Timings(scenario.perf, spec)
        _, cands = enumerate_multisets(spec.configs, spec.model, 5, spec.rho)
        for nodes in rng.sample(cands, min(40, len(cands))):
            ref = solve_multiset(timings, nodes, 0.0, lambda p, f: solve_exact_numpy(p, f))
            floor = ref.throughput_tok_per_s * rng.uniform(0.9, 1.01) if ref is not None and rng.random() < 0.5 else 0.0
            if floor:
                ref = solve_multiset(timings, nodes, floor, lambda p, f: solve_exact_numpy(p, f))
            got = solve_multiset(timings, nodes, floor)
            assert (got is None) == (ref is None), nodes
            if ref is not None:
                assert got.throughput_tok_per_s == pytest.approx(ref.throughput_tok_per_s, rel=1e-12)
                assert got.micro_batch == ref.micro_batch
                assert [s.node_index for s in got.stages] == [s.node_index for s in ref.stages]
                assert [s.layers for s in got.stages] == [s.layers for s in ref.stages]


def test_numpy_build_matches_compiled_build(core, monkeypatch):
    jit = build_library(core, models=["phi-4"])
    monkeypatch.setenv("CORAL_NO_JIT", "1")
    ref = build_library(core, models=["phi-4"])
    assert [template_to_dict(t) for t in jit.templates] == [template_to_dict(t) for t in ref.templates]
