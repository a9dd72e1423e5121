"""A contiguous range of a Hugging Face causal LM's decoder layers, as a stand-alone PyTorch module.

The shard is the model class of ``transformers`` itself (``AutoModelForCausalLM``)
built from a copy of the config with ``num_hidden_layers`` set to the range's length
(layers renumbered from 0; per-layer lists such as ``layer_types`` sliced). The first
stage keeps the embedding, the last keeps the final norm and the LM head; the others get
identities there.

:meth:`Shard.forward_batch` runs one micro-batch (ragged prefill and one-token decode rows
mixed) through the range in one pass: the tokens are packed into one ``[1, T]`` sequence for
the embedding, the projections and the MLPs, and attention runs over the paged KV cache of
:mod:`coral.runtime.engine.kv_cache` with a per-row causal mask (the shard's layers are the
``transformers`` decoder layers themselves, with attention registered as ``coral_paged``).
:meth:`Shard.forward` runs one request alone with its own ``DynamicCache`` (the reference
path the tests compare against).

Weights come from a local safetensors file or folder (HF names), or from a seed: every
tensor is drawn from a generator seeded by ``(seed, global tensor name)``, so any shard
of any placement gets exactly the slice of the same full model.
"""

from __future__ import annotations

import copy
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coral.errors import CoralError

__all__ = [
    "BUILTIN_CONFIGS",
    "Shard",
    "ShardSpec",
    "load_shard",
    "make_config",
    "model_config_dict",
    "seeded_state_dict",
    "sample",
    "select_tokens",
]

#: Small configurations known to the runtime by name (random weights only).
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "initializer_range": 0.2, "eos_token_id": 2, "bos_token_id": 1,
    },
    "tiny-qwen3": {
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "initializer_range": 0.2, "eos_token_id": 2, "bos_token_id": 1,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "initializer_range": 0.2, "eos_token_id": 2, "bos_token_id": 1,
    },
    # ~67M parameters: the benchmark's "small model".
    "small-llama": {
        "model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
        "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "initializer_range": 0.02, "eos_token_id": 2, "bos_token_id": 1,
    },
}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """What one engine node loads."""

    config: dict[str, Any]  # HF-style config dict with "model_type"
    layer_start: int
    layer_end: int  # exclusive
    seed: int | None = None
    weights_path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        n = int(self.config.get("num_hidden_layers", 0))
        if not 0 <= self.layer_start < self.layer_end <= n:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_end}) not inside the model's {n} layers")
        if (self.seed is None) == (self.weights_path is None):
            raise ValueError("give exactly one of seed and weights_path")

    @property
    def num_layers(self) -> int:
        """Total decoder layers of the whole model."""
        return int(self.config["num_hidden_layers"])

    @property
    def is_first(self) -> bool:
        """Holds the embedding."""
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and LM head."""
        return self.layer_end == self.num_layers


def model_config_dict(builtin: str | None, hf_config: dict[str, Any] | None, weights_path: str | None) -> dict[str, Any]:
    """Resolve a model's config dict from a built-in name, an inline dict or a weights folder.

    Args:
        builtin: a key of :data:`BUILTIN_CONFIGS`.
        hf_config: an HF-style config dict (needs ``model_type``).
        weights_path: a folder with ``config.json`` (used when neither of the above is given).

    Returns:
        The config dict.

    Raises:
        CoralError: if none or several sources are given, or the source is unusable.
    """
    given = [x is not None for x in (builtin, hf_config)]
    if sum(given) > 1:
        raise CoralError("give only one of builtin and hf_config for a model")
    if builtin is not None:
        if builtin not in BUILTIN_CONFIGS:
            raise CoralError(f"unknown built-in model config {builtin!r}; valid: {', '.join(sorted(BUILTIN_CONFIGS))}")
        return dict(BUILTIN_CONFIGS[builtin])
    if hf_config is not None:
        if "model_type" not in hf_config:
            raise CoralError("hf_config needs a model_type (e.g. llama, qwen3)")
        return dict(hf_config)
    if weights_path is not None and (Path(weights_path) / "config.json").is_file():
        return json.loads((Path(weights_path) / "config.json").read_text())
    raise CoralError("a model needs builtin, hf_config, or a weights folder holding config.json")


def make_config(config: dict[str, Any]) -> Any:
    """Build the ``transformers`` config object from a dict.

    Raises:
        CoralError: if transformers does not know the model type or rejects a field.
    """
    from transformers import AutoConfig

    d = dict(config)
    model_type = d.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError, TypeError) as e:
        raise CoralError(f"bad model config ({model_type!r}): {e}") from None


def _shard_config(full: Any, start: int, end: int) -> Any:
    cfg = copy.deepcopy(full)
    cfg.num_hidden_layers = end - start
    if getattr(full, "layer_types", None):
        cfg.layer_types = list(full.layer_types[start:end])
    if getattr(full, "mlp_only_layers", None):
        cfg.mlp_only_layers = [i - start for i in full.mlp_only_layers if start <= i < end]
    step = getattr(full, "decoder_sparse_step", 1) or 1
    if step != 1 and start % step:
        raise CoralError(f"layer range must start at a multiple of decoder_sparse_step={step}, got {start}")
    return cfg


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def _seeded_tensor(seed: int, name: str, shape: tuple[int, ...], std: float) -> Any:
    import torch

    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return torch.randn(shape, generator=g) * std


def seeded_state_dict(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The full model's random weights for ``seed``, by HF tensor name.

    Args:
        config: the model's config dict.
        seed: the weight seed.

    Returns:
        name -> float32 tensor, for ``AutoModelForCausalLM.from_config(...).load_state_dict``.
    """
    from transformers import AutoModelForCausalLM

    cfg = make_config(config)
    model = AutoModelForCausalLM.from_config(cfg)
    std = float(getattr(cfg, "initializer_range", 0.02))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out = {}
    for name, t in model.state_dict().items():
        src = "model.embed_tokens.weight" if (tied and name == "lm_head.weight") else name
        out[name] = _seeded_tensor(seed, src, tuple(t.shape), std)
    return out


class _WeightSource:
    """Global-name tensor lookup over a seed or safetensors files."""

    def __init__(self, spec: ShardSpec, std: float) -> None:
        self.spec = spec
        self.std = std
        self._files: list[Any] = []
        self._where: dict[str, Any] = {}
        if spec.weights_path is not None:
            from safetensors import safe_open

            p = Path(spec.weights_path)
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            if not files or not all(f.is_file() for f in files):
                raise CoralError(f"no safetensors weights at {spec.weights_path}")
            for f in files:
                h = safe_open(str(f), framework="pt")
                self._files.append(h)
                for k in h.keys():
                    self._where[k] = h

    def get(self, name: str, shape: tuple[int, ...], tied: bool) -> Any:
        if self.spec.seed is not None:
            src = "model.embed_tokens.weight" if (tied and name == "lm_head.weight") else name
            return _seeded_tensor(self.spec.seed, src, shape, self.std)
        h = self._where.get(name)
        if h is None and tied and name == "lm_head.weight":
            h, name = self._where.get("model.embed_tokens.weight"), "model.embed_tokens.weight"
        if h is None:
            raise CoralError(f"weights at {self.spec.weights_path} lack tensor {name!r}")
        t = h.get_tensor(name)
        if tuple(t.shape) != shape:
            raise CoralError(f"tensor {name!r} has shape {tuple(t.shape)}, the config needs {shape}")
        return t


class Shard:
    """A loaded layer range: run a micro-batch (or one request) through it."""

    def __init__(self, spec: ShardSpec, model: Any, config: Any) -> None:
        self.spec = spec
        self.model = model
        self.config = config  # the shard's (renumbered) config, for its caches
        self.num_local_layers = spec.layer_end - spec.layer_start
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.lean: Any = None  # the batched step (coral.runtime.engine.layers.LeanStep), built on the first batch

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over the shard's layers."""
        return 2 * self.num_local_layers * self.kv_heads * self.head_dim * self.model.dtype.itemsize

    def new_kv_cache(self, *, max_tokens_wanted: int, kv_cache_gib: float = 0.0, block_size: int = 0) -> Any:
        """The node's paged KV cache, sized by :func:`coral.runtime.engine.kv_cache.kv_budget_bytes`.

        Args:
            max_tokens_wanted: tokens the engine's batch limits could hold (CPU sizing).
            kv_cache_gib: explicit budget (0 = derive from the device's memory).
            block_size: tokens per block (0 = default).

        Returns:
            A :class:`coral.runtime.engine.kv_cache.PagedKvCache`.
        """
        from coral.runtime.engine.kv_cache import DEFAULT_BLOCK_SIZE, PagedKvCache, kv_budget_bytes

        bs = block_size or DEFAULT_BLOCK_SIZE
        per_tok = self.kv_bytes_per_token
        budget = kv_budget_bytes(device=self.spec.device, weights_bytes=self.weights_bytes, bytes_per_token=per_tok, max_tokens_wanted=max_tokens_wanted, kv_cache_gib=kv_cache_gib)
        blocks = max(1, budget // (per_tok * bs))
        return PagedKvCache(
            num_layers=self.num_local_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
            num_blocks=int(blocks), block_size=bs, dtype=self.model.dtype, device=self.spec.device,
        )  # fmt: skip

    def forward_batch(self, meta: Any, token_ids: Any | None, hidden: Any | None) -> Any:
        """Run one micro-batch through the shard in one pass.

        Args:
            meta: the step's :class:`coral.runtime.engine.kv_cache.BatchMeta` (blocks reserved).
            token_ids: packed new tokens ``[T]`` (long, first stage).
            hidden: the previous stage's packed output ``[T, hidden]`` (other stages).

        Returns:
            Packed hidden states ``[T, hidden]``; on the last stage the logits of each row's
            last new token ``[rows, vocab]`` (float32).

        Raises:
            ValueError: if the input is of the wrong kind.
        """
        import torch

        from coral.runtime.engine.layers import LeanStep

        m = self.model
        if self.lean is None:  # outside inference mode: the fused weights stay ordinary tensors
            self.lean = LeanStep(m)
        with torch.inference_mode():
            if self.spec.is_first:
                if token_ids is None:
                    raise ValueError("the first stage needs token ids")
                x = m.model.embed_tokens(token_ids.to(self.spec.device).unsqueeze(0))
            else:
                if hidden is None:
                    raise ValueError("a later stage needs hidden states")
                x = hidden.to(self.spec.device, m.dtype).unsqueeze(0)
            x = self.lean.run(x[0], meta)  # the engine's hot path
            if self.spec.is_last:
                return m.lm_head(m.model.norm(x.index_select(0, meta.last_index))).float()
            return x

    def new_cache(self) -> Any:
        """An empty KV cache for one request over this shard's layers."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(self, cache: Any, position: int, token_ids: tuple[int, ...] | None, hidden: Any | None) -> Any:
        """Run one request's next positions through the shard.

        Args:
            cache: the request's cache (updated in place).
            position: the sequence position of the first new token; must equal the cache length.
            token_ids: the new tokens (first stage).
            hidden: the previous stage's output, shape [1, n, hidden] (other stages).

        Returns:
            Hidden states [1, n, hidden]; on the last stage, the logits of the last position [vocab].

        Raises:
            ValueError: if the position does not follow the cache, or the input is of the wrong kind.
        """
        import torch

        if cache.get_seq_length() != position:
            raise ValueError(f"position {position} does not follow the cached {cache.get_seq_length()} tokens")
        dev = self.spec.device
        with torch.inference_mode():
            if self.spec.is_first:
                if not token_ids:
                    raise ValueError("the first stage needs token ids")
                kwargs: dict[str, Any] = {"input_ids": torch.tensor([token_ids], dtype=torch.long, device=dev)}
                n = len(token_ids)
            else:
                if hidden is None:
                    raise ValueError("a later stage needs hidden states")
                kwargs = {"inputs_embeds": hidden.to(dev, self.model.dtype)}
                n = hidden.shape[1]
            pos = torch.arange(position, position + n, device=dev).unsqueeze(0)
            out = self.model.model(position_ids=pos, cache=cache, use_cache=True, **kwargs)
            h = out.last_hidden_state
            if self.spec.is_last:
                return self.model.lm_head(h[:, -1, :])[0].float()
            return h


def load_shard(spec: ShardSpec) -> Shard:
    """Build the shard's module and load its weights.

    Args:
        spec: layer range, weights and device.

    Returns:
        The ready shard, in eval mode.

    Raises:
        CoralError: for an unknown architecture, missing weights or a wrong shape.
    """
    import torch
    from transformers import AutoModelForCausalLM

    full = make_config(spec.config)
    cfg = _shard_config(full, spec.layer_start, spec.layer_end)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, spec.dtype))
    except (ValueError, KeyError) as e:
        raise CoralError(f"cannot build {spec.config.get('model_type')!r}: {e}") from None
    if not spec.is_first:
        model.model.embed_tokens = torch.nn.Identity()
    if not spec.is_last:
        model.model.norm = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()
    tied = bool(getattr(full, "tie_word_embeddings", False))
    src = _WeightSource(spec, float(getattr(full, "initializer_range", 0.02)))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            gname = name
            if name.startswith("model.layers."):
                rest = name[len("model.layers.") :]
                idx, tail = rest.split(".", 1)
                gname = f"model.layers.{int(idx) + spec.layer_start}.{tail}"
            t.copy_(src.get(gname, tuple(t.shape), tied).to(t.dtype))
    model.to(spec.device).eval()
    _use_paged_attention(model)
    return Shard(spec, model, cfg)


def _use_paged_attention(model: Any) -> None:
    """Route the model's attention through ``coral_paged`` (sdpa unless given a batch's metadata)."""
    from transformers import AttentionInterface

    AttentionInterface.register("coral_paged", _attention)
    model.config._attn_implementation = "coral_paged"


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from coral.runtime.engine.kv_cache import BatchMeta, paged_attention

    if isinstance(attention_mask, BatchMeta):
        return paged_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def select_tokens(logits: Any, temperatures: list[float], seeds: list[int], steps: list[int]) -> list[int]:
    """Pick every row's next token of a batch from temperature and seed alone.

    A shorthand for :func:`coral.runtime.engine.sampling.sample_batch` (the engine's only sampler)
    with default :class:`~coral.runtime.protocol.SamplingParams` otherwise: greedy rows
    (temperature 0) take the argmax, sampled rows draw from their own generator seeded by
    (seed, step), so a token does not depend on the placement or on the batch it ran in.

    Args:
        logits: ``[rows, vocab]`` float tensor.
        temperatures, seeds, steps: per row (see :func:`sample`).

    Returns:
        One token id per row.
    """
    from coral.runtime.engine.sampling import sample_batch
    from coral.runtime.protocol import SamplingParams

    params = [SamplingParams(temperature=max(0.0, t), seed=s) for t, s in zip(temperatures, seeds, strict=True)]
    return [p.token for p in sample_batch(logits, params, steps)]


def sample(logits: Any, temperature: float, seed: int, step: int) -> int:
    """Pick the next token: greedy for temperature <= 0, else seeded sampling.

    Args:
        logits: [vocab] float tensor.
        temperature: softmax temperature; <= 0 means argmax.
        seed: the request's seed.
        step: which generated token this is (so the draw does not depend on placement).

    Returns:
        The token id.
    """
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits).item())
    g = torch.Generator().manual_seed(_tensor_seed(seed, f"step{step}"))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=g).item())
