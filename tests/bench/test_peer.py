"""The Coral side of `make bench`'s peer section (bench/peer.py), which needs no aiconfigurator:
Coral's best single-node template per GPU is positive, under the single-GPU roofline at full
peak, uses only TP degrees vLLM accepts, and does not rise when the budget tightens."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer  # noqa: E402

from coral.catalog import builtin_catalog, resolve_model_spec  # noqa: E402
from coral.perf import Phase  # noqa: E402
from coral.perf.roofline import single_gpu_roofline  # noqa: E402


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_best_node_is_positive_and_under_the_roofline(phase: Phase) -> None:
    # phi-4 has 10 KV heads: on 4xL40S vLLM accepts TP 1 and 2, not 4
    best = peer.coral_best_node("phi-4", phase, "4xL40S", isl=1024, osl=128)
    assert best is not None
    spec, gpu = resolve_model_spec("phi-4"), builtin_catalog().config("4xL40S").gpu
    # the roofline at 100 % of the dense BF16 peak (prefill) or the datasheet HBM bandwidth (decode)
    ceiling = single_gpu_roofline(spec, gpu, phase, batch=best.batch, context=1024 + 128 / 2, compute_share=1.0)
    assert 0 < best.tok_per_s_per_gpu < ceiling
    degrees = {int(t) for t in re.findall(r"tp(\d+)", best.layout)}
    assert degrees and all(spec.tp_problem(t) is None for t in degrees), best.layout


def test_a_tighter_budget_never_raises_the_rate() -> None:
    loose = peer.coral_best_node("phi-4", Phase.DECODE, "4xL40S", isl=1024, osl=128, tpot_ms=60.0)
    tight = peer.coral_best_node("phi-4", Phase.DECODE, "4xL40S", isl=1024, osl=128, tpot_ms=30.0)
    assert loose is not None and tight is not None
    assert tight.tok_per_s_per_gpu < loose.tok_per_s_per_gpu
    assert tight.latency_ms <= peer.phase_budget_ms(Phase.DECODE, tpot_ms=30.0) + 1e-9


def test_the_budget_is_the_planners_share_of_the_slo() -> None:
    # prefill: ttft_headroom (0.5) x TTFT; decode: tpot_headroom (0.9) x TPOT, with no KV transfer
    assert 500.0 == pytest.approx(peer.phase_budget_ms(Phase.PREFILL, ttft_ms=1000.0))
    assert 45.0 == pytest.approx(peer.phase_budget_ms(Phase.DECODE, tpot_ms=50.0))
