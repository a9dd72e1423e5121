"""The requests a coordinator accepted in an epoch, as the live planner's window: their arrival times
and prompt and output lengths (what `coral.policy.demand.epoch_demand` sizes capacity on)."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coral.workload import Trace

__all__ = ["EpochObservation", "RequestWindow"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochObservation:
    """What one epoch of serving showed: tokens/s per model and phase, and the requests themselves."""

    demand_tok_per_s: dict[str, dict[str, float]]  # model -> {"prefill": prompt tok/s, "decode": generated tok/s}
    window: dict[str, Trace]  # model -> the requests accepted in the epoch (arrivals from its start)
    epoch_s: float


class RequestWindow:
    """Arrival, prompt length and generated tokens of each request accepted since the last :meth:`take`.

    Pure bookkeeping: the caller passes the time (seconds on its monotonic clock). A request still
    running when the window is taken counts the tokens it has made so far (at least 1: the
    simulator, which knows every output length in advance, counts its whole output). Entries older
    than `keep_s` are dropped as new ones come, so a server nobody takes windows from stays small.
    """

    def __init__(self, models: Sequence[str], *, t0: float, keep_s: float = 3600.0) -> None:
        """Args:
        models: the served models (each gets a window, empty or not).
        t0: when the first window starts.
        keep_s: the longest window kept (s > 0).

        Raises:
            ValueError: a non-positive `keep_s`.
        """
        if not keep_s > 0:
            raise ValueError(f"keep_s must be > 0, got {keep_s}")
        self.models = tuple(models)
        self.keep_s = keep_s
        self.t0 = t0
        self._seen: dict[str, deque[tuple[float, int, Sequence[int]]]] = {m: deque() for m in self.models}

    def record(self, model: str, t: float, prompt_tokens: int, generated: Sequence[int]) -> None:
        """One accepted request: its arrival `t`, prompt length, and the (growing) list of its generated tokens."""
        seen = self._seen.setdefault(model, deque())
        seen.append((t, prompt_tokens, generated))
        horizon = t - self.keep_s
        if self.t0 < horizon:
            self.t0 = horizon
            for q in self._seen.values():
                while q and q[0][0] < horizon:
                    q.popleft()

    def take(self, now: float) -> dict[str, Trace]:
        """The window since the last take (or `t0`), per model, and a new one starting at `now`.

        Returns:
            model -> the requests, arrival times from the window's start, `window_s` its length.
        """
        span = max(0.0, now - self.t0)
        out = {}
        for m, q in self._seen.items():
            rows = sorted((t - self.t0, p, max(1, len(g))) for t, p, g in q if t < now)
            out[m] = Trace(name=m, arrival_s=np.array([r[0] for r in rows], dtype=float),
                           prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
                           output_tokens=np.array([r[2] for r in rows], dtype=np.int64), window_s=span)
            q.clear()
        self.t0 = now
        return out
