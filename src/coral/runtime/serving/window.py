"""The requests a coordinator accepted in an epoch, as the live planner's window: their arrival times
and prompt and output lengths (what `coral.policy.demand.epoch_demand` sizes capacity on)."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coral.workload import Trace

__all__ = ["EpochObservation", "RequestWindow", "WindowEntry"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochObservation:
    """What one epoch of serving showed: tokens/s per model and phase, and the requests themselves."""

    demand_tok_per_s: dict[str, dict[str, float]]  # model -> {"prefill": prompt tok/s, "decode": generated tok/s}
    window: dict[str, Trace]  # model -> the requests accepted in the epoch (arrivals from its start)
    epoch_s: float


class WindowEntry:
    """One request in the window: its arrival, prompt length, and its generated tokens (the growing list
    while it runs, their count once :meth:`RequestWindow.settle` is told it finished)."""

    __slots__ = ("t", "prompt_tokens", "generated")

    def __init__(self, t: float, prompt_tokens: int, generated: Sequence[int]) -> None:
        self.t, self.prompt_tokens = t, prompt_tokens
        self.generated: Sequence[int] | int = generated

    @property
    def output_tokens(self) -> int:
        """Tokens generated so far."""
        return self.generated if isinstance(self.generated, int) else len(self.generated)


class RequestWindow:
    """Arrival, prompt length and generated tokens of each request accepted since the last :meth:`take`.

    Pure bookkeeping: the caller passes the time (seconds on its monotonic clock). A request still
    running when the window is taken counts the tokens it has made so far (at least 1: the
    simulator, which knows every output length in advance, counts its whole output). Entries older
    than `keep_s` are dropped as new ones come, so a server nobody takes windows from stays small;
    a finished request (:meth:`settle`) keeps only its token count, not its tokens (its ~1 KiB of
    token list held for `keep_s` grew the chaos soak's server by 5 MiB in 10 minutes).
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
        self._seen: dict[str, deque[WindowEntry]] = {m: deque() for m in self.models}

    def record(self, model: str, t: float, prompt_tokens: int, generated: Sequence[int]) -> WindowEntry:
        """One accepted request: its arrival `t`, prompt length, and the (growing) list of its generated tokens.

        Returns:
            Its entry, for :meth:`settle` when it finishes.
        """
        entry = WindowEntry(t, prompt_tokens, generated)
        self._seen.setdefault(model, deque()).append(entry)
        horizon = t - self.keep_s
        if self.t0 < horizon:
            self.t0 = horizon
            for q in self._seen.values():
                while q and q[0].t < horizon:
                    q.popleft()
        return entry

    @staticmethod
    def settle(entry: WindowEntry) -> None:
        """The request finished: keep the count of its tokens, let go of the tokens."""
        entry.generated = entry.output_tokens

    def take(self, now: float) -> dict[str, Trace]:
        """The window since the last take (or `t0`), per model, and a new one starting at `now`.

        Returns:
            model -> the requests, arrival times from the window's start, `window_s` its length.
        """
        span = max(0.0, now - self.t0)
        out = {}
        for m, q in self._seen.items():
            rows = sorted((e.t - self.t0, e.prompt_tokens, max(1, e.output_tokens)) for e in q if e.t < now)
            out[m] = Trace(name=m, arrival_s=np.array([r[0] for r in rows], dtype=float),
                           prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
                           output_tokens=np.array([r[2] for r in rows], dtype=np.int64), window_s=span)
            q.clear()
        self.t0 = now
        return out
