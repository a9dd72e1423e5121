"""Routing and lifecycle decisions shared by the simulator and the runtime (pure functions of state and time)."""
from coral.policy.lifecycle import Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import (
    ROUTERS,
    Candidate,
    InstanceSpec,
    SmoothWRR,
    WrrState,
    choose_decode,
    least_work,
    wrr_next,
    wrr_start,
)

__all__ = [
    "ROUTERS", "Candidate", "InstanceSpec", "Lifecycle", "LifecycleEvent", "SmoothWRR", "WrrState", "choose_decode", "least_work",
    "next_state", "wrr_next", "wrr_start",
]
