"""Discrete-event simulation of a Coral cluster: kernel, simulated instances, metrics and plots."""
from coral.sim.engine import CTX_GRID_TOK, ProgressFn, ReplanFn, simulate
from coral.sim.result import EpochRecord, InstanceRecord, SimResult

__all__ = ["CTX_GRID_TOK", "EpochRecord", "InstanceRecord", "ProgressFn", "ReplanFn", "SimResult", "simulate"]
