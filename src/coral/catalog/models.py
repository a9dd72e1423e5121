"""Model architecture specs and the quantities derived from them (per-layer bytes, FLOPs, KV)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from coral.errors import CoralError, unknown

# MXFP4 stores 32 4-bit values with one shared 8-bit scale: 4 + 8/32 = 4.25 bits per parameter.
MXFP4_BYTES_PER_PARAM = 4.25 / 8

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Phi3ForCausalLM",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape: everything the performance model needs.

    `sliding_layers` of the `num_layers` layers attend over at most `sliding_window` tokens.
    MoE models have `num_experts > 0`; each token is routed to `experts_per_token` experts of
    `expert_intermediate_size`. Weight bytes per parameter are `weight_bytes` (bf16: 2) except
    expert weights, which take `expert_weight_bytes` (MXFP4 for gpt-oss).
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int | None = None
    sliding_layers: int = 0
    weight_bytes: float = 2.0
    expert_weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model {self.name}: {field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts or self.expert_intermediate_size <= 0:
                raise ValueError(f"model {self.name}: MoE needs 0 < experts_per_token <= num_experts and expert_intermediate_size > 0")
        elif self.intermediate_size <= 0:
            raise ValueError(f"model {self.name}: intermediate_size must be > 0 for a dense model")
        if not 0 <= self.sliding_layers <= self.num_layers:
            raise ValueError(f"model {self.name}: sliding_layers must be in [0, num_layers]")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError(f"model {self.name}: sliding_layers > 0 needs a sliding_window")

    # --- tensor parallelism ----------------------------------------------------------------
    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM would refuse tensor-parallel degree `tp` for this model, or None when it runs.

        vLLM's rule: the attention heads divide by `tp`; the KV heads divide by `tp`, or `tp`
        divides by them (each KV head then lives on `tp / kv_heads` GPUs); the MLP (for a mixture
        of experts, each expert's) width divides by `tp`. The perf model, the template search,
        the engine and the exports all ask this one rule.
        """
        if tp < 1:
            return f"a tensor-parallel degree must be >= 1, got {tp}"
        heads, kv = self.num_heads, self.num_kv_heads
        width = self.expert_intermediate_size if self.is_moe else self.intermediate_size
        if heads % tp:
            return f"{self.name} has {heads} attention heads, not divisible by TP {tp}"
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            return f"{self.name} has {kv} KV heads: TP {tp} neither divides them nor is a multiple of them"
        if width % tp:
            return f"{self.name}'s MLP width {width} is not divisible by TP {tp}"
        return None

    def valid_tp(self, gpus: int) -> tuple[int, ...]:
        """The tensor-parallel degrees that divide `gpus` and that vLLM accepts for this model."""
        return tuple(t for t in range(1, gpus + 1) if gpus % t == 0 and self.tp_problem(t) is None)

    def check_tp(self, tp: int, gpus: int | None = None) -> None:
        """Raise CoralError (one line: heads, KV heads, the valid degrees) when `tp` is refused."""
        problem = self.tp_problem(tp)
        if problem is None and gpus is not None and gpus % tp:
            problem = f"TP {tp} does not divide the node's {gpus} GPUs"
        if problem is not None:
            valid = ", ".join(map(str, self.valid_tp(gpus or 8)))
            raise CoralError(f"{problem} ({self.num_heads} heads, {self.num_kv_heads} KV heads); "
                             f"valid TP degrees{f' on {gpus} GPUs' if gpus else ''}: {valid}")

    # --- parameters -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer (biases and norms are negligible)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    @property
    def expert_params(self) -> int:
        """One gated MLP expert (gate, up, down)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def mlp_params(self) -> int:
        """All MLP parameters of one layer: the dense MLP, or every expert plus the router."""
        if self.is_moe:
            return self.num_experts * self.expert_params + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params

    @property
    def layer_active_params(self) -> int:
        """Parameters one token multiplies through in one layer (`A_l`)."""
        if self.is_moe:
            return (self.attention_params + self.experts_per_token * self.expert_params
                    + self.hidden_size * self.num_experts)
        return self.layer_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params

    @property
    def active_params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return self.num_layers * self.layer_active_params + heads * self.embedding_params

    # --- bytes ------------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.expert_weight_bytes

    @property
    def layer_weight_bytes(self) -> float:
        """`W_l`: the bytes of one decoder layer's weights, all experts included."""
        if self.is_moe:
            dense = self.attention_params + self.hidden_size * self.num_experts
            return dense * self.weight_bytes + self.num_experts * self.expert_bytes
        return self.layer_params * self.weight_bytes

    def layer_touched_bytes(self, tokens: float) -> float:
        """Weight bytes one layer reads for a batch of `tokens` tokens.

        A dense layer reads all of its weights. A MoE layer reads the attention and router
        weights and the experts the batch routes to: `E·(1-(1-k/E)^tokens)` in expectation
        under uniform routing.
        """
        if not self.is_moe:
            return self.layer_weight_bytes
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))
        dense = self.attention_params + self.hidden_size * self.num_experts
        return dense * self.weight_bytes + touched * self.expert_bytes

    @property
    def embedding_bytes(self) -> float:
        return self.embedding_params * self.weight_bytes

    @property
    def lm_head_bytes(self) -> float:
        """The LM head lives on the last stage; a tied head is a copy there when stages differ."""
        return self.embedding_params * self.weight_bytes

    @property
    def weights_bytes(self) -> float:
        heads = 1 if self.tie_embeddings else 2
        return self.num_layers * self.layer_weight_bytes + heads * self.embedding_bytes

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """`kv_l = 2·K·d·bytes`: K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def sliding_fraction(self) -> float:
        return self.sliding_layers / self.num_layers

    def effective_context(self, context: float) -> float:
        """Mean attended context per layer: sliding layers see at most the window."""
        if not self.sliding_layers:
            return context
        assert self.sliding_window is not None
        f = self.sliding_fraction
        return f * min(context, self.sliding_window) + (1 - f) * context

    def effective_context_sq(self, context: float) -> float:
        """Mean over layers of `min(context, window)²` (causal prefill attention cost)."""
        if not self.sliding_layers:
            return context * context
        assert self.sliding_window is not None
        f = self.sliding_fraction
        # A causal prompt of length P with window w attends to about P·w - w²/2 pairs (P > w),
        # i.e. the "P_eff²" of a full layer (P²/2 pairs) is 2·P·w - w².
        w = self.sliding_window
        sliding = context * context if context <= w else 2 * context * w - w * w
        return f * sliding + (1 - f) * context * context


def from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face `config.json` dictionary.

    Args:
        config: the parsed `config.json`.
        name: the name the spec is known by.

    Returns:
        The model's spec.

    Raises:
        CoralError: for an unsupported architecture or a missing field, naming it.
    """
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CoralError(
            f"model {name}: architecture {arch or '(missing)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if key not in config or config[key] is None:
            raise CoralError(f"model {name}: config.json has no {key!r}, which {arch} needs")
        return config[key]

    layers = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    max_ctx = int(config.get("max_position_embeddings") or 4096)
    kwargs: dict[str, Any] = {}
    if arch == "Qwen3MoeForCausalLM":
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise CoralError(f"model {name}: Qwen3-MoE with dense layers (mlp_only_layers) is not supported")
        kwargs.update(num_experts=int(need("num_experts")), experts_per_token=int(need("num_experts_per_tok")),
                      expert_intermediate_size=int(need("moe_intermediate_size")))
    elif arch == "GptOssForCausalLM":
        kwargs.update(num_experts=int(need("num_local_experts")),
                      experts_per_token=int(config.get("num_experts_per_tok") or need("experts_per_token")),
                      expert_intermediate_size=int(need("intermediate_size")))
        quant = (config.get("quantization_config") or {}).get("quant_method")
        if quant == "mxfp4":
            kwargs["expert_weight_bytes"] = MXFP4_BYTES_PER_PARAM
    # Sliding windows: gpt-oss lists them per layer; Qwen uses them only when enabled;
    # Mistral and Phi-3 apply `sliding_window` to every layer.
    window: Any = config.get("sliding_window")
    layer_types = config.get("layer_types")
    sliding_layers = 0
    if layer_types:
        sliding_layers = sum(1 for t in layer_types if t == "sliding_attention")
    elif window and arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        sliding_layers = layers
    elif window and config.get("use_sliding_window"):
        sliding_layers = min(layers, int(config.get("max_window_layers", layers)))
    if sliding_layers and window and int(window) >= max_ctx:
        sliding_layers = 0  # a window as long as the context changes nothing
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    wbytes = 4.0 if dtype == "float32" else 2.0
    return ModelSpec(
        name=name, architecture=arch, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=int(config.get("intermediate_size") or 0),
        vocab_size=int(need("vocab_size")), max_context=max_ctx,
        sliding_window=int(window) if sliding_layers else None, sliding_layers=sliding_layers,
        weight_bytes=wbytes, tie_embeddings=bool(config.get("tie_word_embeddings", False)), **kwargs,
    )


def load_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Load a ModelSpec from a `config.json` file (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except FileNotFoundError:
        raise CoralError(f"model config {p} does not exist") from None
    except json.JSONDecodeError as exc:
        raise CoralError(f"model config {p} is not valid JSON: {exc}") from None
    return from_hf_config(config, name or p.parent.name or p.stem)


def resolve_model_spec(spec: str, *, base: Path | None = None, name: str | None = None) -> ModelSpec:
    """The one way a user names a model: a built-in name, or a path to a Hugging Face
    `config.json` (anything ending in `.json` or holding a `/`; a folder holding one works too).

    Args:
        spec: the built-in name (`coral catalog models`) or the config.json path.
        base: folder a relative path is read from (a scenario file's folder); None: as given.
        name: the name a config.json model gets (default: its folder's name).

    Returns:
        The model's spec.

    Raises:
        UnknownNameError: `spec` is neither a built-in name nor a path, listing the built-in names.
        CoralError: the config.json is missing or is not valid JSON.
    """
    if spec in builtin_model_names():
        return builtin_model(spec)
    if spec.endswith(".json") or "/" in spec:
        p = Path(spec)
        return load_hf_config(p if p.is_absolute() or base is None else base / p, name=name)
    raise unknown("model", spec, builtin_model_names())


def _builtin_configs() -> dict[str, dict[str, Any]]:
    text = resources.files("coral.catalog").joinpath("data/models.json").read_text()
    return json.loads(text)


def builtin_model_names() -> tuple[str, ...]:
    return tuple(_builtin_configs())


def builtin_model(name: str) -> ModelSpec:
    """The built-in spec named `name` (e.g. `qwen3-32b`).

    Raises:
        UnknownNameError: listing the built-in names.
    """
    configs = _builtin_configs()
    if name not in configs:
        raise unknown("model", name, configs)
    return from_hf_config(configs[name]["config"], name)


def builtin_hf_id(name: str) -> str:
    return str(_builtin_configs()[name]["hf_id"])
