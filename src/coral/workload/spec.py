"""The workload edge schema (one model's workload as a scenario file writes it) and the multi-model builder."""
from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coral.errors import CoralError, unknown
from coral.workload.arrivals import synthesize
from coral.workload.datasets import (
    BUILTIN_DATASET_FILES,
    BUILTIN_DATASET_MEANS_TOK,
    DATASET_NAMES,
    SYNTHETIC,
    SYNTHETIC_FITS,
    load_dataset,
)
from coral.workload.lengths import (
    DEFAULT_SIGMA,
    EmpiricalLengths,
    LengthModel,
    Lognormal,
    LognormalLengths,
)
from coral.workload.shift import (
    ConstantShift,
    DiurnalShift,
    Shift,
    StepShift,
    apply_shift,
    combine,
    heavy_split_multipliers,
)
from coral.workload.trace import Trace
from coral.workload.transform import replay

Seed = int | np.random.SeedSequence


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NoShiftSpec(_Spec):
    """No demand shift: the rate stays at `rate_per_s`."""

    kind: Literal["none"] = Field(default="none", description="`none`: the rate is constant.")

    def to_shift(self) -> Shift:
        return ConstantShift()


class StepShiftSpec(_Spec):
    """At `at_s` the rate changes to `factor` times `rate_per_s`."""

    kind: Literal["step"] = Field(description="`step`: the rate changes once, at `at_s`.")
    at_s: float = Field(ge=0, description="When the rate changes, seconds from the start of the run.")
    factor: float = Field(ge=0, description="The rate after `at_s` as a multiple of `rate_per_s` (0 stops traffic).")

    def to_shift(self) -> Shift:
        return StepShift(at_s=self.at_s, factor=self.factor)


class DiurnalShiftSpec(_Spec):
    """A sinusoidal swing: rate = rate_per_s * (1 + amplitude * sin(2 pi (t - phase_s) / period_s))."""

    kind: Literal["diurnal"] = Field(description="`diurnal`: the rate swings sinusoidally around `rate_per_s`.")
    period_s: float = Field(gt=0, description="Length of one full swing in seconds (86400 for a day).")
    amplitude: float = Field(ge=0, le=1, description="Relative size of the swing: the rate ranges over (1 +- amplitude) * rate_per_s.")
    phase_s: float = Field(default=0.0, description="Time shift of the swing in seconds; at phase_s the rate is at its mean and rising.")

    def to_shift(self) -> Shift:
        return DiurnalShift(period_s=self.period_s, amplitude=self.amplitude, phase_s=self.phase_s)


ShiftSpec = Annotated[NoShiftSpec | StepShiftSpec | DiurnalShiftSpec, Field(discriminator="kind")]


class CsvColumnsSpec(_Spec):
    """Which columns of a generic CSV trace hold what."""

    arrival_s: str = Field(default="arrival_s", description="Column of arrival times, seconds from the start of the trace.")
    prompt_tokens: str = Field(default="prompt_tokens", description="Column of prompt lengths in tokens.")
    output_tokens: str = Field(default="output_tokens", description="Column of output (generated) lengths in tokens.")


class WorkloadSpec(_Spec):
    """One model's workload: its request rate and where its arrivals and lengths come from."""

    rate_per_s: float = Field(ge=0, description="Mean request rate in requests per second (before any shift).")
    dataset: str = Field(
        min_length=1,
        description=(
            "Where request lengths (and, with `arrival: trace`, arrival times) come from: `azure-code`, "
            "`azure-conv`, `burstgpt` (trace files in the data directory), `synthetic` (lognormal lengths "
            "from `prompt_tokens_mean` / `output_tokens_mean`), `synthetic-azure-code` / "
            "`synthetic-azure-conv` (lognormal fits to the Azure traces' published mean and median, no "
            "data needed), or a path to a CSV trace (`.csv` or `.csv.gz`)."
        ),
    )
    arrival: Literal["trace", "poisson", "gamma"] | None = Field(
        default=None,
        description=(
            "Arrival process: `trace` replays the dataset's timing scaled to `rate_per_s` (default for "
            "trace files); `poisson` (default for synthetic datasets); `gamma`, a renewal process whose "
            "burstiness is `cv`."
        ),
    )
    cv: float | None = Field(
        default=None, ge=0, description="Coefficient of variation of the gaps for `arrival: gamma` (1 = Poisson, > 1 burstier)."
    )
    lengths: Literal["empirical", "lognormal"] | None = Field(
        default=None,
        description=(
            "With a trace file and `poisson` / `gamma` arrivals: `empirical` resamples the trace's "
            "(prompt, output) pairs (default); `lognormal` draws from lognormals fitted to its mean and median."
        ),
    )
    prompt_tokens_mean: float | None = Field(default=None, gt=0, description="`synthetic` only: mean prompt length in tokens.")
    output_tokens_mean: float | None = Field(default=None, gt=0, description="`synthetic` only: mean output length in tokens.")
    prompt_tokens_median: float | None = Field(
        default=None, gt=0, description=f"`synthetic` only: median prompt length (default: lognormal sigma {DEFAULT_SIGMA})."
    )
    output_tokens_median: float | None = Field(
        default=None, gt=0, description=f"`synthetic` only: median output length (default: lognormal sigma {DEFAULT_SIGMA})."
    )
    columns: CsvColumnsSpec | None = Field(
        default=None, description="CSV path datasets only: the column names of a generic CSV trace."
    )
    trace_start_s: float | None = Field(
        default=None,
        ge=0,
        description=(
            "`arrival: trace` only: where in the dataset (its own seconds) the replay starts; default a "
            "seeded random point, so models sharing a dataset do not get identical arrivals."
        ),
    )
    shift: ShiftSpec = Field(
        default=NoShiftSpec(), description="Demand shift over time: `none`, `step` or `diurnal`."
    )

    @field_validator("shift", mode="before")
    @classmethod
    def _shift_shorthand(cls, value: Any) -> Any:
        return {"kind": "none"} if value is None or value == "none" else value

    @field_validator("dataset")
    @classmethod
    def _known_or_path(cls, value: str) -> str:
        if value in DATASET_NAMES or value.endswith((".csv", ".csv.gz", ".gz")) or "/" in value or "\\" in value:
            return value
        raise ValueError(
            f"unknown dataset {value!r}; use one of {', '.join(DATASET_NAMES)} or a path to a .csv / .csv.gz trace"
        )

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadSpec:
        synthetic = self.dataset == SYNTHETIC or self.dataset in SYNTHETIC_FITS
        own_lengths = ("prompt_tokens_mean", "output_tokens_mean", "prompt_tokens_median", "output_tokens_median")
        if self.dataset == SYNTHETIC:
            if self.prompt_tokens_mean is None or self.output_tokens_mean is None:
                raise ValueError("dataset `synthetic` needs prompt_tokens_mean and output_tokens_mean")
            for which in ("prompt", "output"):
                mean, median = getattr(self, f"{which}_tokens_mean"), getattr(self, f"{which}_tokens_median")
                if median is not None and median > mean:
                    raise ValueError(
                        f"{which}_tokens_median ({median}) is above {which}_tokens_mean ({mean}); "
                        "a lognormal's median is at most its mean"
                    )
        else:
            given = [name for name in own_lengths if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to dataset `synthetic`; lengths come from {self.dataset!r}")
        if synthetic:
            if self.arrival == "trace":
                raise ValueError(f"dataset {self.dataset!r} has no arrival times; use arrival `poisson` or `gamma`")
            if self.lengths == "empirical":
                raise ValueError(f"dataset {self.dataset!r} has no trace to resample; drop `lengths`")
        if self.columns is not None and (synthetic or self.dataset in BUILTIN_DATASET_FILES):
            raise ValueError("`columns` only applies when `dataset` is a path to a CSV file")
        if self.arrival == "gamma" and self.cv is None:
            raise ValueError("arrival `gamma` needs `cv`, the coefficient of variation of the gaps (1 = Poisson)")
        if self.arrival != "gamma" and self.cv is not None:
            raise ValueError("`cv` only applies to arrival `gamma`")
        if self.effective_arrival == "trace":
            if self.lengths is not None:
                raise ValueError("with arrival `trace` the lengths come from the trace rows; drop `lengths`")
        elif self.trace_start_s is not None:
            raise ValueError("`trace_start_s` only applies to arrival `trace`")
        return self

    @property
    def is_synthetic(self) -> bool:
        """True when the dataset needs no trace file."""
        return self.dataset == SYNTHETIC or self.dataset in SYNTHETIC_FITS

    @property
    def effective_arrival(self) -> str:
        """`arrival`, or its default: `trace` for trace files, `poisson` for synthetic datasets."""
        if self.arrival is not None:
            return self.arrival
        return "poisson" if self.is_synthetic else "trace"

    def to_shift(self) -> Shift:
        """The domain shift of `shift`."""
        return self.shift.to_shift()

    def mean_lengths_tok(
        self, data_dir: Path | str | None = None, *, base_dir: Path | str | None = None
    ) -> tuple[float, float]:
        """The mean (prompt, output) lengths this workload draws from, for sizing demand.

        Synthetic datasets give their distribution's means and built-in trace files their
        recorded means, without reading anything; a CSV path is loaded.

        Args:
            data_dir: where built-in datasets live (only used for CSV paths' loader).
            base_dir: the folder relative CSV paths are resolved against.

        Returns:
            (mean prompt tokens, mean output tokens).

        Raises:
            CoralError: a CSV path that cannot be read or holds no requests.
        """
        if self.is_synthetic:
            lengths = self._lengths(None)
            return lengths.mean_prompt_tok, lengths.mean_output_tok
        if self.dataset in BUILTIN_DATASET_MEANS_TOK:
            return BUILTIN_DATASET_MEANS_TOK[self.dataset]
        columns = None
        if self.columns is not None:
            columns = (self.columns.arrival_s, self.columns.prompt_tokens, self.columns.output_tokens)
        trace = load_dataset(self.dataset, data_dir, base_dir=base_dir, columns=columns).trace
        if len(trace) == 0:
            raise CoralError(f"dataset {self.dataset!r} holds no usable requests")
        return trace.mean_prompt_tok, trace.mean_output_tok

    def to_trace(
        self,
        duration_s: float,
        seed: Seed,
        data_dir: Path | str | None = None,
        *,
        name: str | None = None,
        base_dir: Path | str | None = None,
        extra_shift: Shift | None = None,
    ) -> Trace:
        """Generate this workload's requests over `[0, duration_s)`.

        The arrivals are produced at `rate_per_s * peak` (peak of the shift over the run) and
        thinned to `rate_per_s * m(t)`; an unshifted workload is produced at `rate_per_s` directly.

        Args:
            duration_s: the run's length in seconds, > 0.
            seed: the seed (same seed, same trace).
            data_dir: where built-in datasets live (default `$CORAL_DATA_DIR`, then the copy shipped with Coral).
            name: the trace's name; default the dataset.
            base_dir: the folder relative CSV paths are resolved against (default the current one).
            extra_shift: a multiplier applied on top of `shift` (e.g. a large-heavy split).

        Returns:
            The trace, `window_s == duration_s`.

        Raises:
            CoralError: a dataset that cannot be found or read, or one that cannot be replayed.
        """
        return self._to_trace(duration_s, seed, data_dir, name=name, base_dir=base_dir, extra_shift=extra_shift, cache={})

    def _lengths(self, source: Trace | None) -> LengthModel:
        if self.dataset in SYNTHETIC_FITS:
            return SYNTHETIC_FITS[self.dataset]
        if self.dataset == SYNTHETIC:
            assert self.prompt_tokens_mean is not None and self.output_tokens_mean is not None
            return LognormalLengths(
                prompt=_lognormal(self.prompt_tokens_mean, self.prompt_tokens_median),
                output=_lognormal(self.output_tokens_mean, self.output_tokens_median),
            )
        assert source is not None
        if self.lengths == "lognormal":
            return LognormalLengths.fit(source)
        return EmpiricalLengths(source=source)

    def _to_trace(
        self,
        duration_s: float,
        seed: Seed,
        data_dir: Path | str | None,
        *,
        name: str | None,
        base_dir: Path | str | None,
        extra_shift: Shift | None,
        cache: dict[tuple[str, tuple[str, str, str] | None], Trace],
    ) -> Trace:
        label = name or self.dataset
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise CoralError(f"workload {label}: duration_s must be a finite number > 0, got {duration_s}")
        shift = self.to_shift() if extra_shift is None else combine(self.to_shift(), extra_shift)
        rng = np.random.default_rng(seed)
        source = None
        if not self.is_synthetic:
            columns = None
            if self.columns is not None:
                columns = (self.columns.arrival_s, self.columns.prompt_tokens, self.columns.output_tokens)
            key = (self.dataset, columns)
            if key not in cache:
                cache[key] = load_dataset(self.dataset, data_dir, base_dir=base_dir, columns=columns).trace
            source = cache[key]
            if len(source) == 0:
                raise CoralError(f"workload {label}: dataset {self.dataset!r} holds no usable requests")
        rate = self.rate_per_s * shift.peak(duration_s)
        try:
            if self.effective_arrival == "trace":
                assert source is not None
                if rate > 0 and source.rate_per_s <= 0:
                    raise CoralError(
                        f"workload {label}: dataset {self.dataset!r} has a single instant of arrivals and cannot "
                        "be replayed at a rate; use arrival `poisson` or `gamma`"
                    )
                offset = self.trace_start_s if self.trace_start_s is not None else rng.uniform(0, source.duration_s)
                base = replay(source, rate_per_s=rate, duration_s=duration_s, offset_s=offset)
            else:
                base = synthesize(
                    name=label,
                    rate_per_s=rate,
                    duration_s=duration_s,
                    lengths=self._lengths(source),
                    rng=rng,
                    arrival=self.effective_arrival,
                    cv=1.0 if self.cv is None else self.cv,
                )
            return apply_shift(base, shift, rng).renamed(label)
        except ValueError as exc:
            raise CoralError(f"workload {label}: {exc}") from None


def _lognormal(mean_tok: float, median_tok: float | None) -> Lognormal:
    if median_tok is None:
        return Lognormal.from_mean(mean_tok)
    return Lognormal.from_mean_median(mean_tok, median_tok)


class HeavySplitSpec(_Spec):
    """Large-heavy / small-heavy demand: a group of models gets `share` of the total traffic."""

    models: list[str] = Field(min_length=1, description="The heavy group: model names that get `share` of the traffic.")
    share: float = Field(default=0.8, ge=0, le=1, description="The heavy group's share of the total request rate (paper: 0.8).")
    at_s: float = Field(
        default=0.0, ge=0, description="When the split starts, seconds from the start of the run (0: from the start)."
    )


def parse_workload_spec(data: Any, *, where: str = "workload") -> WorkloadSpec:
    """Validate one model's workload from a scenario file's mapping.

    Args:
        data: the mapping (e.g. parsed YAML).
        where: how to name it in errors (e.g. `models.qwen3-32b.workload`).

    Returns:
        The validated spec.

    Raises:
        CoralError: naming each bad field and what it needs.
    """
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        raise CoralError(_describe(exc, where)) from None


def _describe(exc: ValidationError, where: str) -> str:
    lines = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error["loc"])
        lines.append(f"{where}.{loc}: {error['msg']}" if loc else f"{where}: {error['msg']}")
    return "invalid workload:\n  " + "\n  ".join(lines)


def model_seed(seed: int, model: str) -> np.random.SeedSequence:
    """The seed of one model's workload: depends on the run's seed and the model's name only.

    Adding or reordering models leaves every other model's trace unchanged.

    Args:
        seed: the run's seed.
        model: the model's name.

    Returns:
        A SeedSequence for `numpy.random.default_rng`.
    """
    return np.random.SeedSequence([seed, zlib.crc32(model.encode())])


def build_workload(
    specs: Mapping[str, WorkloadSpec],
    *,
    duration_s: float,
    seed: int,
    data_dir: Path | str | None = None,
    base_dir: Path | str | None = None,
    heavy: HeavySplitSpec | None = None,
) -> dict[str, Trace]:
    """Generate every model's requests for a run.

    Each model's dataset is replayed or sampled at its rate over `[0, duration_s)` with a
    seed derived from `seed` and the model's name (`model_seed`). Trace files are read once.
    With `heavy`, each model's rate is further multiplied (from `heavy.at_s` on) so that the
    heavy group gets `heavy.share` of the total `rate_per_s`.

    Args:
        specs: model name -> its workload.
        duration_s: the run's length in seconds.
        seed: the run's seed.
        data_dir: where built-in datasets live.
        base_dir: the folder relative CSV paths are resolved against.
        heavy: an optional large-heavy / small-heavy split.

    Returns:
        model name -> trace (named after the model), in the order of `specs`.

    Raises:
        CoralError: an unknown heavy model, an impossible split, or a dataset problem.
    """
    extra: dict[str, Shift] = {}
    if heavy is not None:
        for model in heavy.models:
            if model not in specs:
                raise unknown("model", model, list(specs))
        try:
            factors = heavy_split_multipliers({m: s.rate_per_s for m, s in specs.items()}, heavy.models, heavy.share)
        except ValueError as exc:
            raise CoralError(f"heavy split: {exc}") from None
        for model, factor in factors.items():
            extra[model] = ConstantShift(factor=factor) if heavy.at_s == 0 else StepShift(at_s=heavy.at_s, factor=factor)
    cache: dict[tuple[str, tuple[str, str, str] | None], Trace] = {}
    return {
        model: spec._to_trace(
            duration_s,
            model_seed(seed, model),
            data_dir,
            name=model,
            base_dir=base_dir,
            extra_shift=extra.get(model),
            cache=cache,
        )
        for model, spec in specs.items()
    }
