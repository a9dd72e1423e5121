"""The engine node: one process holding one layer range of one instance, serving micro-batches.

An engine receives :class:`ForwardBatch` messages (from the scheduler on the first stage,
from the previous stage's node otherwise) and runs the whole micro-batch through its layers
in one forward pass over its paged KV cache (:mod:`coral.runtime.engine.kv_cache`): prefill
rows (a prompt) and decode rows (one token) mixed. It streams the packed hidden states to
the items' next-stage nodes, or, on the last stage, picks every row's next token with one
:func:`coral.runtime.engine.sampling.sample_batch` call over the batch's ``[B, V]`` logits (each row
with its own :class:`SamplingParams`) and sends them to the scheduler. It also pushes
and receives KV caches for prefill/decode hand-off, re-sliced by layer range.

A row that cannot run (a token outside the vocabulary, a position that does not follow its
cache) fails alone; a row whose blocks do not fit is answered :data:`TOKEN_NO_KV` and the
scheduler queues it again; the others run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from coral.runtime.engine.blocks import KvCacheFull
from coral.runtime.protocol import (
    TOKEN_ERROR,
    TOKEN_NO_KV,
    BatchItem,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    KvLoaded,
    KvPush,
    KvSend,
    Release,
    Role,
    SamplingParams,
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
        kv_cache_gib: float = 0.0,
        kv_block_size: int = 0,
        max_batch_requests: int = 64,
        tp: Any = None,
        beat_transport: Transport | None = None,
    ) -> None:
        """Args:
        transport: this node's inbox.
        shard: a loaded :class:`coral.runtime.engine.model.Shard` or a :class:`NoopShard`.
        instance_id: the instance this node belongs to.
        stage: this node's stage index.
        node_index: this node's index inside the stage.
        scheduler: the instance scheduler's address.
        heartbeat_s: how often to tell the scheduler the node is alive.
        heartbeat_timeout_s: exit when the scheduler has been silent this long (0 = never);
            a node without its scheduler is useless and would otherwise hold its memory.
        kv_cache_gib: the node's KV budget (0 = from the device's memory, see kv_cache).
        kv_block_size: tokens per KV block (0 = default).
        max_batch_requests: the scheduler's batch limit (sizes the KV pool on CPU).
        tp: this node's :class:`coral.runtime.engine.tp.TpGroup` when it is rank 0 of a
            tensor-parallel node (``shard`` then holds rank 0's part of the layers).
        beat_transport: a second outbox for heartbeats, sent from a thread so that a long
            forward pass (a large prefill) does not make the node look dead; None = beat
            from the message loop between messages.
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
        self.kv: Any = None
        self.tp = tp
        if not self.noop:
            ctx = int(shard.spec.config.get("max_position_embeddings", 2048))
            self.kv = shard.new_kv_cache(max_tokens_wanted=max_batch_requests * ctx, kv_cache_gib=kv_cache_gib, block_size=kv_block_size)
            self.vocab = int(shard.spec.config.get("vocab_size", 0))
            if tp is not None:
                tp.send({"op": "init", "blocks": self.kv.pool.num_blocks, "block_size": self.kv.block_size})
        #: last stage: each request's tokens so far (prompt, then output), kept only for
        #: requests whose sampling has a penalty; dropped with the request's KV
        self.histories: dict[str, list[int]] = {}
        if self.is_last:
            # the sampler needs torch even behind a no-op shard: import it now, not under the
            # first batch (seconds on a busy host, longer than the scheduler's heartbeat timeout)
            # lazy: torch (a no-op engine never loads it)
            import coral.runtime.engine.sampling  # noqa: F401
        self.items_served = 0  # micro-batch items run (for tests and metrics)
        self.stop_event = threading.Event()
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._last_beat = 0.0
        self._scheduler_seen = time.monotonic()
        self._scheduler_heard = False
        self.beat_transport = beat_transport

    def _beat_loop(self) -> None:
        assert self.beat_transport is not None
        while not self.stop_event.wait(self.heartbeat_s):
            self.beat_transport.send(self.scheduler, Heartbeat(sender=self.t.address, role=Role.ENGINE, instance_id=self.instance_id, in_flight=self.held_sequences()))

    def _beat(self) -> None:
        now = time.monotonic()
        if self.beat_transport is None and now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            self.t.send(self.scheduler, Heartbeat(sender=self.t.address, role=Role.ENGINE, instance_id=self.instance_id, in_flight=self.held_sequences()))
        # before the scheduler's first word, allow for its start-up (a fresh process importing
        # its libraries takes seconds on a busy host; engines fork ready-made)
        limit = self.heartbeat_timeout_s if self._scheduler_heard else max(30.0, 10 * self.heartbeat_timeout_s)
        if self.heartbeat_timeout_s and now - self._scheduler_seen > limit:
            log.warning("engine %s/%d/%d: scheduler silent for %.1f s; exiting", self.instance_id, self.stage, self.node_index, now - self._scheduler_seen)
            self.stop_event.set()

    def held_sequences(self) -> int:
        """Requests whose KV this node holds."""
        return 0 if self.kv is None else len(self.kv.pool.tables)

    def hello(self) -> None:
        """Tell the scheduler this node is ready, and how many KV blocks it has."""
        blocks, bs = (0, 0) if self.kv is None else (self.kv.pool.num_blocks, self.kv.block_size)
        self.t.send(
            self.scheduler,
            EngineHello(
                instance_id=self.instance_id, stage=self.stage, node_index=self.node_index,
                address=self.t.address, layer_start=self.layer_start, layer_end=self.layer_end,
                kv_blocks=blocks, kv_block_size=bs,
            ),
        )  # fmt: skip

    def run(self, poll_s: float = 0.1) -> None:
        """Announce the node, then serve messages until :class:`Shutdown` or ``stop_event``."""
        self.hello()
        if self.beat_transport is not None:
            threading.Thread(target=self._beat_loop, daemon=True, name="engine-heartbeat").start()
        try:
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
        finally:
            if self.tp is not None:
                self.tp.send({"op": "stop"})

    def _free(self, ids: list[str]) -> None:
        """Drop these sequences' KV (on every rank of a tensor-parallel node) and sampling history."""
        for rid in ids:
            self.histories.pop(rid, None)
            self.kv.free(rid)
        if self.tp is not None:
            self.tp.send({"op": "free", "ids": list(ids)})

    def handle(self, msg: Any) -> bool:
        """Handle one message.

        Returns:
            False when the node should stop.
        """
        if isinstance(msg, ForwardBatch):
            self._forward(msg)
        elif isinstance(msg, Release):
            for rid in msg.request_ids:
                self.histories.pop(rid, None)
            if self.kv is not None:
                self._free(list(msg.request_ids))
        elif isinstance(msg, KvSend):
            self._kv_send(msg)
        elif isinstance(msg, KvPush):
            self._kv_push(msg)
        elif isinstance(msg, Heartbeat):
            self._scheduler_seen = time.monotonic()
            self._scheduler_heard = True
        elif isinstance(msg, Shutdown):
            return False
        else:
            log.warning("engine: ignored unexpected %s", type(msg).__name__)
        return True

    # ------------------------------------------------------------------ forward

    def _forward(self, msg: ForwardBatch) -> None:
        self.items_served += len(msg.items)
        if self.noop:
            self._forward_noop(msg)
        else:
            self._forward_batch(msg)

    def _forward_noop(self, msg: ForwardBatch) -> None:
        """No maths: stand-in logits per item, sampled like real ones (the runtime's own overhead)."""
        if self.is_last:
            # lazy: torch (runtime extra; processes without layers never load it)
            import torch

            # token 3 + (position + step) % 250 far ahead of the rest, so greedy requests get a
            # deterministic sequence and the sampling parameters still act on real logits
            logits = torch.zeros(len(msg.items), 256)
            for k, i in enumerate(msg.items):
                logits[k, 3 + (i.position + i.step) % 250] = 30.0
            done: list[TokenItem] = []
            errors: list[str] = []
            self._sample(list(msg.items), logits, done, errors)
            self.t.send(msg.reply_to, ForwardResult(batch_id=msg.batch_id, items=tuple(done), error="; ".join(errors)))
            return
        onward: dict[str, list[BatchItem]] = defaultdict(list)
        for item in msg.items:
            onward[item.route[self.stage + 1]].append(item)
        for addr, items in onward.items():
            self.t.send(addr, ForwardBatch(batch_id=msg.batch_id, reply_to=msg.reply_to, items=tuple(items)))

    def _inputs(self, msg: ForwardBatch) -> Any:
        """The batch's packed hidden states (later stages), from the batch or from its items."""
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        if self.is_first:
            return None
        dev = self.shard.spec.device
        if msg.hidden is not None:
            return msg.hidden.to_torch(dev)
        parts = [i.hidden.to_torch(dev).reshape(-1, i.hidden.shape[-1]) for i in msg.items if i.hidden is not None]
        if len(parts) != len(msg.items):
            raise ValueError("a later stage needs hidden states for every item")
        return torch.cat(parts)

    def _forward_batch(self, msg: ForwardBatch) -> None:
        """Run the micro-batch in one pass; rows that cannot run are answered alone."""
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        done: list[TokenItem] = []
        errors: list[str] = []

        def refuse(item: BatchItem, token: int, why: str) -> None:
            if token == TOKEN_ERROR:
                log.warning("engine: request %s failed: %s", item.request_id, why)
                errors.append(f"{item.request_id}: {why}")
            self._free([item.request_id])
            done.append(TokenItem(request_id=item.request_id, token=token))

        kv = self.kv
        keep: list[int] = []
        free = kv.pool.num_free
        for k, item in enumerate(msg.items):
            n = len(item.token_ids)
            if n == 0:
                refuse(item, TOKEN_ERROR, "no tokens to run")
                continue
            if self.is_first and not all(0 <= t < self.vocab for t in item.token_ids):
                refuse(item, TOKEN_ERROR, f"token id outside the vocabulary [0, {self.vocab})")
                continue
            held = kv.length(item.request_id)
            if item.position == 0 and held:
                self._free([item.request_id])  # a restart (preempted and recomputed): the old KV is stale
                held = 0
            if held != item.position:
                refuse(item, TOKEN_ERROR, f"no KV cache for position {item.position} (node holds {held} tokens)")
                continue
            need = kv.pool.extra_blocks(item.request_id, item.position + n)
            if need > free:
                refuse(item, TOKEN_NO_KV, "")
                continue
            free -= need
            keep.append(k)
        items = [msg.items[k] for k in keep]
        try:
            hidden = self._inputs(msg)
            if items:
                if hidden is not None and len(keep) < len(msg.items):
                    lens = [len(i.token_ids) for i in msg.items]
                    starts = [sum(lens[:k]) for k in range(len(lens))]
                    idx = torch.tensor([starts[k] + j for k in keep for j in range(lens[k])], device=hidden.device)
                    hidden = hidden.index_select(0, idx)
                rows = [(i.request_id, i.position, len(i.token_ids)) for i in items]
                flat = [t for i in items for t in i.token_ids] if self.is_first else None
                if self.tp is not None:
                    # lazy: torch (a no-op engine never loads it)
                    from coral.runtime.engine.tp import forward_cmd

                    self.tp.send(forward_cmd(rows, flat, hidden), *([] if hidden is None else [hidden]))
                meta = kv.prepare(rows)
                ids = torch.tensor(flat, dtype=torch.long) if flat is not None else None
                out = self.shard.forward_batch(meta, ids, hidden)
                if self.is_last:
                    self._sample(items, out, done, errors)
                else:
                    self._send_onward(msg, items, out)
        except KvCacheFull:  # cannot happen after the check above; kept so a bug queues rather than fails
            for i in items:
                refuse(i, TOKEN_NO_KV, "")
        except Exception as e:  # the whole pass failed: every row of it fails, the node keeps serving
            log.exception("engine %s/%d/%d: batch %d failed", self.instance_id, self.stage, self.node_index, msg.batch_id)
            for i in items:
                refuse(i, TOKEN_ERROR, str(e) or type(e).__name__)
        if done:
            self.t.send(msg.reply_to, ForwardResult(batch_id=msg.batch_id, items=tuple(done), error="; ".join(errors)))

    def _history(self, item: BatchItem, params: SamplingParams) -> list[int]:
        """The request's tokens so far as this last stage has seen them fed (for penalties)."""
        if not params.needs_history:
            return []
        hist = self.histories.get(item.request_id)
        if hist is None or item.position == 0:  # first sight, or a restart that feeds it all again
            hist = self.histories[item.request_id] = list(item.history)
        hist.extend(item.token_ids)
        return hist

    def _sample(self, items: list[BatchItem], logits: Any, done: list[TokenItem], errors: list[str]) -> None:
        """One :func:`sample_batch` call over the rows' ``[B, V]`` logits, each row with its own parameters."""
        # lazy: torch (a no-op engine never loads it)
        from coral.runtime.engine.sampling import sample_batch

        params = [i.sampling or SamplingParams(temperature=i.temperature, seed=i.seed) for i in items]
        hists = [self._history(i, p) for i, p in zip(items, params, strict=True)]
        try:
            picks = sample_batch(logits, params, [i.step for i in items], hists)
        except Exception as e:  # a bad row's parameters fail the batch's rows, the node keeps serving
            log.exception("engine %s/%d/%d: sampling failed", self.instance_id, self.stage, self.node_index)
            for i in items:
                errors.append(f"{i.request_id}: sampling failed: {e}")
                if self.kv is not None:
                    self._free([i.request_id])
                self.histories.pop(i.request_id, None)
                done.append(TokenItem(request_id=i.request_id, token=TOKEN_ERROR))
            return
        done += [TokenItem(request_id=i.request_id, token=p.token, logprob=p.logprob, top_logprobs=p.top) for i, p in zip(items, picks, strict=True)]

    def _send_onward(self, msg: ForwardBatch, items: list[BatchItem], out: Any) -> None:
        """Send the packed hidden states to each item's next-stage node (one message per node)."""
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        nxt = self.stage + 1
        onward = [
            BatchItem(
                request_id=i.request_id, position=i.position, token_ids=i.token_ids, hidden=None, route=i.route,
                temperature=i.temperature, seed=i.seed, step=i.step, sampling=i.sampling, history=i.history,
            )
            for i in items
        ]  # fmt: skip
        addrs = {i.route[nxt] for i in items}
        if len(addrs) == 1:
            self.t.send(addrs.pop(), ForwardBatch(batch_id=msg.batch_id, reply_to=msg.reply_to, items=tuple(onward), hidden=TensorBlob.from_torch(out)))
            return
        lens = [len(i.token_ids) for i in items]
        starts = [sum(lens[:k]) for k in range(len(lens))]
        for addr in sorted(addrs):
            ks = [k for k, i in enumerate(items) if i.route[nxt] == addr]
            idx = torch.tensor([starts[k] + j for k in ks for j in range(lens[k])], device=out.device)
            blob = TensorBlob.from_torch(out.index_select(0, idx))
            self.t.send(addr, ForwardBatch(batch_id=msg.batch_id, reply_to=msg.reply_to, items=tuple(onward[k] for k in ks), hidden=blob))

    # ------------------------------------------------------------------ KV hand-off

    def _kv_send(self, msg: KvSend) -> None:
        kv = self.kv
        key = msg.kv_id or msg.request_id
        held = None if kv is None else kv.length(key)
        for tgt in msg.targets:
            lo, hi = max(tgt.layer_start, self.layer_start), min(tgt.layer_end, self.layer_end)
            if lo >= hi:
                continue
            if self.noop:
                empty = tuple(TensorBlob(dtype="float32", shape=(0,), data=b"") for _ in range(lo, hi))
                push = KvPush(request_id=msg.request_id, layer_start=lo, seq_len=0, keys=empty, values=empty, notify=msg.notify)
            elif not held:
                self.t.send(msg.notify, KvLoaded(request_id=msg.request_id, layer_start=lo, layer_end=hi, error="prefill node has no KV for this request"))
                continue
            else:
                # lazy: torch (runtime extra; processes without layers never load it)
                import torch

                with torch.inference_mode():
                    local = [g - self.layer_start for g in range(lo, hi)]
                    if self.tp is not None:
                        self.tp.send({"op": "export", "seq": key, "layers": local})
                        layers = [tuple(self.tp.gather_heads(x) for x in kv.export(key, j)) for j in local]
                    else:
                        layers = [kv.export(key, j) for j in local]
                push = KvPush(
                    request_id=msg.request_id, layer_start=lo, seq_len=int(held or 0),
                    keys=tuple(TensorBlob.from_torch(k) for k, _ in layers),
                    values=tuple(TensorBlob.from_torch(v) for _, v in layers),
                    notify=msg.notify,
                )  # fmt: skip
            self.t.send(tgt.address, push)
        self.histories.pop(key, None)  # the decode side gets the history with its first batch
        if kv is not None:
            self._free([key])

    def _kv_push(self, msg: KvPush) -> None:
        n = len(msg.keys)
        hi = msg.layer_start + n
        error = ""
        try:
            if not self.noop:
                # lazy: torch (runtime extra; processes without layers never load it)
                import torch

                if len(msg.values) != n or msg.layer_start < self.layer_start or hi > self.layer_end:
                    raise ValueError(f"KV for layers [{msg.layer_start}, {hi}) does not fit node layers [{self.layer_start}, {self.layer_end})")
                if msg.seq_len < 1:
                    raise ValueError("a KV push needs seq_len >= 1")
                kv = self.kv
                ks = [b.to_torch() for b in msg.keys]
                vs = [b.to_torch() for b in msg.values]
                for j, (k, v) in enumerate(zip(ks, vs, strict=True)):
                    if k.dim() != 4 or k.shape[2] != msg.seq_len or tuple(k.shape) != tuple(v.shape):
                        raise ValueError(f"KV of layer {msg.layer_start + j} has shape {tuple(k.shape)}, expected [1, heads, {msg.seq_len}, dim]")
                kv.reserve(msg.request_id, msg.seq_len)
                local = [msg.layer_start - self.layer_start + j for j in range(n)]
                with torch.inference_mode():
                    if self.tp is not None:
                        cmd = {"op": "load", "seq": msg.request_id, "seq_len": msg.seq_len, "layers": local, "shape": list(ks[0].shape), "dtype": msg.keys[0].dtype}
                        self.tp.send(cmd, *[x for kv_pair in zip(ks, vs, strict=True) for x in kv_pair])
                        hk = kv.keys[0].shape[1]
                        ks = [k[:, :hk] for k in ks]  # rank 0 keeps the first heads
                        vs = [v[:, :hk] for v in vs]
                    for j, k, v in zip(local, ks, vs, strict=True):
                        kv.load(msg.request_id, j, k, v)
        except Exception as e:
            log.exception("engine: bad KV push for %s", msg.request_id)
            error = str(e) or type(e).__name__
        nbytes = sum(memoryview(b.data).nbytes for b in (*msg.keys, *msg.values))
        self.t.send(msg.notify, KvLoaded(request_id=msg.request_id, layer_start=msg.layer_start, layer_end=hi, error=error, nbytes=nbytes))
