"""The decode templates' KV per output token covers the quantile epoch's KV intake, not only the
mean prompt/output ratio (the intake of one epoch can run far above the sample's average)."""
from __future__ import annotations

import numpy as np
import pytest

from coral.catalog import builtin_model
from coral.perf.model import Phase
from coral.slo import Slo
from coral.templates.budget import kv_intake_per_output, kv_model
from coral.workload.summary import summarize_lengths
from coral.workload.trace import Trace

# Two 10 s epochs over a 20 s sample. Epoch 0: four requests of 600 prompt tokens, 10 output
# tokens each (2,400 KV tokens: 240 KV tokens/s); epoch 1: four of 100 prompt, 30 output
# (400 KV tokens: 40/s). Output: 4 x 10 + 4 x 30 = 160 tokens over 20 s, 8 tokens/s.
# Mean ratio E[K(P)] / E[D] = 350 / 20 = 17.5; the epochs' intake over the mean output rate is
# 240 / 8 = 30 and 40 / 8 = 5.
TRACE = Trace(name="t", arrival_s=np.array([0.0, 2.0, 4.0, 6.0, 10.0, 12.0, 14.0, 16.0]),
              prompt_tokens=np.array([600] * 4 + [100] * 4), output_tokens=np.array([10] * 4 + [30] * 4),
              window_s=20.0)
SLO = Slo(ttft_ms=1000.0, tpot_ms=50.0)


def identity(p: float) -> float:
    return p


def test_the_quantile_epoch_sets_the_intake_per_output_token():
    # the quantile over the two epochs' 30 and 5, linearly interpolated: 5 + 0.9 x 25 = 27.5
    assert kv_intake_per_output(TRACE, identity, 10.0, 0.9) == pytest.approx(27.5)
    # one epoch the length of the whole sample: its mean, 2,800 KV tokens / 20 s / 8 = 17.5
    assert kv_intake_per_output(TRACE, identity, 20.0, 0.9) == pytest.approx(17.5)


def test_a_last_partial_epoch_counts_over_its_own_length():
    # 15 s epochs: [0, 15) holds 2,400 + 300 KV tokens (180/s), [15, 20) one request of 100 (20/s)
    assert kv_intake_per_output(TRACE, identity, 15.0, 0.5) == pytest.approx((180 + 20) / 2 / 8)


def test_the_decode_nic_cap_takes_the_higher_of_mean_and_epoch_ratios():
    qwen = builtin_model("qwen3-32b")
    lengths = summarize_lengths(TRACE, 0.5, qwen.effective_context)
    assert kv_model(qwen, lengths, SLO, (), first_token="decode").prompt_per_output == pytest.approx(17.5)
    raised = kv_model(qwen, lengths, SLO, (), first_token="decode", intake_per_output=27.5)
    assert raised.rate_tokens(Phase.DECODE) == pytest.approx(27.5)
    lower = kv_model(qwen, lengths, SLO, (), first_token="decode", intake_per_output=5.0)
    assert lower.prompt_per_output == pytest.approx(17.5)


def test_bad_epoch_or_quantile_is_refused():
    with pytest.raises(ValueError, match="epoch_s must be > 0"):
        kv_intake_per_output(TRACE, identity, 0.0, 0.9)
    with pytest.raises(ValueError, match="quantile must be in"):
        kv_intake_per_output(TRACE, identity, 10.0, 1.0)
