"""Routing and lifecycle decisions shared by the simulator and the runtime (pure functions of state and time)."""
from coral.policy.lifecycle import Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import (
    Candidate,
    InstanceSpec,
    SmoothWRR,
    WrrState,
    choose_decode,
    wrr_next,
    wrr_start,
)

__all__ = [
    "Candidate", "InstanceSpec", "Lifecycle", "LifecycleEvent", "SmoothWRR", "WrrState", "choose_decode",
    "next_state", "wrr_next", "wrr_start",
]
