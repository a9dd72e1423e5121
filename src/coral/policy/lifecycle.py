"""Instance lifecycle: STARTING → ACTIVE → DRAINING → STOPPED (or FAILED), as a pure transition function."""
from __future__ import annotations

from enum import StrEnum


class Lifecycle(StrEnum):
    STARTING = "starting"  # nodes paid for, loading weights; takes no traffic
    ACTIVE = "active"  # takes new requests
    DRAINING = "draining"  # takes no new requests, finishes the ones it holds
    STOPPED = "stopped"  # gone; no cost from here on
    FAILED = "failed"  # lost a node it cannot route around; its requests are retried elsewhere


class LifecycleEvent(StrEnum):
    READY = "ready"  # initialization finished
    REMOVE = "remove"  # the new plan no longer has this instance, and its holder knows what it holds
    DRAIN = "drain"  # stop taking requests; the holder is remote, so it stops on its IDLE, not before
    IDLE = "idle"  # the instance holds no request any more (checked after each completion)
    FAIL = "fail"  # the instance cannot serve any more


def next_state(state: Lifecycle, event: LifecycleEvent, *, in_flight: int) -> Lifecycle:
    """The state after `event`.

    A removed starting instance stops at once (it holds nothing); a removed active one drains,
    and stops as soon as it holds no request (immediately when already idle). DRAIN is REMOVE for
    a caller that learns what the instance holds only from the instance (the runtime's
    coordinator, whose count may trail a request on its way): an active instance always drains
    and stops on the IDLE the instance confirms. FAIL ends any live state. Events that do not
    apply to a state leave it unchanged.

    Args:
        state: the current state.
        event: what happened.
        in_flight: requests the instance holds (queued or running).

    Returns:
        The next state.

    Raises:
        ValueError: a negative `in_flight`.
    """
    if in_flight < 0:
        raise ValueError(f"in_flight must be >= 0, got {in_flight}")
    if event is LifecycleEvent.FAIL:
        return state if state in (Lifecycle.STOPPED, Lifecycle.FAILED) else Lifecycle.FAILED
    if state is Lifecycle.STARTING:
        if event is LifecycleEvent.READY:
            return Lifecycle.ACTIVE
        if event in (LifecycleEvent.REMOVE, LifecycleEvent.DRAIN):
            return Lifecycle.STOPPED
        return state
    if state is Lifecycle.ACTIVE:
        if event is LifecycleEvent.REMOVE:
            return Lifecycle.STOPPED if in_flight == 0 else Lifecycle.DRAINING
        if event is LifecycleEvent.DRAIN:
            return Lifecycle.DRAINING
        return state
    if state is Lifecycle.DRAINING:
        if event is LifecycleEvent.IDLE and in_flight == 0:
            return Lifecycle.STOPPED
        return state
    return state


#: A spot instance under a preemption notice drains this long before its nodes go (when its
#: replacement is not ready sooner), for the requests it holds to finish: the runtime's
#: `Controller.preempt` and the simulator's notice use the same margin.
SPOT_NOTICE_MARGIN_S = 10.0
