"""The engine node: one process holding one layer range of one instance, serving micro-batches.

An engine receives :class:`ForwardBatch` messages (from the scheduler on the first stage,
from the previous stage's node otherwise), runs every item through its layers with that
request's own KV cache, and streams the hidden states to each item's next-stage node,
or, on the last stage, samples the next token and sends it to the scheduler. It also
pushes and receives KV caches for prefill/decode hand-off, re-sliced by layer range.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from coral.runtime.protocol import (
    BatchItem,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    KvLoaded,
    KvPush,
    KvSend,
    Release,
    Shutdown,
    TensorBlob,
    TokenItem,
)
from coral.runtime.transport import Transport

__all__ = ["EngineNode", "NoopShard"]

log = logging.getLogger(__name__)


class NoopShard:
    """A stand-in shard that does no maths (for measuring the runtime's own overhead)."""

    def __init__(self, layer_start: int, layer_end: int, num_layers: int) -> None:
        self.layer_start, self.layer_end, self.num_layers = layer_start, layer_end, num_layers

    @property
    def is_first(self) -> bool:  # noqa: D102
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:  # noqa: D102
        return self.layer_end == self.num_layers


class EngineNode:
    """The message loop of one engine node."""

    def __init__(
        self,
        transport: Transport,
        shard: Any,
        *,
        instance_id: str,
        stage: int,
        node_index: int,
        scheduler: str,
        heartbeat_s: float = 0.25,
        heartbeat_timeout_s: float = 0.0,
    ) -> None:
        """Args:
        transport: this node's inbox.
        shard: a loaded :class:`coral.runtime.model.Shard` or a :class:`NoopShard`.
        instance_id: the instance this node belongs to.
        stage: this node's stage index.
        node_index: this node's index inside the stage.
        scheduler: the instance scheduler's address.
        heartbeat_s: how often to tell the scheduler the node is alive.
        heartbeat_timeout_s: exit when the scheduler has been silent this long (0 = never);
            a node without its scheduler is useless and would otherwise hold its memory.
        """
        self.t = transport
        self.shard = shard
        self.instance_id = instance_id
        self.stage = stage
        self.node_index = node_index
        self.scheduler = scheduler
        self.noop = isinstance(shard, NoopShard)
        if self.noop:
            self.layer_start, self.layer_end = shard.layer_start, shard.layer_end
            self.is_first, self.is_last = shard.is_first, shard.is_last
        else:
            self.layer_start, self.layer_end = shard.spec.layer_start, shard.spec.layer_end
            self.is_first, self.is_last = shard.spec.is_first, shard.spec.is_last
        self.caches: dict[str, Any] = {}
        self.items_served = 0  # micro-batch items run (for tests and metrics)
        self.stop_event = threading.Event()
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._last_beat = 0.0
        self._scheduler_seen = time.monotonic()

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            self.t.send(self.scheduler, Heartbeat(sender=self.t.address, role="engine", instance_id=self.instance_id, in_flight=len(self.caches)))
        if self.heartbeat_timeout_s and now - self._scheduler_seen > self.heartbeat_timeout_s:
            log.warning("engine %s/%d/%d: scheduler silent for %.1f s; exiting", self.instance_id, self.stage, self.node_index, now - self._scheduler_seen)
            self.stop_event.set()

    def hello(self) -> None:
        """Tell the scheduler this node is ready."""
        self.t.send(
            self.scheduler,
            EngineHello(
                instance_id=self.instance_id, stage=self.stage, node_index=self.node_index,
                address=self.t.address, layer_start=self.layer_start, layer_end=self.layer_end,
            ),
        )  # fmt: skip

    def run(self, poll_s: float = 0.1) -> None:
        """Announce the node, then serve messages until :class:`Shutdown` or ``stop_event``."""
        self.hello()
        while not self.stop_event.is_set():
            msg = self.t.recv(min(poll_s, self.heartbeat_s))
            self._beat()
            if msg is None:
                continue
            try:
                if not self.handle(msg):
                    break
            except Exception:  # one bad message must not kill the node
                log.exception("engine %s/%d/%d: failed on %s", self.instance_id, self.stage, self.node_index, type(msg).__name__)

    def handle(self, msg: Any) -> bool:
        """Handle one message.

        Returns:
            False when the node should stop.
        """
        if isinstance(msg, ForwardBatch):
            self._forward(msg)
        elif isinstance(msg, Release):
            for rid in msg.request_ids:
                self.caches.pop(rid, None)
        elif isinstance(msg, KvSend):
            self._kv_send(msg)
        elif isinstance(msg, KvPush):
            self._kv_push(msg)
        elif isinstance(msg, Heartbeat):
            self._scheduler_seen = time.monotonic()
        elif isinstance(msg, Shutdown):
            return False
        else:
            log.warning("engine: ignored unexpected %s", type(msg).__name__)
        return True

    # ------------------------------------------------------------------ forward

    def _run_item(self, item: BatchItem) -> Any:
        if self.noop:
            if self.is_last:
                return None
            return item.hidden
        cache = self.caches.get(item.request_id)
        if cache is None:
            if item.position != 0:
                raise ValueError(f"no KV cache for request {item.request_id} at position {item.position}")
            cache = self.shard.new_cache()
            self.caches[item.request_id] = cache
        hidden = None if item.hidden is None else item.hidden.to_torch()
        return self.shard.forward(cache, item.position, item.token_ids if self.is_first else None, hidden)

    def _forward(self, msg: ForwardBatch) -> None:
        from coral.runtime.model import sample

        done: list[TokenItem] = []
        onward: dict[str, list[BatchItem]] = defaultdict(list)
        errors: list[str] = []
        self.items_served += len(msg.items)
        for item in msg.items:
            try:
                out = self._run_item(item)
                if self.is_last:
                    tok = 3 + (item.position + item.step) % 250 if self.noop else sample(out, item.temperature, item.seed, item.step)
                    done.append(TokenItem(request_id=item.request_id, token=tok))
                else:
                    blob = out if self.noop else TensorBlob.from_torch(out)
                    if blob is None:
                        blob = TensorBlob(dtype="float32", shape=(0,), data=b"")
                    nxt = BatchItem(
                        request_id=item.request_id, position=item.position, token_ids=item.token_ids,
                        hidden=blob, route=item.route, temperature=item.temperature, seed=item.seed, step=item.step,
                    )  # fmt: skip
                    onward[item.route[self.stage + 1]].append(nxt)
            except Exception as e:  # report per request, keep serving the others
                log.exception("engine: request %s failed", item.request_id)
                self.caches.pop(item.request_id, None)
                errors.append(f"{item.request_id}: {e}")
                done.append(TokenItem(request_id=item.request_id, token=-1))
        for addr, items in onward.items():
            self.t.send(addr, ForwardBatch(batch_id=msg.batch_id, reply_to=msg.reply_to, items=tuple(items)))
        if done:
            self.t.send(msg.reply_to, ForwardResult(batch_id=msg.batch_id, items=tuple(done), error="; ".join(errors)))

    # ------------------------------------------------------------------ KV hand-off

    def _kv_send(self, msg: KvSend) -> None:
        cache = self.caches.pop(msg.request_id, None)
        for tgt in msg.targets:
            lo, hi = max(tgt.layer_start, self.layer_start), min(tgt.layer_end, self.layer_end)
            if lo >= hi:
                continue
            if self.noop:
                empty = tuple(TensorBlob(dtype="float32", shape=(0,), data=b"") for _ in range(lo, hi))
                push = KvPush(request_id=msg.request_id, layer_start=lo, seq_len=0, keys=empty, values=empty, notify=msg.notify)
            elif cache is None:
                self.t.send(msg.notify, KvLoaded(request_id=msg.request_id, layer_start=lo, layer_end=hi, error="prefill node has no KV for this request"))
                continue
            else:
                layers = [cache.layers[g - self.layer_start] for g in range(lo, hi)]
                push = KvPush(
                    request_id=msg.request_id, layer_start=lo, seq_len=cache.get_seq_length(),
                    keys=tuple(TensorBlob.from_torch(layer.keys) for layer in layers),
                    values=tuple(TensorBlob.from_torch(layer.values) for layer in layers),
                    notify=msg.notify,
                )  # fmt: skip
            self.t.send(tgt.address, push)

    def _kv_push(self, msg: KvPush) -> None:
        n = len(msg.keys)
        hi = msg.layer_start + n
        error = ""
        try:
            if not self.noop:
                if len(msg.values) != n or msg.layer_start < self.layer_start or hi > self.layer_end:
                    raise ValueError(f"KV for layers [{msg.layer_start}, {hi}) does not fit node layers [{self.layer_start}, {self.layer_end})")
                cache = self.caches.get(msg.request_id)
                if cache is None:
                    cache = self.shard.new_cache()
                    self.caches[msg.request_id] = cache
                dev = self.shard.spec.device
                for j in range(n):
                    local = msg.layer_start - self.layer_start + j
                    cache.update(msg.keys[j].to_torch(dev), msg.values[j].to_torch(dev), local)
                    layer = cache.layers[local]
                    if hasattr(layer, "cumulative_length") and isinstance(layer.cumulative_length, int):
                        layer.cumulative_length = msg.seq_len  # a sliding layer kept only its window
        except Exception as e:
            log.exception("engine: bad KV push for %s", msg.request_id)
            error = str(e) or type(e).__name__
        self.t.send(msg.notify, KvLoaded(request_id=msg.request_id, layer_start=msg.layer_start, layer_end=hi, error=error))

