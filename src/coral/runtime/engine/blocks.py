"""KV block accounting: a free list and a block table per sequence, no tensors.

The engine node places tokens with it (:class:`coral.runtime.engine.kv_cache.PagedKvCache`), and the
instance scheduler keeps one per engine node as an exact mirror, so both agree on what fits; it
needs no torch, so a scheduler process never loads it.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockPool", "KvCacheFull", "KvMirror", "blocks_for"]

#: Tokens per block; small blocks waste little on short sequences, large ones index less.
DEFAULT_BLOCK_SIZE = 16


class KvCacheFull(RuntimeError):
    """Not enough free blocks for a request's tokens (the caller queues or preempts)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class BlockPool:
    """Block accounting: a free list and one block table per sequence (no tensors).

    The engine uses it to place tokens; the scheduler keeps one per engine node as an
    exact mirror, so both agree on what fits.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        """Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).

        Raises:
            ValueError: for a non-positive size.
        """
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    def extra_blocks(self, seq: str, total_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``total_tokens`` tokens."""
        have = len(self.tables.get(seq, ()))
        return max(0, blocks_for(total_tokens, self.block_size) - have)

    def can_grow(self, seq: str, total_tokens: int) -> bool:
        """Whether ``seq`` can grow to ``total_tokens`` tokens now."""
        return self.extra_blocks(seq, total_tokens) <= len(self._free)

    def grow(self, seq: str, total_tokens: int) -> list[int]:
        """Make ``seq`` hold ``total_tokens`` tokens (a new sequence starts empty).

        Returns:
            The sequence's block table.

        Raises:
            KvCacheFull: if the free blocks do not suffice (nothing is allocated then).
        """
        need = self.extra_blocks(seq, total_tokens)
        if need > len(self._free):
            raise KvCacheFull(f"KV cache full: {seq} needs {need} more block(s) of {self.block_size} tokens, {len(self._free)} free of {self.num_blocks}")
        table = self.tables.setdefault(seq, [])
        for _ in range(need):
            table.append(self._free.popleft())
        self.lengths[seq] = max(self.lengths.get(seq, 0), total_tokens)
        return table

    def free(self, seq: str) -> int:
        """Return ``seq``'s blocks to the pool; returns how many (0 for an unknown sequence)."""
        table = self.tables.pop(seq, None)
        self.lengths.pop(seq, None)
        if not table:
            return 0
        self._free.extend(table)
        return len(table)

    def __contains__(self, seq: object) -> bool:
        return seq in self.tables


class KvMirror:
    """The scheduler's exact mirror of every engine node's KV pool (accounting only, no tensors)."""

    def __init__(self) -> None:
        self.pools: dict[str, BlockPool] = {}  # engine address -> mirror of its pool
        self.by_kv: dict[str, str] = {}  # kv id -> request id

    def announce(self, address: str, blocks: int, block_size: int) -> None:
        """A node's hello: mirror its pool (once; a node without a pool is unbounded)."""
        if blocks > 0 and address not in self.pools:
            self.pools[address] = BlockPool(blocks, block_size)

    def fits(self, route: tuple[str, ...], kv_id: str, tokens: int) -> bool:
        """Whether every node of ``route`` can hold ``tokens`` tokens of ``kv_id`` now."""
        return all(self.pools[a].can_grow(kv_id, tokens) for a in route if a in self.pools)

    def grow(self, route: tuple[str, ...], kv_id: str, tokens: int) -> None:
        """Reserve ``tokens`` tokens of ``kv_id`` on every node of ``route``."""
        for a in route:
            if a in self.pools:
                self.pools[a].grow(kv_id, tokens)

    def full_node(self, route: tuple[str, ...], kv_id: str, tokens: int) -> str:
        """The first node of ``route`` that cannot hold ``tokens`` tokens of ``kv_id``."""
        return next(a for a in route if a in self.pools and not self.pools[a].can_grow(kv_id, tokens))

    def free(self, route: tuple[str, ...], kv_id: str) -> None:
        """Forget ``kv_id``'s blocks on every node of ``route``."""
        for a in set(route):
            if a in self.pools:
                self.pools[a].free(kv_id)
        self.by_kv.pop(kv_id, None)

    def holders(self, address: str) -> list[str]:
        """The KV ids holding blocks on ``address``."""
        pool = self.pools.get(address)
        return list(pool.tables) if pool is not None else []

    def usage(self) -> float:
        """Fraction of KV blocks in use on the fullest node (0 with no-op, unbounded engines)."""
        return max(((p.num_blocks - p.num_free) / p.num_blocks for p in self.pools.values() if p.num_blocks), default=0.0)

    def capacity_tokens(self) -> int:
        """Tokens the smallest node pool holds (0 = unbounded)."""
        caps = [p.capacity_tokens for p in self.pools.values()]
        return min(caps) if caps else 0
