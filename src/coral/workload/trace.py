"""The request trace: arrival times and prompt / output lengths of one model's requests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _frozen(values: object, dtype: type, what: str) -> np.ndarray:
    """A read-only 1-D copy of `values` as `dtype`, so a Trace can never change after it is built."""
    raw = np.asarray(values)
    if dtype is np.int64 and raw.dtype.kind == "f":
        if not np.all(np.isfinite(raw)) or np.any(raw != np.floor(raw)):
            raise ValueError(f"{what} must hold whole numbers, got non-integer or NaN values")
    array: np.ndarray = np.array(raw, dtype=dtype, copy=True)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {array.shape}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Trace:
    """Requests of one workload, sorted by arrival.

    `arrival_s[i]` is the arrival time of request `i` in seconds from the start of the trace
    (time 0); `prompt_tokens[i]` and `output_tokens[i]` are its prompt and generated lengths.
    `window_s` is how long the trace lasts, which may run past the last arrival (a minute of
    Poisson arrivals lasts 60 s whatever the last arrival time); `None` means "until the last
    arrival". The arrays are stored as read-only copies (float64 / int64).
    """

    name: str
    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    window_s: float | None = None

    def __post_init__(self) -> None:
        arrival = _frozen(self.arrival_s, np.float64, f"trace {self.name}: arrival_s")
        prompt = _frozen(self.prompt_tokens, np.int64, f"trace {self.name}: prompt_tokens")
        output = _frozen(self.output_tokens, np.int64, f"trace {self.name}: output_tokens")
        if not (len(arrival) == len(prompt) == len(output)):
            raise ValueError(
                f"trace {self.name}: arrival_s, prompt_tokens and output_tokens must have the same length, "
                f"got {len(arrival)}, {len(prompt)}, {len(output)}"
            )
        if not np.all(np.isfinite(arrival)):
            raise ValueError(f"trace {self.name}: arrival_s holds NaN or infinite values")
        if len(arrival) and arrival[0] < 0:
            raise ValueError(f"trace {self.name}: arrival_s must be >= 0, got {arrival[0]}")
        if np.any(np.diff(arrival) < 0):
            raise ValueError(f"trace {self.name}: arrival_s must be sorted in non-decreasing order")
        for what, tokens in (("prompt_tokens", prompt), ("output_tokens", output)):
            if len(tokens) and tokens.min() < 0:
                raise ValueError(f"trace {self.name}: {what} must be >= 0, got {tokens.min()}")
        if self.window_s is not None:
            if not np.isfinite(self.window_s) or self.window_s < 0:
                raise ValueError(f"trace {self.name}: window_s must be a finite number >= 0, got {self.window_s}")
            if len(arrival) and self.window_s < arrival[-1]:
                raise ValueError(
                    f"trace {self.name}: window_s {self.window_s} ends before the last arrival {arrival[-1]}"
                )
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_tokens", prompt)
        object.__setattr__(self, "output_tokens", output)
        if self.window_s is not None:
            object.__setattr__(self, "window_s", float(self.window_s))

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self.name == other.name
            and self.window_s == other.window_s
            and np.array_equal(self.arrival_s, other.arrival_s)
            and np.array_equal(self.prompt_tokens, other.prompt_tokens)
            and np.array_equal(self.output_tokens, other.output_tokens)
        )

    __hash__ = None  # type: ignore[assignment]  # arrays are not hashable; equality is by value

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, requests={len(self)}, duration_s={self.duration_s:.3f}, "
            f"rate_per_s={self.rate_per_s:.4g}, mean_prompt_tok={self.mean_prompt_tok:.1f}, "
            f"mean_output_tok={self.mean_output_tok:.1f})"
        )

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """The trace's length: `window_s` when set, else the last arrival time (0 when empty)."""
        if self.window_s is not None:
            return self.window_s
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0

    @property
    def rate_per_s(self) -> float:
        """Mean arrival rate, requests per second over `duration_s` (0 for an empty or instant trace)."""
        duration = self.duration_s
        return len(self) / duration if duration > 0 else 0.0

    @property
    def mean_prompt_tok(self) -> float:
        """Mean prompt length in tokens (0 for an empty trace)."""
        return float(self.prompt_tokens.mean()) if len(self) else 0.0

    @property
    def mean_output_tok(self) -> float:
        """Mean generated length in tokens (0 for an empty trace)."""
        return float(self.output_tokens.mean()) if len(self) else 0.0

    def renamed(self, name: str) -> Trace:
        """The same requests under another name.

        Args:
            name: the new name.

        Returns:
            A new Trace.
        """
        return Trace(
            name=name,
            arrival_s=self.arrival_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            window_s=self.window_s,
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LoadedTrace:
    """A trace read from a file, with what the loader dropped on the way.

    `rows_read` counts the file's data rows. BurstGPT rows with 0 response tokens are failed
    requests (`dropped_failed`); rows with 0 request tokens (`dropped_empty_prompt`) have
    nothing to prefill; rows of other models than the ones asked for are `filtered_out`.
    """

    trace: Trace
    path: Path
    format: str
    rows_read: int
    dropped_failed: int = 0
    dropped_empty_prompt: int = 0
    filtered_out: int = 0

    def __post_init__(self) -> None:
        if min(self.rows_read, self.dropped_failed, self.dropped_empty_prompt, self.filtered_out) < 0:
            raise ValueError(f"{self.path}: row counts must be >= 0")
        if self.rows_read != len(self.trace) + self.dropped + self.filtered_out:
            raise ValueError(
                f"{self.path}: rows_read {self.rows_read} != kept {len(self.trace)} + dropped {self.dropped} "
                f"+ filtered out {self.filtered_out}"
            )

    @property
    def dropped(self) -> int:
        """Rows dropped as unusable (failed or empty-prompt requests)."""
        return self.dropped_failed + self.dropped_empty_prompt

    def describe(self) -> str:
        """One line for logs and the CLI: what was read and what was dropped."""
        text = f"{self.path.name} ({self.format}): {self.rows_read} rows, {len(self.trace)} requests kept"
        if self.dropped_failed:
            text += f", {self.dropped_failed} failed requests (0 output tokens) dropped"
        if self.dropped_empty_prompt:
            text += f", {self.dropped_empty_prompt} requests with 0 prompt tokens dropped"
        if self.filtered_out:
            text += f", {self.filtered_out} rows of other models filtered out"
        return text
