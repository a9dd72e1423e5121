"""The instance scheduler's cumulative counters, for the coordinator's metrics (`InstanceStats` in its heartbeat)."""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from coral.runtime.engine.blocks import BlockPool
from coral.runtime.protocol import (
    ITERATION_TOKEN_BUCKETS,
    KV_TRANSFER_SECONDS_BUCKETS,
    InstanceStats,
)

__all__ = ["SchedulerCounters"]


class SchedulerCounters:
    """Tokens per forward step and KV hand-offs (count, bytes, seconds) since the scheduler started."""

    def __init__(self) -> None:
        self.iter_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iter_tokens_sum = 0
        self.kv_transfers = 0
        self.kv_bytes = 0
        self.kv_seconds = [0] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1)
        self.kv_seconds_sum = 0.0

    def step(self, tokens: int) -> None:
        """A micro-batch went out with `tokens` new tokens."""
        self.iter_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iter_tokens_sum += tokens

    def kv_loaded(self, took_s: float, nbytes: int) -> None:
        """A decode hand-off's KV is all in place, `took_s` after it was asked for."""
        self.kv_transfers += 1
        self.kv_bytes += nbytes
        self.kv_seconds[bisect.bisect_left(KV_TRANSFER_SECONDS_BUCKETS, took_s)] += 1
        self.kv_seconds_sum += took_s

    def snapshot(self, *, preemptions: int, pools: Iterable[BlockPool], lost: Iterable[tuple[int, int]]) -> InstanceStats:
        """The counters, the smallest KV pool of the instance, and the nodes it lost (`stage/node`)."""
        sized = [p for p in pools if p.num_blocks]
        small = min(sized, key=lambda p: p.num_blocks) if sized else None
        return InstanceStats(
            preemptions=preemptions, iteration_tokens=tuple(self.iter_tokens), iteration_tokens_sum=self.iter_tokens_sum,
            kv_transfers=self.kv_transfers, kv_transfer_bytes=self.kv_bytes, kv_transfer_seconds=tuple(self.kv_seconds),
            kv_transfer_seconds_sum=self.kv_seconds_sum, kv_block_size=small.block_size if small else 0,
            kv_blocks=small.num_blocks if small else 0, lost_nodes=tuple(f"{s}/{k}" for s, k in sorted(lost)),
        )  # fmt: skip
