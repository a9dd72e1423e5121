"""Online stage: the allocation ILP (DESIGN §4), goodput mode, the baselines, and the `Plan`."""
from coral.allocator.allocate import (
    DEFAULT_OPTIONS,
    METHODS,
    TIGHT_MARGIN,
    allocate,
    allocate_inputs,
    tight_availability,
    verify_plan,
)
from coral.allocator.inputs import AllocationInputs, build_inputs
from coral.allocator.plan import DemandLine, Instance, NodeUse, Plan, PlanStatus
from coral.allocator.report import plan_tables, render_plan

__all__ = ["DEFAULT_OPTIONS", "METHODS", "TIGHT_MARGIN", "AllocationInputs", "DemandLine", "Instance", "NodeUse",
           "Plan", "PlanStatus", "allocate", "allocate_inputs", "build_inputs", "plan_tables", "render_plan",
           "tight_availability", "verify_plan"]
