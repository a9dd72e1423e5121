"""The coordinator's instance registry, and what it reports of it: /health, /metrics, /admin and the live planner's demand.

:class:`RegistryReports` is the read side of :class:`~coral.runtime.serving.coordinator.Coordinator`
(which derives from it): every method takes the coordinator's lock and reads the registry, the
live attempts and the demand counters; none sends a message or changes the routing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from coral.policy import Lifecycle
from coral.runtime.protocol import (
    ITERATION_TOKEN_BUCKETS,
    KV_TRANSFER_SECONDS_BUCKETS,
    InstancePhase,
    InstanceStats,
)
from coral.runtime.serving.metrics import CacheInfo, FleetStats, ModelCounters
from coral.runtime.serving.requests import ModelInfo, RequestHandle
from coral.runtime.serving.routing import InstanceView
from coral.runtime.serving.window import EpochObservation, RequestWindow

__all__ = ["InstanceRecord", "ModelTotals", "RegistryReports"]


@dataclass(slots=True)
class InstanceRecord:
    """The coordinator's registry entry of one instance."""

    view: InstanceView
    address: str
    state: Lifecycle
    last_seen: float
    t_registered: float
    reported_in_flight: int = 0
    reported_state: Lifecycle | None = None  # the scheduler's own view (heartbeat)
    reported_waiting: int = 0
    reported_kv_usage: float = 0.0
    t_first_request: float = 0.0
    routed: int = 0  # request attempts sent to it (its prefill or its decode)
    t_drain: float = 0.0
    stats: InstanceStats | None = None  # the scheduler's last counters (cumulative) and lost nodes

    @property
    def lost_nodes(self) -> tuple[str, ...]:
        """Engine nodes ("stage/index") the instance runs without (a data-parallel stage lost one)."""
        return self.stats.lost_nodes if self.stats is not None else ()


class ModelTotals:
    """A model's scheduler counters, summed over its instances, the retired ones included (the
    heartbeats carry each scheduler's cumulative figures; the coordinator adds up the increments)."""

    def __init__(self) -> None:
        self.preemptions = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.kv_transfers = 0
        self.kv_transfer_bytes = 0
        self.kv_seconds = [0] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1)
        self.kv_seconds_sum = 0.0

    def add(self, new: InstanceStats, old: InstanceStats | None) -> None:
        """Add what `new` counts beyond `old` (the same scheduler's previous heartbeat)."""
        def inc(a: list[int], b: tuple[int, ...], prev: tuple[int, ...]) -> None:
            if len(b) == len(a):
                for k, v in enumerate(b):
                    a[k] += max(0, v - (prev[k] if len(prev) == len(a) else 0))

        o = old or InstanceStats()
        self.preemptions += max(0, new.preemptions - o.preemptions)
        inc(self.iteration_tokens, new.iteration_tokens, o.iteration_tokens)
        self.iteration_tokens_sum += max(0, new.iteration_tokens_sum - o.iteration_tokens_sum)
        self.kv_transfers += max(0, new.kv_transfers - o.kv_transfers)
        self.kv_transfer_bytes += max(0, new.kv_transfer_bytes - o.kv_transfer_bytes)
        inc(self.kv_seconds, new.kv_transfer_seconds, o.kv_transfer_seconds)
        self.kv_seconds_sum += max(0.0, new.kv_transfer_seconds_sum - o.kv_transfer_seconds_sum)


class RegistryReports:
    """The registry's read side: what the front end, the metrics and the plan controller ask of it."""

    # owned and written by the Coordinator (under ``_lock``)
    models: dict[str, ModelInfo]
    instances: dict[str, InstanceRecord]
    retired: dict[str, str]
    cache_dtype: str
    _lock: threading.RLock
    _wire: dict[str, RequestHandle]
    _parked: list[RequestHandle]
    _totals: dict[str, ModelTotals]
    _model_of: dict[str, str]
    _demand: dict[tuple[str, str], int]
    _demand_t0: float
    _window: RequestWindow

    def _load(self, iid: str) -> int:
        return sum(1 for h in self._wire.values() if iid in (h.instance_id, h.decode_instance))

    def loads(self) -> dict[str, int]:
        """instance id -> requests it holds now (as the coordinator counts them)."""
        with self._lock:
            out = dict.fromkeys(self.instances, 0)
            for h in self._wire.values():
                for iid in {h.instance_id, h.decode_instance}:
                    if iid in out:
                        out[iid] += 1
            return out

    @staticmethod
    def _state_of(r: InstanceRecord) -> str:
        """``active``, ``degraded`` (active, without some engine nodes), ``draining``."""
        return "degraded" if r.state is Lifecycle.ACTIVE and r.lost_nodes else str(r.state)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every registered instance: id, model, phase, region, state (``degraded``: active without the
        ``lost_nodes`` named), load, request attempts routed to it so far, address."""
        loads = self.loads()
        with self._lock:
            return [
                {"id": iid, "model": r.view.model, "phase": r.view.phase, "region": r.view.region, "state": self._state_of(r),
                 "lost_nodes": list(r.lost_nodes), "load": loads.get(iid, 0), "routed": r.routed, "address": r.address}
                for iid, r in sorted(self.instances.items())
            ]  # fmt: skip

    def health(self, repairing: frozenset[str] = frozenset()) -> dict[str, str]:
        """model -> ``ok`` | ``degraded`` | ``unavailable`` | ``starting``, from the registry.

        ``ok``: it takes requests and nothing of it is lost; ``degraded``: it takes requests, but an
        instance runs without a node, or one is being replaced (``repairing``, the models the plan
        controller is repairing); ``unavailable``: it takes none, and an instance of it was lost;
        ``starting``: it takes none yet, and none of it has failed.
        """
        with self._lock:
            lost_models = {r for iid, why in self.retired.items() if why.startswith("lost") and (r := self._model_of.get(iid))}
            out = {}
            for m in self.models:
                recs = [r for r in self.instances.values() if r.view.model == m]
                if self.can_serve(m):
                    hurt = m in repairing or any(r.lost_nodes for r in recs if r.state is Lifecycle.ACTIVE)
                    out[m] = "degraded" if hurt else "ok"
                else:
                    out[m] = "unavailable" if (m in lost_models or m in repairing) else "starting"
            return out

    def fleet_stats(self, repairing: frozenset[str] = frozenset()) -> FleetStats:
        """The registry's part of what /metrics reports."""
        with self._lock:
            counters = {m: ModelCounters(
                preemptions=t.preemptions, iteration_token_counts=tuple(t.iteration_tokens),
                iteration_tokens_sum=t.iteration_tokens_sum, kv_transfers=t.kv_transfers,
                kv_transfer_bytes=t.kv_transfer_bytes, kv_transfer_seconds_counts=tuple(t.kv_seconds),
                kv_transfer_seconds_sum=t.kv_seconds_sum) for m, t in self._totals.items()}  # fmt: skip
            caches = tuple(CacheInfo(model=r.view.model, instance=iid, block_size=r.stats.kv_block_size,
                                     num_gpu_blocks=r.stats.kv_blocks, cache_dtype=self.cache_dtype)
                           for iid, r in self.instances.items() if r.stats is not None and r.stats.kv_blocks)  # fmt: skip
            states: dict[tuple[str, str], int] = {}
            for r in self.instances.values():
                key = (r.view.model, self._state_of(r))
                states[key] = states.get(key, 0) + 1
            lost = tuple((r.view.model, iid, n) for iid, r in self.instances.items() for n in r.lost_nodes)
        return FleetStats(load=self.model_load(), counters=counters, caches=caches, instances=states, lost_nodes=lost,
                          health=self.health(repairing))  # fmt: skip

    def ready_counts(self) -> dict[str, int]:
        """model -> number of registered instances taking traffic."""
        with self._lock:
            out = dict.fromkeys(self.models, 0)
            for r in self.instances.values():
                if r.state is Lifecycle.ACTIVE:
                    out[r.view.model] += 1
            return out

    def model_load(self) -> dict[str, tuple[int, int, float]]:
        """model -> (requests running, requests waiting, mean KV-cache usage 0-1), from the heartbeats.

        Requests parked for a retry count as waiting.
        """
        with self._lock:
            out: dict[str, tuple[int, int, float]] = {}
            for m in self.models:
                recs = [r for r in self.instances.values() if r.view.model == m]
                waiting = sum(r.reported_waiting for r in recs) + sum(1 for h in self._parked if h.model == m)
                running = sum(max(0, r.reported_in_flight - r.reported_waiting) for r in recs)
                kv = sum(r.reported_kv_usage for r in recs) / len(recs) if recs else 0.0
                out[m] = (running, waiting, kv)
            return out

    def can_serve(self, model: str) -> bool:
        """Whether ``model`` has an active prefill-capable instance."""
        with self._lock:
            return any(r.view.model == model and r.view.phase is not InstancePhase.DECODE and r.state is Lifecycle.ACTIVE for r in self.instances.values())

    def observe_epoch(self) -> EpochObservation:
        """What the epoch since the last call showed: tokens/s per model and phase (prefill: prompt
        tokens; decode: generated), and the accepted requests' arrivals and lengths (the live
        planner's window, :func:`coral.policy.demand.epoch_demand`'s input).

        Returns:
            The observation, for every served model.
        """
        with self._lock:
            now = time.monotonic()
            dt = max(1e-9, now - self._demand_t0)
            out = {m: {"prefill": self._demand.get((m, "prefill"), 0) / dt, "decode": self._demand.get((m, "decode"), 0) / dt} for m in self.models}
            self._demand.clear()
            self._demand_t0 = now
            return EpochObservation(demand_tok_per_s=out, window=self._window.take(now), epoch_s=dt)

    def observe_demand(self) -> dict[str, dict[str, float]]:
        """Tokens/s per model and phase since the last observation (:meth:`observe_epoch`'s demand).

        Returns:
            model -> {"prefill": tok/s, "decode": tok/s} for every served model.
        """
        return self.observe_epoch().demand_tok_per_s
