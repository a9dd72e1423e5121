"""What sizes a model's templates and capacity: its length distribution at the attainment
quantile, and a sample of its traffic (DESIGN §4a)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coral.workload.trace import Trace


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthSummary:
    """A model's (prompt, output) length distribution, as the planner reads it.

    `prompt_q` is the prompt length at the attainment quantile (the latency constraint of prefill
    templates holds there); `prompt_work` is `E[P²] / E[P]`, the prompt length at which the
    per-token prefill work (linear plus causal attention, quadratic) equals the distribution's, so
    throughput measured there is the rate realized on the distribution.

    The KV figures count *KV tokens*, a prompt's `K(P)` tokens per layer (`ModelSpec.effective_context`:
    a sliding-window layer holds only the window; `K(P) = P` without one), each read off the sample:
    `kv_prompt_q` is the quantile of `K(P)`, `kv_prompt_mean` its mean, and `kv_per_token_q` the
    quantile of `K(P) / (D − 1)` over multi-token outputs: the KV tokens that one output token has
    to pay for when the transfer counts against TPOT.
    """

    quantile: float
    prompt_mean: float
    output_mean: float
    prompt_q: float
    prompt_work: float
    kv_per_token_q: float
    kv_prompt_q: float
    kv_prompt_mean: float
    requests: int

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(f"LengthSummary.quantile must be in (0, 1), got {self.quantile}")
        for name in ("prompt_mean", "prompt_q", "prompt_work", "kv_prompt_q", "kv_prompt_mean"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"LengthSummary.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.output_mean >= 0 and self.kv_per_token_q >= 0):
            raise ValueError("LengthSummary.output_mean and kv_per_token_q must be >= 0")

    def key(self) -> dict[str, float]:
        """The fields that change a template (part of the library's cache key), rounded to 0.1 token."""
        return {"quantile": self.quantile, "prompt_mean": round(self.prompt_mean, 1),
                "output_mean": round(self.output_mean, 1), "prompt_q": round(self.prompt_q, 1),
                "prompt_work": round(self.prompt_work, 1), "kv_per_token_q": round(self.kv_per_token_q, 1)}


def summarize_lengths(trace: Trace, quantile: float,
                      kv_tokens: Callable[[float], float] | None = None) -> LengthSummary:
    """The length summary of `trace` at `quantile`; `kv_tokens` maps a prompt length to its KV
    tokens per layer (the model's `effective_context`; None: the prompt itself).

    Raises:
        ValueError: an empty trace or a quantile outside (0, 1).
    """
    if len(trace) == 0:
        raise ValueError(f"trace {trace.name!r} has no requests to summarize")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    p = np.maximum(trace.prompt_tokens.astype(float), 1.0)
    d = np.maximum(trace.output_tokens.astype(float), 1.0)
    if kv_tokens is None:
        kv = p
    else:  # once per distinct length: a sample holds far fewer of those than requests
        lengths, where = np.unique(p, return_inverse=True)
        kv = np.array([kv_tokens(float(x)) for x in lengths])[where]
    multi = d > 1
    ratio = kv[multi] / (d[multi] - 1) if multi.any() else np.zeros(1)
    return LengthSummary(
        quantile=quantile, prompt_mean=float(p.mean()), output_mean=float(d.mean()),
        prompt_q=float(np.quantile(p, quantile)), prompt_work=float((p * p).sum() / p.sum()),
        kv_per_token_q=float(np.quantile(ratio, quantile)), kv_prompt_q=float(np.quantile(kv, quantile)),
        kv_prompt_mean=float(kv.mean()), requests=len(p))


def arrival_cv(trace: Trace) -> float:
    """Coefficient of variation of the inter-arrival gaps (1 for Poisson; NaN below 3 requests)."""
    gaps = np.diff(np.sort(trace.arrival_s))
    if gaps.size < 2 or not gaps.mean() > 0:
        return math.nan
    return float(gaps.std() / gaps.mean())
