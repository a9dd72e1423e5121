"""Batched sampling: each parameter against a hand-worked case, and rows independent of their batch."""

from __future__ import annotations

import math

import pytest
import torch

from coral.runtime.engine.sampling import sample_batch
from coral.runtime.protocol import SamplingParams

# logits of a 5-token vocabulary; softmax ≈ [0.032, 0.087, 0.237, 0.644, 0.0]
LOGITS = torch.tensor([1.0, 2.0, 3.0, 4.0, -30.0])


def one(params: SamplingParams, step: int = 0, history: list[int] | None = None, logits: torch.Tensor = LOGITS) -> int:
    return sample_batch(logits.unsqueeze(0), [params], [step], [history or []]).pop().token


def draws(params: SamplingParams, n: int = 300) -> set[int]:
    return {one(SamplingParams(**{**_fields(params), "seed": s})) for s in range(n)}


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_greedy_is_argmax_and_bias_moves_it() -> None:
    assert 3 == one(SamplingParams(temperature=0))
    assert 1 == one(SamplingParams(temperature=0, logit_bias=((1, 2.5),)))  # 2 + 2.5 > 4
    assert 3 == one(SamplingParams(temperature=0, logit_bias=((1, 1.5),)))  # 3.5 < 4


def test_filters_bound_the_support() -> None:
    assert {3} == draws(SamplingParams(top_k=1))
    assert {2, 3} == draws(SamplingParams(top_k=2))
    assert {3} == draws(SamplingParams(top_p=0.5))  # 0.644 alone reaches 0.5
    assert {2, 3} == draws(SamplingParams(top_p=0.8))  # 0.644 < 0.8 <= 0.644 + 0.237
    assert {2, 3} == draws(SamplingParams(min_p=0.3))  # 0.237 >= 0.3 * 0.644; 0.087 is not
    assert {0, 1, 2, 3} == draws(SamplingParams())


def test_temperature_sharpens() -> None:
    cold = [one(SamplingParams(temperature=0.2, seed=s)) for s in range(200)]
    hot = [one(SamplingParams(temperature=1.0, seed=s)) for s in range(200)]
    assert cold.count(3) > hot.count(3)
    assert cold.count(3) >= 190  # p(3) = 1 / (1 + e^-5 + ...) ≈ 0.993 at T = 0.2


def test_penalties_by_hand() -> None:
    # repetition 2 on seen token 3 (prompt): 4 / 2 = 2 < 3 -> token 2 wins
    assert 2 == one(SamplingParams(temperature=0, repetition_penalty=2.0, prompt_len=1), history=[3])
    # frequency 0.6 on output token 3 seen twice: 4 - 1.2 = 2.8 < 3
    assert 2 == one(SamplingParams(temperature=0, frequency_penalty=0.6, prompt_len=0), history=[3, 3])
    # the same tokens in the prompt are not output: no frequency penalty
    assert 3 == one(SamplingParams(temperature=0, frequency_penalty=0.6, prompt_len=2), history=[3, 3])
    # presence 0.9 once: 3.1 > 3 still; presence 1.1: 2.9 < 3
    assert 3 == one(SamplingParams(temperature=0, presence_penalty=0.9), history=[3, 3])
    assert 2 == one(SamplingParams(temperature=0, presence_penalty=1.1), history=[3, 3])
    # negative logits are multiplied by the repetition penalty
    neg = torch.tensor([-1.0, -1.5, -30.0, -30.0, -30.0])
    assert 1 == one(SamplingParams(temperature=0, repetition_penalty=2.0), history=[0], logits=neg)


def test_min_tokens_masks_stop_ids() -> None:
    p = SamplingParams(temperature=0, min_tokens=2, stop_ids=(3,))
    assert [2, 2, 3] == [one(p, step=s) for s in range(3)]


def test_logprobs_are_raw_log_softmax() -> None:
    out = sample_batch(LOGITS.unsqueeze(0), [SamplingParams(temperature=0, logprobs=2, logit_bias=((0, 100.0),))], [0]).pop()
    ref = torch.log_softmax(LOGITS, dim=-1)
    assert 0 == out.token  # the bias picked it; its logprob is the model's own
    assert math.isclose(float(ref[0]), out.logprob, rel_tol=1e-6)
    assert [3, 2] == [t.token for t in out.top]
    assert math.isclose(float(ref[3]), out.top[0].logprob, rel_tol=1e-6)
    assert () == sample_batch(LOGITS.unsqueeze(0), [SamplingParams(logprobs=-1)], [0]).pop().top


def test_rows_do_not_depend_on_their_batch() -> None:
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=rng)
    params = [SamplingParams(seed=i, top_k=i * 5, top_p=0.9 if i % 2 else 1.0, temperature=0.5 + i / 4) for i in range(6)]
    steps = [3, 0, 7, 1, 2, 9]
    batch = [s.token for s in sample_batch(logits, params, steps)]
    alone = [sample_batch(logits[i : i + 1], [params[i]], [steps[i]]).pop().token for i in range(6)]
    assert alone == batch
    assert batch == [s.token for s in sample_batch(logits, params, steps)]  # same seed, same tokens


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="one row per params"):
        sample_batch(torch.zeros(2, 4), [SamplingParams()], [0])
