"""The engine's hot path: one batched step through a shard's decoder layers, in few, large tensor ops.

A small model's decode step is bound by per-op overhead, not by arithmetic: through the
``transformers`` modules each layer costs a dozen module calls with their keyword plumbing,
three matmuls for q/k/v and two for gate/up, RoPE's ``rotate_half`` (slice, negate, concat)
for q and for k, and sdpa's set-up for a one-token query over grouped heads. For the stock
Llama / Qwen3 / Qwen3-MoE decoder layers, :class:`LeanStep` runs the same maths on the
layers' own weights with far fewer ops:

- q/k/v are one matmul, gate/up one matmul: their weights are concatenated once and the
  modules' own parameters become views of the fused tensor (no second copy of the weights;
  a weight loaded in place afterwards lands in both);
- RoPE runs once over q and k together, in place in the q/k/v output, as
  ``x * cos + roll(x) * sin'`` over the two halves of each head, with ``sin'`` the sine with
  its first half negated: the same products and sums as ``rotate_half``, so the same bits.
  cos and sin' come from a per-position table that the model's rotary module builds once
  (static RoPE kinds; dynamic ones run the module every step). Qwen3's per-head q/k norms
  likewise run as one norm;
- the step's new keys and values go into the KV pool with one ``index_copy_`` and every
  row's context comes back with one ``index_select``, contiguous
  (:meth:`coral.runtime.engine.kv_cache.PagedKvCache.write_and_gather`);
- attention is :func:`coral.runtime.engine.kv_cache.attend`, the call ``coral_paged`` makes
  too: on a decode step (one token per row) each KV head's query group is the query length,
  one plain ``scaled_dot_product_attention`` over ``[rows, kv_heads, group, dim]`` with no
  padding, no packing and no GQA expansion;
- a projection followed by the residual is one ``addmm``.

Norms, residuals and the MLP keep ``transformers``' order of operations (fp32 norms, the
weight times the normalised input), so in fp32 the hidden states are bit for bit the
modules' own (``tests/runtime/test_engine_layers.py``; in bf16 a fused ``addmm`` rounds once
where the modules round twice). A layer of any other kind runs through its module
as before, and so does a projection with a forward hook (tensor parallelism's all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from coral.runtime.engine.kv_cache import attend

__all__ = ["LeanLayer", "LeanStep"]

#: decoder layers whose forward :class:`LeanLayer` reproduces (read in transformers 5.24)
_KNOWN_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer"})


def _rms(x: Any, weight: Any, eps: float) -> Any:
    """``transformers``' RMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # the same ops, composed in C++: the same bits
        n = (x.shape[-1],)
        if weight.dim() == 1:
            return torch.nn.functional.rms_norm(x, n, weight, eps)
        return weight * torch.nn.functional.rms_norm(x, n, None, eps)  # per-head weights (q/k norms stacked)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _fuse(lins: list[Any]) -> tuple[Any, Any]:
    """Concatenate linear layers by output; their weights become views of the result.

    Returns:
        (weight ``[sum(out), in]``, bias or None).
    """
    with torch.no_grad():
        w = torch.cat([lin.weight.data for lin in lins])
        bias = None
        if any(lin.bias is not None for lin in lins):
            bias = torch.cat([lin.bias.data if lin.bias is not None else torch.zeros(lin.out_features, dtype=w.dtype, device=w.device) for lin in lins])
        lo = 0
        for lin in lins:
            hi = lo + lin.out_features
            lin.weight = torch.nn.Parameter(w[lo:hi], requires_grad=False)
            if lin.bias is not None:
                assert bias is not None
                lin.bias = torch.nn.Parameter(bias[lo:hi], requires_grad=False)
            lo = hi
    return w, bias


def _hooked(mod: Any) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks)


class LeanLayer:
    """One stock decoder layer's step on packed ``[T, hidden]`` states (see the module docstring)."""

    def __init__(self, layer: Any, local_idx: int) -> None:
        """Args:
        layer: a stock decoder layer (see :class:`LeanStep`); its q/k/v and gate/up weights
            become views of the fused tensors.
        local_idx: its index in the shard (its KV pool).
        """
        attn, mlp = layer.self_attn, layer.mlp
        self.local_idx = local_idx
        self.ln1, self.eps1 = layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon)
        d = int(attn.head_dim)
        self.head_dim = d
        self.heads = attn.q_proj.out_features // d
        self.kv_heads = attn.k_proj.out_features // d
        self.scale = float(attn.scaling)
        window = getattr(attn, "sliding_window", None)
        self.window = int(window) if window else None
        self.w_qkv, self.b_qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm: tuple[Any, float] | None = None
        if qn is not None and kn is not None:
            # one norm over q and k heads together: every head's own weight, stacked once
            w = torch.cat([qn.weight.data.expand(self.heads, d), kn.weight.data.expand(self.kv_heads, d)])
            self.qk_norm = (w, float(qn.variance_epsilon))
        self.o_proj = attn.o_proj
        self.o_hooked = _hooked(attn.o_proj)
        dense = all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not any(
            _hooked(mod) for mod in (mlp, getattr(mlp, "gate_proj", mlp), getattr(mlp, "up_proj", mlp))
        )
        self.mlp = mlp
        self.dense = dense
        if dense:
            self.inter = mlp.gate_proj.out_features
            self.w_gu, self.b_gu = _fuse([mlp.gate_proj, mlp.up_proj])
            # transformers' SiLUActivation is F.silu behind a module call
            silu = isinstance(mlp.act_fn, torch.nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation"
            self.act = torch.nn.functional.silu if silu else mlp.act_fn
            self.down = mlp.down_proj
            self.down_hooked = _hooked(mlp.down_proj)

    def __call__(self, x: Any, meta: Any, rope: tuple[Any, Any]) -> Any:
        """Run the layer.

        Args:
            x: packed hidden states ``[T, hidden]``.
            meta: the step's :class:`coral.runtime.engine.kv_cache.BatchMeta`.
            rope: ``(cos, sin')`` of the step's positions, ``[T, 1, 2, head_dim / 2]`` (see :class:`LeanStep`).

        Returns:
            The layer's output ``[T, hidden]``.
        """
        t = x.shape[0]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_rms(x, self.ln1, self.eps1), self.w_qkv, self.b_qkv)  # [T, (hq + 2 hk) d]
        qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, 2, d // 2)
        src = qk if self.qk_norm is None else _rms(qk.view(t, hq + hk, d), *self.qk_norm).view(qk.shape)
        cos, sin = rope
        torch.add(src * cos, src.roll(1, 2).mul_(sin), out=qk)  # RoPE in place: q and k stay in qkv
        keys, values = meta.cache.write_and_gather(meta, self.local_idx, qkv[:, hq * d :].view(t, 2, hk, d))  # [B, hk, kv_max, d]
        a = attend(qkv[:, : hq * d].view(t, hq, d), keys, values, meta, self.window, self.scale)
        x = self._residual(x, a, self.o_proj, self.o_hooked)
        h = _rms(x, self.ln2, self.eps2)
        if not self.dense:
            m = self.mlp(h.unsqueeze(0))
            return x + (m[0] if isinstance(m, tuple) else m)[0]
        gu = F.linear(h, self.w_gu, self.b_gu)
        return self._residual(x, self.act(gu[:, : self.inter]) * gu[:, self.inter :], self.down, self.down_hooked)

    @staticmethod
    def _residual(x: Any, a: Any, lin: Any, hooked: bool) -> Any:
        """``x + lin(a)``; one addmm when the projection is a plain bias-free matmul (same bits as the two ops)."""
        if hooked:
            return x + lin(a)
        if lin.bias is None:
            return torch.addmm(x, a, lin.weight.t())
        return x + F.linear(a, lin.weight, lin.bias)


def _supported(layer: Any) -> bool:
    if type(layer).__name__ not in _KNOWN_LAYERS or layer._forward_hooks or layer._forward_pre_hooks:
        return False
    attn = getattr(layer, "self_attn", None)
    if attn is None or _hooked(attn) or not all(hasattr(attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return False
    qk_norms = [getattr(attn, k) for k in ("q_norm", "k_norm") if hasattr(attn, k)]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *qk_norms]
    if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") and not _hooked(n) for n in norms):
        return False
    if qk_norms and (len(qk_norms) != 2 or qk_norms[0].variance_epsilon != qk_norms[1].variance_epsilon):
        return False  # q and k are normalised as one tensor
    return not any(_hooked(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj)) and int(attn.head_dim) % 2 == 0


#: RoPE kinds whose frequencies never change after the model is built (a position's cos/sin is fixed)
_DYNAMIC_ROPE = ("dynamic", "longrope")
#: positions of the largest cos/sin table kept (beyond it, the rotary module runs every step)
_MAX_ROPE_TABLE = 1 << 15


class LeanStep:
    """A shard's batched step: its layers' lean plans and a RoPE table (see the module docstring).

    Built on the shard's first batch, after its weights are final (tensor parallelism splits
    them first and drops the step it may have had).
    """

    def __init__(self, model: Any, *, lean: bool = True) -> None:
        """Args:
        model: the shard's ``transformers`` causal LM.
        lean: False runs every layer through its module (the reference the tests compare with).
        """
        self.layers = model.model.layers
        self.rotary = model.model.rotary_emb
        self.plans: list[LeanLayer | None] = [LeanLayer(layer, i) if lean and _supported(layer) else None for i, layer in enumerate(self.layers)]
        head_dims = {p.head_dim for p in self.plans if p is not None}
        self.head_dim = head_dims.pop() if len(head_dims) == 1 else 0
        if not self.head_dim:  # one RoPE table serves every lean layer, so they share a head size
            self.plans = [None] * len(self.plans)
        rope_type = str(getattr(self.rotary, "rope_type", "dynamic"))
        self.static_rope = self.head_dim > 0 and not any(k in rope_type for k in _DYNAMIC_ROPE)
        self._table: Any = None  # [positions, 2, 2, head_dim / 2]: per position cos, then sin' (halves)

    def _rope_table(self, positions: int, like: Any) -> Any:
        """cos and sin' of positions ``[0, n)``, ``n >= positions`` (grown by doubling, built by the rotary module itself)."""
        tab = self._table
        if tab is None or tab.shape[0] < positions or tab.dtype != like.dtype or tab.device != like.device:
            n = max(256, 1 << (positions - 1).bit_length())
            cos, sin = self.rotary(like, position_ids=torch.arange(n, device=like.device).unsqueeze(0))
            half = self.head_dim // 2
            c, s = cos[0].view(n, 2, half), sin[0].view(n, 2, half)
            # sin': rotate_half's sign folded in, so RoPE is x * cos + roll(x) * sin' (the same products and sums)
            tab = self._table = torch.stack((c, _signed_sin(s)), dim=1)
        return tab

    def run(self, x: Any, meta: Any) -> Any:
        """Run packed hidden states through the layers for one batched step.

        Args:
            x: packed hidden states ``[T, hidden]``.
            meta: the step's :class:`coral.runtime.engine.kv_cache.BatchMeta`.

        Returns:
            The last layer's output ``[T, hidden]``.
        """
        pos = meta.position_ids  # [1, T]
        pe = None  # the rotary module's (cos, sin), for layers that run through their module
        rope = None
        if self.head_dim:
            half = self.head_dim // 2
            if self.static_rope and meta.kv_max <= _MAX_ROPE_TABLE:
                r = self._rope_table(meta.kv_max, x).index_select(0, pos[0])  # every position is < kv_max
                rope = (r[:, 0].unsqueeze(1), r[:, 1].unsqueeze(1))
            else:
                pe = self.rotary(x, position_ids=pos)
                rope = (pe[0][0].view(-1, 1, 2, half), _signed_sin(pe[1][0].view(-1, 1, 2, half)))
        for plan, layer in zip(self.plans, self.layers, strict=True):
            if plan is not None and rope is not None:
                x = plan(x, meta, rope)
                continue
            pe = self.rotary(x, position_ids=pos) if pe is None else pe
            x = layer(x.unsqueeze(0), attention_mask=meta, position_ids=pos, cache=meta, use_cache=True, position_embeddings=pe)[0]
        return x


def _signed_sin(s: Any) -> Any:
    """``[..., 2, half]`` sine halves -> sin' (the first half negated)."""
    return torch.stack((-s[..., 0, :], s[..., 1, :]), dim=-2)
