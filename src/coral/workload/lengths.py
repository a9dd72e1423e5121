"""Prompt / output length distributions: empirical resampling of a trace and lognormal fits.

Built-in fits need no data files. They are lognormals matched to the published mean and
median of the Azure LLM inference traces 2023 (Patel et al., Splitwise, ISCA 2024), i.e.
`mu = ln(median)`, `sigma = sqrt(2 ln(mean / median))`:

| trace | prompt mean | prompt median | output mean | output median |
|---|---:|---:|---:|---:|
| code (8,819 requests) | 2047.8 | 1469 | 27.9 | 13 |
| conv (19,366 requests) | 1154.7 | 1020 | 211.1 | 129 |

Samples are rounded to whole tokens and floored at 1 token; they are not capped (the
traces' maxima are 7,437 / 1,899 tokens for code and 14,050 / 1,000 for conv), so a rare
sample can exceed a model's context unless `max_tok` is set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from coral.workload.trace import IntArray, Trace

AZURE_CODE_PROMPT_MEAN_TOK = 2047.8
AZURE_CODE_PROMPT_MEDIAN_TOK = 1469.0
AZURE_CODE_OUTPUT_MEAN_TOK = 27.9
AZURE_CODE_OUTPUT_MEDIAN_TOK = 13.0
AZURE_CONV_PROMPT_MEAN_TOK = 1154.7
AZURE_CONV_PROMPT_MEDIAN_TOK = 1020.0
AZURE_CONV_OUTPUT_MEAN_TOK = 211.1
AZURE_CONV_OUTPUT_MEDIAN_TOK = 129.0

# A lognormal given only its mean gets this sigma (median = mean * exp(-1/2) ~ 0.61 mean), between
# the Azure fits' 0.50-1.24.
DEFAULT_SIGMA = 1.0


class LengthModel(Protocol):
    """Anything that draws (prompt, output) token-length pairs."""

    @property
    def mean_prompt_tok(self) -> float: ...

    @property
    def mean_output_tok(self) -> float: ...

    def sample(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Lognormal:
    """A lognormal length distribution in tokens, `exp(N(mu, sigma^2))`, rounded to whole tokens.

    Samples are rounded, floored at `min_tok` and, when `max_tok` is set, clipped to it.
    """

    mu: float
    sigma: float
    min_tok: int = 1
    max_tok: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"lognormal mu must be finite, got {self.mu}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be a finite number >= 0, got {self.sigma}")
        if self.min_tok < 0:
            raise ValueError(f"lognormal min_tok must be >= 0, got {self.min_tok}")
        if self.max_tok is not None and self.max_tok < max(self.min_tok, 1):
            raise ValueError(f"lognormal max_tok must be >= max(min_tok, 1), got {self.max_tok}")

    @classmethod
    def from_mean_median(cls, mean_tok: float, median_tok: float, *, max_tok: int | None = None) -> Lognormal:
        """The lognormal with this mean and median.

        Args:
            mean_tok: the mean length in tokens.
            median_tok: the median length in tokens, `0 < median_tok <= mean_tok`.
            max_tok: optional cap on samples.

        Returns:
            `Lognormal(mu=ln(median), sigma=sqrt(2 ln(mean/median)))`.

        Raises:
            ValueError: median <= 0 or mean < median (a lognormal's mean is never below its median).
        """
        if not (math.isfinite(median_tok) and median_tok > 0):
            raise ValueError(f"median length must be a finite number > 0, got {median_tok}")
        if not (math.isfinite(mean_tok) and mean_tok >= median_tok):
            raise ValueError(f"a lognormal's mean ({mean_tok}) cannot be below its median ({median_tok})")
        return cls(mu=math.log(median_tok), sigma=math.sqrt(2 * math.log(mean_tok / median_tok)), max_tok=max_tok)

    @classmethod
    def from_mean(cls, mean_tok: float, *, sigma: float = DEFAULT_SIGMA, max_tok: int | None = None) -> Lognormal:
        """The lognormal with this mean and shape `sigma`.

        Args:
            mean_tok: the mean length in tokens, > 0.
            sigma: the log-space standard deviation.
            max_tok: optional cap on samples.

        Returns:
            `Lognormal(mu=ln(mean) - sigma^2/2, sigma)`.

        Raises:
            ValueError: mean <= 0.
        """
        if not (math.isfinite(mean_tok) and mean_tok > 0):
            raise ValueError(f"mean length must be a finite number > 0, got {mean_tok}")
        return cls(mu=math.log(mean_tok) - sigma**2 / 2, sigma=sigma, max_tok=max_tok)

    @classmethod
    def fit(cls, tokens: IntArray, *, method: str = "mean-median") -> Lognormal:
        """Fit a lognormal to observed lengths.

        `mean-median` matches the sample mean and median, so the fit keeps the mean that the
        planner's demand uses (`lambda * mean length`); when the sample mean is below its median
        it falls back to `mle`. `mle` is the maximum-likelihood fit (mean and standard deviation
        of the logs). Lengths of 0 count as 1 token for the logarithm.

        Args:
            tokens: observed lengths (at least one).
            method: `mean-median` or `mle`.

        Returns:
            The fitted lognormal.

        Raises:
            ValueError: no lengths, or an unknown method.
        """
        values = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        if len(values) == 0:
            raise ValueError("cannot fit a lognormal to an empty set of lengths")
        if method not in ("mean-median", "mle"):
            raise ValueError(f"unknown fit method {method!r}; use 'mean-median' or 'mle'")
        mean, median = float(values.mean()), float(np.median(values))
        if method == "mean-median" and mean >= median:
            return cls.from_mean_median(mean, median)
        logs = np.log(values)
        return cls(mu=float(logs.mean()), sigma=float(logs.std()))

    @property
    def median_tok(self) -> float:
        """Median of the continuous distribution (before rounding)."""
        return math.exp(self.mu)

    @property
    def mean_tok(self) -> float:
        """Mean of the continuous distribution (before rounding and clipping)."""
        return math.exp(self.mu + self.sigma**2 / 2)

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        """Draw `n` lengths.

        Args:
            n: how many, >= 0.
            rng: the random generator.

        Returns:
            An int64 array of `n` lengths.
        """
        values = np.rint(rng.lognormal(self.mu, self.sigma, size=n))
        values = np.maximum(values, self.min_tok)
        if self.max_tok is not None:
            values = np.minimum(values, self.max_tok)
        return values.astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class LognormalLengths:
    """Independent lognormal prompt and output lengths."""

    prompt: Lognormal
    output: Lognormal

    @classmethod
    def fit(cls, trace: Trace, *, method: str = "mean-median") -> LognormalLengths:
        """Fit lognormal prompt and output lengths to a trace (see `Lognormal.fit`).

        Args:
            trace: a non-empty trace.
            method: `mean-median` or `mle`.

        Returns:
            The fitted lengths.

        Raises:
            ValueError: the trace is empty.
        """
        if len(trace) == 0:
            raise ValueError(f"trace {trace.name} is empty: there are no lengths to fit")
        return cls(prompt=Lognormal.fit(trace.prompt_tokens, method=method),
                   output=Lognormal.fit(trace.output_tokens, method=method))

    @property
    def mean_prompt_tok(self) -> float:
        return self.prompt.mean_tok

    @property
    def mean_output_tok(self) -> float:
        return self.output.mean_tok

    def sample(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        """Draw `n` (prompt, output) pairs, prompts first then outputs from the same generator.

        Args:
            n: how many, >= 0.
            rng: the random generator.

        Returns:
            Two int64 arrays of `n` lengths.
        """
        return self.prompt.sample(n, rng), self.output.sample(n, rng)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class EmpiricalLengths:
    """Resample (prompt, output) pairs from a trace, with replacement.

    Pairs are drawn together, so the correlation between a request's prompt and output
    lengths in the source trace is kept.
    """

    source: Trace

    def __post_init__(self) -> None:
        if len(self.source) == 0:
            raise ValueError(f"trace {self.source.name} is empty: there are no lengths to resample")

    @property
    def mean_prompt_tok(self) -> float:
        return self.source.mean_prompt_tok

    @property
    def mean_output_tok(self) -> float:
        return self.source.mean_output_tok

    def sample(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        """Draw `n` (prompt, output) pairs of the source trace's requests.

        Args:
            n: how many, >= 0.
            rng: the random generator.

        Returns:
            Two int64 arrays of `n` lengths.
        """
        rows = rng.integers(0, len(self.source), size=n)
        return self.source.prompt_tokens[rows].copy(), self.source.output_tokens[rows].copy()


AZURE_CODE_LENGTHS = LognormalLengths(
    prompt=Lognormal.from_mean_median(AZURE_CODE_PROMPT_MEAN_TOK, AZURE_CODE_PROMPT_MEDIAN_TOK),
    output=Lognormal.from_mean_median(AZURE_CODE_OUTPUT_MEAN_TOK, AZURE_CODE_OUTPUT_MEDIAN_TOK),
)
AZURE_CONV_LENGTHS = LognormalLengths(
    prompt=Lognormal.from_mean_median(AZURE_CONV_PROMPT_MEAN_TOK, AZURE_CONV_PROMPT_MEDIAN_TOK),
    output=Lognormal.from_mean_median(AZURE_CONV_OUTPUT_MEAN_TOK, AZURE_CONV_OUTPUT_MEDIAN_TOK),
)
