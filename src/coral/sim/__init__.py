"""Discrete-event simulation of a Coral cluster: kernel, simulated instances, metrics and plots."""
from coral.sim.engine import CTX_GRID_TOK, LanesFn, ProgressFn, ReplanFn, SimOptions, simulate
from coral.sim.hosts import Hosts, PlaceFn
from coral.sim.result import EpochRecord, InstanceRecord, SimResult

__all__ = ["CTX_GRID_TOK", "EpochRecord", "Hosts", "InstanceRecord", "LanesFn", "PlaceFn", "ProgressFn", "ReplanFn",
           "SimOptions", "SimResult", "simulate"]
