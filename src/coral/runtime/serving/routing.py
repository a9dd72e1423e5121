"""The coordinator's routing over its registered instances: the shared :mod:`coral.policy` choices
(least work, smooth WRR, ``choose_decode``) on what the coordinator knows of each instance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coral.policy import Candidate, WrrState, choose_decode, least_work, wrr_next, wrr_start
from coral.runtime.protocol import InstancePhase

__all__ = ["InstanceView", "RouteStates", "pick_decode", "pick_prefill"]


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceView:
    """What routing needs to know about one registered instance."""

    instance_id: str
    model: str
    phase: InstancePhase
    region: str
    throughput_tok_per_s: float
    index: int = 0  # a stable integer id (the policy's Candidate.id)

    def __post_init__(self) -> None:
        if not isinstance(self.phase, InstancePhase):
            try:
                object.__setattr__(self, "phase", InstancePhase(self.phase))
            except ValueError:
                raise ValueError(f"phase must be prefill, decode or mixed, got {self.phase!r}") from None
        if not self.throughput_tok_per_s > 0:
            raise ValueError(f"throughput_tok_per_s must be positive, got {self.throughput_tok_per_s}")


RouteStates = dict[tuple[int, ...], WrrState]


def pick_prefill(instances: Sequence[InstanceView], states: RouteStates, *,
                 load: Mapping[str, float] | None = None, new_work: float = 0.0) -> tuple[InstanceView | None, RouteStates]:
    """Pick the instance that runs a request's prefill (phase prefill or mixed).

    With `load` (prompt tokens each instance has queued or running), the shared least-work policy
    (:func:`coral.policy.least_work`: the instance that clears this request soonest at its
    throughput), as the simulator routes by default; without it, smooth WRR ∝ throughput.

    Args:
        instances: the model's instances that take new requests.
        states: WRR state per candidate group (keyed by the group's indices); not modified.
        load: instance id -> outstanding prompt tokens (least-work routing); None: WRR.
        new_work: the request's prompt tokens.

    Returns:
        (the instance, or None if none is prefill-capable; the updated states).
    """
    group = [i for i in instances if i.phase in (InstancePhase.PREFILL, InstancePhase.MIXED)]
    if not group:
        return None, states
    if load is not None:
        k = least_work([load.get(g.instance_id, 0.0) for g in group], [g.throughput_tok_per_s for g in group], new_work)
        return group[k], states
    key = tuple(i.index for i in group)
    i, st = wrr_next(states.get(key) or wrr_start([g.throughput_tok_per_s for g in group]))
    return group[i], {**states, key: st}


def pick_decode(instances: Sequence[InstanceView], region: str, states: RouteStates, *,
                held: Mapping[str, float] | None = None) -> tuple[InstanceView | None, RouteStates]:
    """Pick the decode instance for a request prefilled in ``region``.

    With `held` (sequences each decode instance holds), least work among the prefill's region's
    instances (held per unit of throughput), else among all; without it
    :func:`coral.policy.choose_decode` (same region first, WRR ∝ throughput).

    Args:
        instances: the model's instances that take new requests.
        region: the prefill instance's region.
        states: WRR state per candidate group; not modified.
        held: instance id -> sequences it holds (least-work routing); None: WRR.

    Returns:
        (a decode-phase instance, or None if there is none; the updated states).
    """
    decode = [i for i in instances if i.phase is InstancePhase.DECODE]
    if held is not None:
        if not decode:
            return None, states
        group = [i for i in decode if i.region == region] or decode
        k = least_work([held.get(g.instance_id, 0.0) for g in group], [g.throughput_tok_per_s for g in group], 1.0)
        return group[k], states
    chosen, states = choose_decode([Candidate(id=i.index, region=i.region, weight=i.throughput_tok_per_s) for i in decode], region, states)
    return next((i for i in decode if i.index == chosen), None), states
