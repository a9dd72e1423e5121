"""The planner's KV model counts KV tokens: a sliding-window layer holds (and sends) only its window."""
from __future__ import annotations

import numpy as np
import pytest

from coral.catalog import builtin_model
from coral.slo import Slo
from coral.templates.budget import kv_model
from coral.workload.summary import summarize_lengths
from coral.workload.trace import Trace

# Four requests: prompts 100, 1,000, 2,000, 4,000 tokens with 2, 11, 21, 41 output tokens, so
# P / (D - 1) = 100 for each of them.
TRACE = Trace(name="t", arrival_s=np.arange(4.0), prompt_tokens=np.array([100, 1000, 2000, 4000]),
              output_tokens=np.array([2, 11, 21, 41]))
SLO = Slo(ttft_ms=1000.0, tpot_ms=50.0)


def test_a_model_without_sliding_layers_counts_the_whole_prompt():
    qwen = builtin_model("qwen3-32b")
    plain = summarize_lengths(TRACE, 0.5)
    lengths = summarize_lengths(TRACE, 0.5, qwen.effective_context)
    assert (plain.kv_prompt_q, plain.kv_prompt_mean, plain.kv_per_token_q) == (1500.0, 1775.0, 100.0)
    assert plain == lengths
    kv = kv_model(qwen, lengths, SLO, (), first_token="decode")
    assert (kv.prompt_q, kv.per_output_q, kv.rate_tokens(kv.owner)) == (1500.0, 100.0, 1.0)
    assert kv.prompt_per_output == pytest.approx(1775 / 18.75)


def test_gpt_oss_sends_the_window_on_its_sliding_layers():
    # gpt-oss-20b: 12 of 24 layers slide over 128 tokens, so K(P) = (P + min(P, 128)) / 2:
    # K = 100, 564, 1,064, 2,064 for the four prompts (mean 948 against 1,775 prompt tokens);
    # K(P) / (D - 1) = 100, 56.4, 53.2, 51.6 (median 54.8, against 100 counting whole prompts).
    oss = builtin_model("gpt-oss-20b")
    lengths = summarize_lengths(TRACE, 0.5, oss.effective_context)
    assert lengths.prompt_q == 1500.0  # the prompt-token figures don't change
    assert lengths.prompt_mean == 1775.0
    assert lengths.kv_prompt_q == pytest.approx((564 + 1064) / 2)
    assert lengths.kv_prompt_mean == pytest.approx(948.0)
    assert lengths.kv_per_token_q == pytest.approx((56.4 + 53.2) / 2)
    kv = kv_model(oss, lengths, SLO, (), first_token="prefill")
    # a request's bytes are L * kv_l * K(P): 24 x 2,048 B per KV token
    assert kv.bytes_per_token == 24 * 2048
    assert kv.latency_tokens == pytest.approx(54.8)
    assert kv.rate_tokens(kv.owner) == pytest.approx(948 / 18.75)  # decode: E[K(P)] / E[D]
    assert kv.prompt_share == pytest.approx(948 / 1775)  # prefill: E[K(P)] / E[P]
