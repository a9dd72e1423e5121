"""Tensor parallelism inside one node: a shard's layers split over ``tp`` devices with ``torch.distributed``.

Megatron's split of a decoder layer: the query/key/value projections and the MLP's gate and
up projections are split by output (each rank holds ``heads / tp`` attention heads,
``kv_heads / tp`` KV heads and ``intermediate / tp`` MLP columns); the attention output and
MLP down projections are split by input and all-reduced (two all-reduces per layer, as the
perf model charges). The embedding, final norm and LM head stay whole on every rank. Each
rank keeps the KV of its own heads in its own paged pool.

Rank 0 is the engine node the scheduler knows; the other ranks are followers with no socket.
Before every step rank 0 broadcasts a command (msgpack bytes in a uint8 tensor: never pickle)
and the step's inputs; every rank then runs the same step. gloo on CPU (tests), NCCL on CUDA.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from coral.errors import CoralError

__all__ = ["TpGroup", "run_follower", "split_for_tp"]

log = logging.getLogger(__name__)


class TpGroup:
    """This process's place in its node's tensor-parallel group."""

    def __init__(self, *, rank: int, world: int, init_method: str, device: str, timeout_s: float = 600.0) -> None:
        """Join the group (blocks until every rank has joined).

        Args:
            rank, world: this rank and the group size (>= 2).
            init_method: ``tcp://host:port`` of rank 0's rendezvous.
            device: this rank's device (NCCL on CUDA, gloo otherwise).
            timeout_s: collective timeout.
        """
        import datetime

        import torch.distributed as dist

        self.rank, self.world, self.device = rank, world, device
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        self._comm_device = device if self.backend == "nccl" else "cpu"

    def send(self, cmd: dict[str, Any], *tensors: Any) -> None:
        """Rank 0: broadcast a command and its tensors."""
        import torch
        import torch.distributed as dist

        raw = msgpack.packb(cmd, use_bin_type=True)
        n = torch.tensor([len(raw)], dtype=torch.long, device=self._comm_device)
        dist.broadcast(n, 0)
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self._comm_device), 0)
        for t in tensors:
            dist.broadcast(t.contiguous().to(self._comm_device), 0)

    def recv(self) -> dict[str, Any]:
        """Followers: the next command."""
        import torch
        import torch.distributed as dist

        n = torch.zeros(1, dtype=torch.long, device=self._comm_device)
        dist.broadcast(n, 0)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self._comm_device)
        dist.broadcast(buf, 0)
        cmd: dict[str, Any] = msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)
        return cmd

    def recv_tensor(self, shape: list[int], dtype: str) -> Any:
        """Followers: a tensor broadcast by rank 0."""
        import torch
        import torch.distributed as dist

        t = torch.empty(shape, dtype=getattr(torch, dtype), device=self._comm_device)
        dist.broadcast(t, 0)
        return t

    def gather_heads(self, t: Any) -> Any:
        """All ranks: concatenate a ``[1, local_heads, n, d]`` tensor over ranks (result on every rank)."""
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=1)

    def close(self) -> None:
        """Leave the group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _slice_rows(lin: Any, lo: int, hi: int) -> None:
    import torch

    lin.weight = torch.nn.Parameter(lin.weight.data[lo:hi].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(lin.bias.data[lo:hi].clone(), requires_grad=False)
    lin.out_features = hi - lo


def _slice_cols(lin: Any, lo: int, hi: int, keep_bias: bool) -> None:
    import torch

    lin.weight = torch.nn.Parameter(lin.weight.data[:, lo:hi].clone(), requires_grad=False)
    if lin.bias is not None and not keep_bias:
        lin.bias = torch.nn.Parameter(torch.zeros_like(lin.bias.data), requires_grad=False)  # added once, by rank 0
    lin.in_features = hi - lo


def _all_reduce_hook(_mod: Any, _inp: Any, out: Any) -> Any:
    import torch.distributed as dist

    dist.all_reduce(out)
    return out


def split_for_tp(shard: Any, rank: int, world: int) -> None:
    """Keep this rank's part of every layer of a loaded shard (in place) and all-reduce the row-split outputs.

    Args:
        shard: a :class:`coral.runtime.engine.model.Shard` with its full layers.
        rank, world: this rank and the TP degree.

    Raises:
        CoralError: if heads, KV heads or the MLP width do not divide by ``world``, or the MLP is not dense.
    """
    cfg = shard.config
    heads = int(cfg.num_attention_heads)
    kv = shard.kv_heads
    d = shard.head_dim
    inter = int(getattr(cfg, "intermediate_size", 0))
    for what, n in (("attention heads", heads), ("KV heads", kv), ("intermediate_size", inter)):
        if n % world:
            raise CoralError(f"tensor parallelism {world}: the model's {what} ({n}) do not divide by it")
    for layer in shard.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj")):
            raise CoralError("tensor parallelism supports dense MLPs (gate/up/down projections), not mixture-of-experts layers")
        hq, hk, ic = heads // world, kv // world, inter // world
        _slice_rows(attn.q_proj, rank * hq * d, (rank + 1) * hq * d)
        _slice_rows(attn.k_proj, rank * hk * d, (rank + 1) * hk * d)
        _slice_rows(attn.v_proj, rank * hk * d, (rank + 1) * hk * d)
        _slice_cols(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, keep_bias=rank == 0)
        _slice_rows(mlp.gate_proj, rank * ic, (rank + 1) * ic)
        _slice_rows(mlp.up_proj, rank * ic, (rank + 1) * ic)
        _slice_cols(mlp.down_proj, rank * ic, (rank + 1) * ic, keep_bias=rank == 0)
        attn.o_proj.register_forward_hook(_all_reduce_hook)
        mlp.down_proj.register_forward_hook(_all_reduce_hook)
    shard.kv_heads = kv // world
    shard.weights_bytes = sum(p.numel() * p.element_size() for p in shard.model.parameters())
    shard.lean = None  # a step built before the split holds the whole layers' fused weights


def forward_cmd(rows: list[tuple[str, int, int]], ids: list[int] | None, hidden: Any | None) -> dict[str, Any]:
    """The command of one step (rank 0 sends it, with ``hidden`` as a tensor when given)."""
    cmd: dict[str, Any] = {"op": "forward", "rows": [list(r) for r in rows], "ids": ids}
    if hidden is not None:
        cmd["hidden"] = [list(hidden.shape), str(hidden.dtype).removeprefix("torch.")]
    return cmd


def run_follower(shard: Any, tp: TpGroup) -> None:
    """A follower rank: run every command rank 0 broadcasts until ``stop``.

    The first command sizes the KV pool: rank 0's block count, so every rank admits the
    same rows (a rank that refused one would leave the others waiting in an all-reduce).

    Args:
        shard: this rank's part of the shard (see :func:`split_for_tp`).
        tp: the group.
    """
    import torch

    from coral.runtime.engine.kv_cache import PagedKvCache

    init = tp.recv()
    if init.get("op") != "init":
        raise RuntimeError(f"tp follower {tp.rank}: expected init, got {init.get('op')!r}")
    kv = PagedKvCache(
        num_layers=shard.num_local_layers, kv_heads=shard.kv_heads, head_dim=shard.head_dim,
        num_blocks=int(init["blocks"]), block_size=int(init["block_size"]), dtype=shard.model.dtype, device=shard.spec.device,
    )  # fmt: skip
    while True:
        cmd = tp.recv()
        op = cmd["op"]
        with torch.inference_mode():
            if op == "stop":
                return
            if op == "free":
                for seq in cmd["ids"]:
                    kv.free(seq)
            elif op == "forward":
                rows = [(str(s), int(p), int(n)) for s, p, n in cmd["rows"]]
                hidden = tp.recv_tensor(*cmd["hidden"]) if "hidden" in cmd else None
                ids = torch.tensor(cmd["ids"], dtype=torch.long) if cmd["ids"] is not None else None
                try:
                    meta = kv.prepare(rows)
                    shard.forward_batch(meta, ids, hidden)
                except Exception:  # rank 0 fails the same way and answers the scheduler
                    log.exception("tp follower %d: step failed", tp.rank)
            elif op == "export":
                for layer in cmd["layers"]:
                    k, v = kv.export(cmd["seq"], layer)
                    tp.gather_heads(k)
                    tp.gather_heads(v)
            elif op == "load":
                kv.reserve(cmd["seq"], cmd["seq_len"])
                for layer in cmd["layers"]:
                    shape, dt = cmd["shape"], cmd["dtype"]
                    k, v = tp.recv_tensor(shape, dt), tp.recv_tensor(shape, dt)
                    hk = kv.keys[0].shape[1]
                    kv.load(cmd["seq"], layer, k[:, tp.rank * hk : (tp.rank + 1) * hk], v[:, tp.rank * hk : (tp.rank + 1) * hk])
            else:
                log.warning("tp follower %d: unknown command %r", tp.rank, op)
