"""Whole instances inside one process (threads over an in-process hub): for tests and baselines.

Same scheduler, engines and wire format as the multi-process runtime, without sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coral.runtime.engine import EngineNode, NoopShard
from coral.runtime.engine.scheduler import NodeSlot, Scheduler
from coral.runtime.transport import InprocHub, InprocTransport

__all__ = ["InprocInstance", "start_inproc_instance"]


@dataclass(slots=True)
class InprocInstance:
    """A running in-process instance: its scheduler, engines and threads."""

    scheduler: Scheduler
    engines: list[EngineNode]
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def address(self) -> str:
        """The scheduler's inbox."""
        return self.scheduler.t.address

    def stop(self) -> None:
        """Stop every thread and close the inboxes."""
        self.scheduler.stop_event.set()
        for e in self.engines:
            e.stop_event.set()
        for t in self.threads:
            t.join(timeout=5)
        self.scheduler.t.close()
        for e in self.engines:
            e.t.close()
            if e.beat_transport is not None:
                e.beat_transport.close()


def start_inproc_instance(
    hub: InprocHub,
    name: str,
    *,
    config: dict[str, Any] | None,
    seed: int = 0,
    stages: list[tuple[int, int, int | list[float]]],
    phase: str = "mixed",
    region: str = "local",
    model: str = "m",
    coordinator: str = "",
    throughput_tok_per_s: float = 1.0,
    micro_batches: int = 0,
    kv_cache_gib: float = 0.0,
    kv_block_size: int = 0,
    heartbeat_timeout_s: float = 2.0,
    max_batch_requests: int = 64,
    chunk_tokens: int = 0,
    step_trace: Callable[[tuple[Any, ...]], None] | None = None,
) -> InprocInstance:
    """Load an instance's shards and start its scheduler and engines as threads.

    Args:
        hub: the in-process switchboard.
        name: instance id; also the scheduler's address (engines get ``name/stage/node``).
        config: the model config dict, or None for no-op engines.
        seed: weight seed.
        stages: (layer_start, layer_end, node count or per-node throughputs) per stage.
        phase, region, model, coordinator, throughput_tok_per_s, micro_batches, heartbeat_timeout_s,
            max_batch_requests, chunk_tokens, step_trace: see :class:`~coral.runtime.engine.scheduling.InstanceScheduler`.
        kv_cache_gib, kv_block_size: each engine's KV pool (see :class:`EngineNode`).

    Returns:
        The running instance (call :meth:`InprocInstance.stop`).
    """
    # lazy: torch (only engines that run layers)
    from coral.runtime.engine.model import ShardSpec, load_shard

    slots = []
    for s, (lo, hi, nodes) in enumerate(stages):
        weights = [1.0] * nodes if isinstance(nodes, int) else list(nodes)
        slots += [NodeSlot(stage=s, node_index=k, layer_start=lo, layer_end=hi, throughput_tok_per_s=w) for k, w in enumerate(weights)]
    num_layers = stages[-1][1]
    sch = Scheduler(
        InprocTransport(hub, name), instance_id=name, model=model, phase=phase, region=region,
        throughput_tok_per_s=throughput_tok_per_s, nodes=slots, coordinator=coordinator, micro_batches=micro_batches,
        heartbeat_timeout_s=heartbeat_timeout_s, max_batch_requests=max_batch_requests, chunk_tokens=chunk_tokens,
        step_trace=step_trace,
    )  # fmt: skip
    engines = []
    for sl in slots:
        if config is None:
            shard: Any = NoopShard(sl.layer_start, sl.layer_end, num_layers)
        else:
            shard = load_shard(ShardSpec(config=config, layer_start=sl.layer_start, layer_end=sl.layer_end, seed=seed))
        t = InprocTransport(hub, f"{name}/{sl.stage}/{sl.node_index}")
        beats = InprocTransport(hub, f"{name}/{sl.stage}/{sl.node_index}#beat")
        engines.append(EngineNode(
            t, shard, instance_id=name, stage=sl.stage, node_index=sl.node_index, scheduler=name,
            kv_cache_gib=kv_cache_gib, kv_block_size=kv_block_size, beat_transport=beats,
        ))  # fmt: skip
    inst = InprocInstance(sch, engines)
    actors: list[Any] = [sch, *engines]
    for obj in actors:
        th = threading.Thread(target=obj.run, kwargs={"poll_s": 0.02}, daemon=True, name=f"{name}-{type(obj).__name__}")
        th.start()
        inst.threads.append(th)
    return inst
