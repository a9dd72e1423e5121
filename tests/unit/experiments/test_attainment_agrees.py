"""Per-phase attainment has one definition (`coral.slo.phase_attainment`): the simulator's summary
and `coral plan --verify` read the same share of the same requests."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coral.experiments.verify import result_verdicts
from coral.perf.model import Phase
from coral.sim.result import RunRecord, build_result
from coral.slo import Slo, phase_attainment

NAN = math.nan
FINISHED, FAILED, IN_FLIGHT = 3, 4, 0  # engine status codes (coral.sim.result.STATUS_NAMES)

# One model, TTFT SLO 1 s, TPOT SLO 0.1 s; every request has 11 output tokens (TPOT = (done - first) / 10).
#   0 finished, TTFT 0.5 s, TPOT 0.05 s            both met
#   1 finished, TTFT 3 s (miss), TPOT 0.05 s        TPOT met
#   2 first token at 0.5 s, then failed             TTFT met, TPOT failed
#   3 failed before its first token                  both failed
#   4 in flight after a first token at 0.2 s         TTFT met, TPOT not resolved
#   5 in flight, no first token                      neither resolved
#   6 finished, TTFT 0.8 s, TPOT 0.3 s (miss)        TTFT met
ARRIVAL = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
FIRST = [0.5, 3.0, 0.5, NAN, 0.2, NAN, 0.8]
DONE = [1.0, 3.5, NAN, NAN, NAN, NAN, 3.8]
STATUS = [FINISHED, FINISHED, FAILED, FAILED, IN_FLIGHT, IN_FLIGHT, FINISHED]


def _result():
    n = len(ARRIVAL)
    run = RunRecord(scenario="hand", seed=0, duration_s=10.0, epoch_s=10.0, init_s=0.0, models=("m",),
                    ttft_slo_s=(1.0,), tpot_slo_s=(0.1,), attainment_target=(0.9,), model=[0] * n,
                    arrival_s=ARRIVAL, prompt_tokens=[100] * n, output_tokens=[11] * n, status=STATUS,
                    reason=["" if s != FAILED else "test" for s in STATUS], prefill_instance=[-1] * n,
                    decode_instance=[-1] * n, prefill_start_s=ARRIVAL, first_token_s=FIRST, kv_arrival_s=FIRST,
                    decode_start_s=FIRST, done_s=DONE, epochs=[], instances=[], events=0)
    return build_result(run, wall_s=1.0)


def test_the_simulators_summary_and_verify_agree_on_each_phase():
    res = _result()
    per_model = res.summary(timing=False)["per_model"]["m"]
    verdicts = {v.phase: v for v in result_verdicts(res, {"m": Slo(ttft_ms=1000, tpot_ms=100, attainment=0.9)})}
    # TTFT: resolved = 0, 1, 2, 3, 4, 6 (2 counted once, though it has a first token and failed); met = 0, 2, 4, 6
    assert 4 / 6 == pytest.approx(per_model["prefill"]["slo_attainment"])
    assert per_model["prefill"]["slo_attainment"] == verdicts[Phase.PREFILL].attainment
    # TPOT: resolved = 0, 1, 6 (finished) and 2, 3 (failed); met = 0, 1
    assert 2 / 5 == pytest.approx(per_model["decode"]["slo_attainment"])
    assert per_model["decode"]["slo_attainment"] == verdicts[Phase.DECODE].attainment
    # both SLOs: resolved = 0, 1, 2, 3, 6; met = 0
    assert 1 / 5 == pytest.approx(per_model["slo_attainment"])
    assert per_model["slo_attainment"] == verdicts[Phase.PREFILL].model_attainment


def test_phase_attainment_leaves_out_what_is_in_flight_and_has_none_without_any_resolved():
    latency = np.array([0.5, NAN, 2.0])
    assert 0.5 == phase_attainment(latency, 1.0, np.array([True, False, True]), np.array([False, False, False]))
    assert phase_attainment(latency, 1.0, np.zeros(3, bool), np.zeros(3, bool)) is None
