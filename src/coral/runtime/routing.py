"""Routing policies shared by the router and the instance schedulers: pure, no clock, no I/O.

:class:`WeightedRoundRobin` is the smooth weighted round-robin of nginx: over any window of
``sum(weights)`` picks, choice ``i`` is picked ``weight_i`` times, interleaved as evenly as
possible, and the sequence is deterministic.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["InstanceView", "WeightedRoundRobin", "pick_decode", "pick_prefill"]


class WeightedRoundRobin:
    """Deterministic smooth weighted round-robin over a fixed set of keys."""

    def __init__(self, weights: dict[Hashable, float]) -> None:
        """Args:
            weights: key -> positive weight (e.g. throughput in tokens/s).

        Raises:
            ValueError: if empty or a weight is not positive.
        """
        if not weights:
            raise ValueError("weighted round-robin needs at least one choice")
        bad = [k for k, w in weights.items() if not w > 0]
        if bad:
            raise ValueError(f"weights must be positive; bad for {bad}")
        self.weights = dict(weights)
        self._current = dict.fromkeys(weights, 0.0)
        self._total = float(sum(weights.values()))

    def pick(self, allowed: Sequence[Hashable] | None = None) -> Hashable:
        """Pick the next key.

        Args:
            allowed: restrict the pick to these keys (others keep their credit); None = all.

        Returns:
            The chosen key.

        Raises:
            ValueError: if ``allowed`` shares no key with the weights.
        """
        keys = [k for k in self.weights if allowed is None or k in allowed]
        if not keys:
            raise ValueError("no allowed choice")
        total = sum(self.weights[k] for k in keys)
        for k in keys:
            self._current[k] += self.weights[k]
        best = max(keys, key=lambda k: self._current[k])  # first max wins: deterministic
        self._current[best] -= total
        return best


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceView:
    """What routing needs to know about one registered instance."""

    instance_id: str
    model: str
    phase: str  # "prefill" | "decode" | "mixed"
    region: str
    throughput_tok_per_s: float

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode", "mixed"):
            raise ValueError(f"phase must be prefill, decode or mixed, got {self.phase!r}")
        if not self.throughput_tok_per_s > 0:
            raise ValueError(f"throughput_tok_per_s must be positive, got {self.throughput_tok_per_s}")


def pick_prefill(instances: Sequence[InstanceView], wrr: WeightedRoundRobin) -> InstanceView | None:
    """Pick the instance that runs a request's prefill (prefill or mixed phase), WRR by throughput.

    Args:
        instances: the model's ready instances.
        wrr: the model's round-robin state over instance ids (all of the model's instances).

    Returns:
        The instance, or None if the model has no prefill-capable instance.
    """
    ok = [i.instance_id for i in instances if i.phase in ("prefill", "mixed")]
    if not ok:
        return None
    chosen = wrr.pick(ok)
    return next(i for i in instances if i.instance_id == chosen)


def pick_decode(instances: Sequence[InstanceView], region: str, wrr: WeightedRoundRobin) -> InstanceView | None:
    """Pick the decode instance for a request prefilled in ``region``: same region first, WRR by throughput.

    Args:
        instances: the model's ready instances.
        region: the prefill instance's region.
        wrr: the model's round-robin state over instance ids.

    Returns:
        A decode-phase instance, or None if there is none (the prefill instance then decodes).
    """
    decode = [i for i in instances if i.phase == "decode"]
    local = [i for i in decode if i.region == region]
    pool = local or decode
    if not pool:
        return None
    chosen = wrr.pick([i.instance_id for i in pool])
    return next(i for i in pool if i.instance_id == chosen)
