"""The KV-cache manager of one engine node: a paged block pool, block tables, and batched attention.

Memory layout (the vLLM shape, written for this engine): every layer of the node's layer
range owns one tensor of ``num_blocks * block_size`` token slots, ``[slots, 2, kv_heads,
head_dim]`` (a slot's key, then its value; ``keys[layer]`` and ``values[layer]`` are its two
halves as views), allocated once when the engine starts. A request owns a
list of blocks (its block table); token ``t`` of the request lives in slot
``table[t // block_size] * block_size + t % block_size``. Nothing is allocated per request
or per step, so the pool's size is the engine's whole KV memory and it cannot grow.

Budget (DESIGN §2's memory rule, applied to the node): ``memory · u − weights − reserve``
where ``memory`` is the device's memory (CUDA: ``torch.cuda.mem_get_info`` total) and the
reserve leaves room for activations of one micro-batch. On CPU the pool is sized for the
engine's batch limits (``max_batch_requests`` sequences at full context) but never more than
``u`` of the host's free memory; an explicit ``kv_cache_gib`` overrides both.

One batched step: :meth:`PagedKvCache.prepare` turns the micro-batch's rows
(request, first new position, new-token count) into index tensors, built once on the host
(a handful of vectorised ops, one ``torch.tensor`` call for the block tables) and moved to
the device in one copy each: the slot of every new token, a padded gather index of every
row's context (as slots, and as rows of the pool's ``[2 * slots * kv_heads, head_dim]`` view
so that one ``index_select`` yields contiguous ``[rows, kv_heads, kv_max, head_dim]`` keys
and values), and the boolean attention mask (causal, per row, padded queries and keys
masked out; a sliding-window variant for sliding layers). Each layer then writes its new
keys/values into their slots and gathers each row's context for one attention call over
the whole batch (:mod:`coral.runtime.engine.layers` for the stock layers,
:func:`paged_attention` for the others).

Running out of blocks is never an allocation failure: :class:`BlockPool` refuses
(:class:`KvCacheFull`) before touching memory, and the instance scheduler keeps an exact
mirror of every node's pool (:class:`BlockPool` again, accounting only) so it queues new
requests, and preempts running ones by recompute, before an engine would refuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from coral.runtime.engine.blocks import DEFAULT_BLOCK_SIZE, BlockPool, KvCacheFull, blocks_for

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BatchMeta",
    "BlockPool",
    "KvCacheFull",
    "PagedKvCache",
    "blocks_for",
    "attend",
    "kv_budget_bytes",
    "paged_attention",
]

#: DESIGN §2's usable share of a device's memory.
MEMORY_UTILIZATION = 0.9


def _host_free_bytes() -> int:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 * 2**30


def kv_budget_bytes(*, device: str, weights_bytes: int, bytes_per_token: int, max_tokens_wanted: int, kv_cache_gib: float = 0.0) -> int:
    """The node's KV budget in bytes (see the module docstring for the rule).

    Args:
        device: ``cpu`` or ``cuda[:N]``.
        weights_bytes: bytes of the node's weights (already on the device).
        bytes_per_token: KV bytes of one token over the node's layers.
        max_tokens_wanted: tokens the engine's batch limits could ever hold (CPU sizing).
        kv_cache_gib: an explicit budget; 0 = derive it.

    Returns:
        The budget (>= one token's bytes).
    """
    if kv_cache_gib > 0:
        return max(bytes_per_token, int(kv_cache_gib * 2**30))
    if device.startswith("cuda"):
        _free, total = torch.cuda.mem_get_info(torch.device(device))
        reserve = max(256 * 2**20, int(0.02 * total))  # activations of one micro-batch, allocator slack
        return max(bytes_per_token, int(total * MEMORY_UTILIZATION) - weights_bytes - reserve)
    wanted = max_tokens_wanted * bytes_per_token
    return max(bytes_per_token, min(wanted, int(_host_free_bytes() * MEMORY_UTILIZATION / 4)))


@dataclass(slots=True)
class BatchMeta:
    """Index tensors of one batched step (built once, shared by every layer)."""

    rows: int
    q_max: int  # 1: every row decodes one token (packed and padded queries coincide)
    kv_max: int
    slot_mapping: Any  # [T] slot of every new token, rows in order
    gather: Any  # [rows * kv_max] slot of every row's context token (padding -> slot 0)
    kv_rows: Any  # [2 * rows * kv_heads * kv_max] row of every context key, then value, in the pool's flat view
    q_index: Any  # [rows * q_max] packed token index of every padded query (padding -> 0)
    pack_index: Any  # [T] padded query index of every packed token
    last_index: Any  # [rows] packed index of each row's last new token
    position_ids: Any  # [1, T]
    mask: Any  # [rows, 1, q_max, kv_max] bool, True = attend
    sliding_masks: dict[int, Any]  # window -> mask, for sliding-attention layers
    cache: PagedKvCache | None = None
    biases: dict[Any, Any] | None = None  # (window, dtype) -> additive float mask, built once per step

    def bias(self, window: int | None, dtype: Any) -> Any:
        """The mask as an additive 0 / -inf tensor (sdpa would convert a bool mask in every layer)."""
        if self.biases is None:
            self.biases = {}
        key = (window, dtype)
        b = self.biases.get(key)
        if b is None:
            m = self.mask if not window else self.sliding_mask(window)
            b = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
            self.biases[key] = b
        return b

    def sliding_mask(self, window: int) -> Any:
        """The mask of a sliding layer with ``window`` (built on first use)."""
        m = self.sliding_masks.get(window)
        if m is None:
            m = self.mask & self._window(window)
            m[..., 0] |= ~m.any(-1)  # keep padded queries non-empty
            self.sliding_masks[window] = m
        return m

    def _window(self, window: int) -> Any:
        dev = self.mask.device
        q_pos = self.position_ids[0].index_select(0, self.q_index).view(self.rows, 1, self.q_max, 1)
        kv = torch.arange(self.kv_max, device=dev).view(1, 1, 1, self.kv_max)
        return kv > q_pos - window

    # The decoder layers call ``cache.update(key, value, layer_idx, kwargs=...)``: write, then gather.
    def update(self, key: Any, value: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Store the step's new keys/values of one layer and return every row's context, padded.

        Args:
            key, value: ``[1, kv_heads, T, head_dim]`` (packed tokens).
            layer_idx: the shard-local layer.

        Returns:
            Keys and values ``[rows, kv_heads, kv_max, head_dim]``.
        """
        assert self.cache is not None
        return self.cache.write_and_gather(self, layer_idx, torch.stack((key[0], value[0])).permute(2, 0, 1, 3))  # [T, 2, kv_heads, dim]


def attend(query: Any, key: Any, value: Any, meta: BatchMeta, window: int | None, scale: float | None) -> Any:
    """Attention of a step's packed queries over every row's context, one sdpa call for the whole batch.

    Decode steps (one query per row) fold each KV head's query group into the query length:
    ``[rows, kv_heads, group, dim]`` against the ``[rows, kv_heads, kv_max, dim]`` context with
    the ``[rows, 1, 1, kv_max]`` bias, no GQA expansion. Otherwise the packed queries are
    scattered to ``[rows, heads, q_max, dim]`` (padded queries attend to slot 0 only) and the
    result packed again.

    Args:
        query: ``[T, heads, dim]`` packed queries (any strides).
        key, value: ``[rows, kv_heads, kv_max, dim]`` from :meth:`PagedKvCache.write_and_gather`.
        meta: the step's index tensors and mask.
        window: the layer's sliding window (None: full attention).
        scale: the softmax scale (None: ``dim ** -0.5``).

    Returns:
        ``[T, heads * dim]``.
    """
    t, heads, dim = query.shape
    kv_heads = key.shape[1]
    b, qm = meta.rows, meta.q_max
    bias = meta.bias(window, query.dtype)  # [rows, 1, q_max, kv_max]
    key, value = key.to(query.dtype), value.to(query.dtype)
    if qm == 1:
        out = F.scaled_dot_product_attention(query.view(b, kv_heads, heads // kv_heads, dim), key, value, attn_mask=bias, scale=scale)
        return out.reshape(t, heads * dim)
    q = query.index_select(0, meta.q_index).view(b, qm, heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scale, enable_gqa=kv_heads != heads)  # [rows, heads, q_max, dim]
    return out.transpose(1, 2).reshape(b * qm, heads * dim).index_select(0, meta.pack_index)


def paged_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Attention over a packed batch (registered with ``transformers`` as ``coral_paged``).

    ``query`` is packed ``[1, heads, T, head_dim]``; ``key``/``value`` come from
    :meth:`BatchMeta.update`, padded per row; ``attention_mask`` is the step's
    :class:`BatchMeta`. One :func:`attend` call runs the whole batch.

    Returns:
        (``[1, T, heads, head_dim]``, None)
    """
    meta: BatchMeta = attention_mask
    heads, t, dim = query.shape[1:]
    out = attend(query[0].transpose(0, 1), key, value, meta, int(sliding_window) if sliding_window else None, scaling)
    return out.view(1, t, heads, dim), None


class PagedKvCache:
    """The node's KV tensors (one key and one value pool per local layer) and their block pool."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, dtype: Any = None, device: str = "cpu") -> None:
        """Args:
        num_layers: the node's layers.
        kv_heads, head_dim: per layer.
        num_blocks, block_size: the pool.
        dtype: the model's torch dtype (default float32).
        device: where the pool lives.
        """
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.device = device
        self.dtype = dtype or torch.float32
        slots = num_blocks * block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        with torch.inference_mode():
            # empty, not zeros: pages are touched only as blocks are used. One tensor per layer,
            # [slots, 2, kv_heads, head_dim] (a slot's key then its value), so that a step writes
            # both with one index_copy_ and gathers both with one index_select (write_and_gather)
            self.pools = [torch.empty(slots, 2, kv_heads, head_dim, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.keys = [p[:, 0] for p in self.pools]  # [slots, kv_heads, head_dim] views
        self.values = [p[:, 1] for p in self.pools]
        self._flat = [p.view(-1, head_dim) for p in self.pools]
        self._arange: tuple[Any, Any, Any] | None = None
        # per context row of the flat view: key/value half times kv_heads plus the head, [2, 1, kv_heads, 1]
        self._kv_offsets = torch.arange(2).view(2, 1, 1, 1) * kv_heads + torch.arange(kv_heads).view(1, 1, kv_heads, 1)
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * self.keys[0].element_size() if num_layers else 0

    @property
    def budget_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.pool.capacity_tokens * self.bytes_per_token

    def length(self, seq: str) -> int:
        """Tokens held for ``seq`` (0 if none)."""
        return self.pool.lengths.get(seq, 0)

    def free(self, seq: str) -> None:
        """Drop ``seq``'s KV."""
        self.pool.free(seq)

    def _slots(self, seq: str, start: int, end: int) -> Any:
        bs = self.block_size
        table = torch.tensor(self.pool.tables[seq], dtype=torch.long)
        t = torch.arange(start, end)
        return table[t // bs] * bs + t % bs

    def prepare(self, rows: list[tuple[str, int, int]]) -> BatchMeta:
        """Reserve blocks for a step and build its index tensors.

        Args:
            rows: (sequence, position of its first new token, new tokens) per row; the
                position must equal the tokens already held (0 for a new sequence).

        Returns:
            The step's :class:`BatchMeta` (on this cache's device).

        Raises:
            ValueError: if a position does not follow the sequence's cache.
            KvCacheFull: if the blocks do not suffice (nothing is reserved then).
        """
        pool, bs = self.pool, self.block_size
        lengths, held_tables = pool.lengths, pool.tables
        extra = []
        for seq, pos, n in rows:
            held = lengths.get(seq, 0)
            if held != pos:
                raise ValueError(f"position {pos} does not follow the {held} tokens cached for {seq}")
            extra.append(max(0, blocks_for(pos + n, bs) - len(held_tables.get(seq, ()))))
        need = sum(extra)
        if need > pool.num_free:
            raise KvCacheFull(f"KV cache full: the step needs {need} more block(s), {pool.num_free} free of {pool.num_blocks}")
        for (seq, pos, n), e in zip(rows, extra, strict=True):
            if e or seq not in held_tables:
                pool.grow(seq, pos + n)
            else:  # a decode step mostly: the row's blocks already hold its new token
                lengths[seq] = pos + n
        b = len(rows)
        pos_l = [p for _, p, _ in rows]
        n_l = [n for _, _, n in rows]
        q_max = max(n_l)
        kv_max = max(p + n for p, n in zip(pos_l, n_l, strict=True))
        width = blocks_for(kv_max, bs)
        tbs = [held_tables[seq][:width] for seq, _, _ in rows]
        tables = torch.tensor([tb + [0] * (width - len(tb)) for tb in tbs], dtype=torch.long)  # one host tensor
        pos_t = torch.tensor(pos_l, dtype=torch.long)
        ar, blk, off = self._aranges(max(kv_max, b))
        kv = ar[:kv_max]
        slots = tables.index_select(1, blk[:kv_max]) * bs + off[:kv_max]  # [b, kv_max]
        if q_max == 1:  # every row decodes one token: packed and padded queries coincide, the mask is the keys' validity
            kv_ok = kv.unsqueeze(0) <= pos_t.unsqueeze(1)
            gather = torch.where(kv_ok, slots, 0)
            q_index = pack_index = last_index = ar[:b]
            slot_mapping = torch.tensor([tb[p // bs] * bs + p % bs for tb, p in zip(tbs, pos_l, strict=True)], dtype=torch.long)
            mask = kv_ok.view(b, 1, kv_max)
            position_ids = pos_t.unsqueeze(0)
        else:
            n_t = torch.tensor(n_l, dtype=torch.long)
            kv_len = pos_t + n_t
            kv_ok = kv.unsqueeze(0) < kv_len.unsqueeze(1)
            gather = torch.where(kv_ok, slots, 0)
            j = ar[:q_max]
            q_ok = j.unsqueeze(0) < n_t.unsqueeze(1)  # [b, q_max]
            q_pos = pos_t.unsqueeze(1) + j.unsqueeze(0)  # [b, q_max]
            starts = torch.cumsum(n_t, 0) - n_t
            q_index = torch.where(q_ok, starts.unsqueeze(1) + j.unsqueeze(0), 0).reshape(-1)
            pack_index = (ar[:b].unsqueeze(1) * q_max + j.unsqueeze(0))[q_ok]
            slot_mapping = gather.gather(1, q_pos.clamp(max=kv_max - 1))[q_ok]
            mask = (kv.view(1, 1, kv_max) <= q_pos.unsqueeze(2)) & kv_ok.unsqueeze(1) & q_ok.unsqueeze(2)
            mask[:, :, 0] |= ~q_ok  # a padded query attends to slot 0 only (no all-masked row, no NaN)
            position_ids = q_pos[q_ok].unsqueeze(0)
            last_index = starts + n_t - 1
        # row of every context key (then value) in the pool's flat [slots * 2 * kv_heads, head_dim] view, in
        # [2, b, kv_heads, kv_max] order: one index_select gives contiguous per-row keys and values
        kv_rows = gather.view(1, b, 1, kv_max) * (2 * self.kv_heads) + self._kv_offsets  # (slot * 2 + key/value) * kv_heads + head
        dev = self.device
        nb = dev != "cpu"
        return BatchMeta(
            rows=b, q_max=q_max, kv_max=kv_max,
            slot_mapping=slot_mapping.to(dev, non_blocking=nb), gather=gather.reshape(-1).to(dev, non_blocking=nb),
            kv_rows=kv_rows.reshape(-1).to(dev, non_blocking=nb),
            q_index=q_index.to(dev, non_blocking=nb), pack_index=pack_index.to(dev, non_blocking=nb),
            last_index=last_index.to(dev, non_blocking=nb), position_ids=position_ids.to(dev, non_blocking=nb),
            mask=mask.unsqueeze(1).to(dev, non_blocking=nb), sliding_masks={}, cache=self,
        )  # fmt: skip

    def _aranges(self, n: int) -> tuple[Any, Any, Any]:
        """Host ``arange(m)``, its block index and in-block offset, ``m >= n`` (kept, grown by doubling)."""
        if self._arange is None or self._arange[0].shape[0] < n:
            ar = torch.arange(max(256, 1 << (n - 1).bit_length()))
            self._arange = (ar, ar // self.block_size, ar % self.block_size)
        return self._arange

    def write_and_gather(self, meta: BatchMeta, layer: int, new_kv: Any) -> tuple[Any, Any]:
        """Store one local layer's new keys and values and return every row's context.

        Args:
            meta: the step's index tensors.
            layer: the shard-local layer.
            new_kv: ``[T, 2, kv_heads, head_dim]``, each packed new token's key then value (any strides).

        Returns:
            Keys and values ``[rows, kv_heads, kv_max, head_dim]``, contiguous (padding from slot 0).
        """
        self.pools[layer].index_copy_(0, meta.slot_mapping, new_kv.to(self.dtype))
        kv = self._flat[layer].index_select(0, meta.kv_rows).view(2, meta.rows, self.kv_heads, meta.kv_max, self.head_dim)
        return kv[0], kv[1]

    def export(self, seq: str, layer: int) -> tuple[Any, Any]:
        """One local layer's KV of ``seq`` as contiguous ``[1, kv_heads, n, head_dim]`` tensors."""
        slots = self._slots(seq, 0, self.length(seq)).to(self.device)
        k = self.keys[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v = self.values[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        return k, v

    def load(self, seq: str, layer: int, key: Any, value: Any) -> None:
        """Write one local layer's KV ``[1, kv_heads, n, head_dim]`` of ``seq`` (blocks reserved by :meth:`reserve`)."""
        n = key.shape[2]
        slots = self._slots(seq, 0, n).to(self.device)
        self.keys[layer].index_copy_(0, slots, key[0].transpose(0, 1).to(self.device, self.dtype))
        self.values[layer].index_copy_(0, slots, value[0].transpose(0, 1).to(self.device, self.dtype))

    def reserve(self, seq: str, tokens: int) -> None:
        """Hold blocks for ``tokens`` tokens of ``seq`` (for a KV hand-off).

        Raises:
            KvCacheFull: if they do not fit.
        """
        self.pool.grow(seq, tokens)
