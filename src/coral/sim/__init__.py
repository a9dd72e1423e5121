"""Discrete-event simulation of a Coral cluster: kernel, simulated instances, metrics and plots."""
from coral.sim.engine import CTX_GRID_TOK, LanesFn, ProgressFn, ReplanFn, SimOptions, simulate
from coral.sim.hosts import Hosts, PlaceFn
from coral.sim.result import EpochRecord, InstanceRecord, SimResult
from coral.sim.spot import AWS_SPOT_NOTICE_S, PREEMPTION_REASON, SpotMarket, SpotNotice, SpotRecord

__all__ = ["AWS_SPOT_NOTICE_S", "CTX_GRID_TOK", "PREEMPTION_REASON", "EpochRecord", "Hosts", "InstanceRecord",
           "LanesFn", "PlaceFn", "ProgressFn", "ReplanFn", "SimOptions", "SimResult", "SpotMarket", "SpotNotice",
           "SpotRecord", "simulate"]
