"""The one place a template's latency budget and its KV transfer are derived from a model's SLO (DESIGN §4a).

- **Prefill** templates must bring the attainment-quantile prompt `P_q` to its first token within
  `ttft_headroom · TTFT`; the rest of the TTFT is left for queueing, which the capacity model sizes.
- **Decode** templates must make one step within `tpot_headroom · TPOT`.
- **The KV transfer** of a request goes from its prefill instance to its decode instance, over
  the slower NIC of the two. It is counted in *KV tokens*: a prompt of `P` tokens holds
  `K(P) = ModelSpec.effective_context(P)` tokens in each layer (a sliding-window layer only the
  window's: vLLM's hybrid KV manager frees the blocks outside it, so only those are sent), i.e.
  `L · kv_l · K(P)` bytes; every KV figure below is read off the model's length sample through
  `K` (`coral.workload.summary.LengthSummary`). Where it counts depends on which instance emits
  the first token (`KvModel.first_token`):
  - `"prefill"` (the paper's runtime): the prefill instance emits it; the transfer delays the
    second token, so over a request it costs `K(P) / (D − 1)` KV tokens per output token in TPOT.
  - `"decode"` (vLLM's P/D proxy): the decode instance emits it once the KV has arrived, so the
    quantile prompt's whole KV counts in TTFT.

  The transfer gets an *allowance*: `planner.kv_ttft_share` of TTFT ("decode" mode) or
  `planner.kv_tpot_share` of TPOT ("prefill" mode). A template of *either* phase is only kept
  when the quantile request's transfer over its own slowest node's NIC fits the allowance, so any
  prefill -> decode pair, whose transfer runs over the slower of its two NICs, fits it whichever
  templates the allocator pairs. In TPOT the allowance comes off the decode templates' step
  budget; in TTFT off the queueing share the capacity model sizes (the prefill templates keep
  `ttft_headroom` of TTFT).

  `auto` takes, per model, the mode where the quantile request's transfer over the scenario's
  median NIC is the smaller share of its allowance. Both phases are also capped in throughput by the KV
  their NICs can move (`KvModel.rate_tokens`): a prefill template sends `E[K(P)] / E[P]` KV tokens
  per prompt token it serves (1 without sliding layers), a decode template receives
  `KvModel.prompt_per_output` per token it generates.
- **The KV intake** of the decode instances is a resource of its own: over each re-planning epoch
  `w` of the model's traffic sample they must take in `I_w = Σ_w K(P) / epoch` KV tokens/s, and a
  plan's decode capacity `C` (tokens/s, sized on output tokens: `C ≥ T`, the sample's mean output
  rate) does not move with the prompt/output ratio, which swings between epochs (azure-conv:
  ratio 6.9 in one epoch, 4.35 in the next, 5.34 on average). `kv_intake_per_output` is the
  attainment quantile of `I_w` over the epochs divided by `T`; the decode templates' NIC cap uses
  it (`prompt_per_output`, never below the mean ratio), so a template whose NIC binds supplies
  Θ ≤ NIC / (that ratio · bytes), and any plan with `Σ Θ ≥ C ≥ T` has decode NICs taking in at
  least the quantile epoch's KV. The ILP keeps its one tokens/s row per (model, phase); templates
  whose compute binds first are unaffected (their NICs already have the room).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coral.catalog.catalog import DEFAULT_NETWORK_GBPS
from coral.catalog.hardware import NodeConfig, gbps_bytes_per_s
from coral.catalog.models import ModelSpec
from coral.perf.model import Phase
from coral.slo import Slo
from coral.workload.summary import LengthSummary
from coral.workload.trace import Trace

FIRST_TOKEN_MODES = ("auto", "prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class KvModel:
    """How a model's prefill -> decode KV transfer is charged (see the module docstring)."""

    first_token: str  # "prefill" or "decode": the instance that emits the first token
    bytes_per_token: float  # KV bytes of one KV token, all layers (L * kv_l)
    prompt_q: float  # the quantile prompt's KV tokens, K(P_q) (they count in TTFT in "decode" mode)
    per_output_q: float  # the quantile of K(P) / (D - 1) (KV tokens per output token, "prefill" mode)
    prompt_per_output: float  # KV tokens a decode template's NICs are sized to receive per token it generates:
    # E[K(P)] / E[D], or the quantile epoch's intake over the mean output rate where higher (kv_intake_per_output)
    prompt_share: float = 1.0  # E[K(P)] / E[P]: KV tokens a prefill instance sends per prompt token
    allowance_ms: float  # what the quantile request's transfer may take of the SLO it counts in

    def __post_init__(self) -> None:
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"KvModel.first_token must be 'prefill' or 'decode', got {self.first_token!r}")

    @property
    def owner(self) -> Phase:
        """The phase whose SLO the transfer counts in: its templates' budget leaves the allowance."""
        return Phase.PREFILL if self.first_token == "decode" else Phase.DECODE

    @property
    def latency_tokens(self) -> float:
        """KV tokens the quantile request moves within the allowance (both ends' NICs are held to
        it): the whole quantile prompt's in "decode" mode, `K(P)/(D−1)` per output token else."""
        return self.prompt_q if self.first_token == "decode" else self.per_output_q

    def allowance_in_ms(self, phase: Phase) -> float:
        """What the transfer's allowance takes off `phase`'s SLO (ms): all of it in its owner, else 0."""
        return self.allowance_ms if self.owner is phase else 0.0

    def rate_tokens(self, phase: Phase) -> float:
        """KV tokens per work token a `phase` template's NICs move (throughput cap)."""
        return self.prompt_share if phase is Phase.PREFILL else self.prompt_per_output


def kv_intake_per_output(sample: Trace, kv_tokens: Callable[[float], float], epoch_s: float,
                         quantile: float) -> float | None:
    """KV tokens the decode instances must take in per output token of the sample's mean rate: the
    `quantile` over the sample's epochs (`epoch_s` long, from 0; a last partial epoch counts over
    its own length) of each epoch's KV tokens/s, over the whole sample's output tokens/s (module
    docstring). None for a sample without requests or window.

    Raises:
        ValueError: `epoch_s` not > 0 or `quantile` outside (0, 1).
    """
    if not epoch_s > 0:
        raise ValueError(f"epoch_s must be > 0, got {epoch_s}")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    span = float(sample.window_s or 0.0)
    if not len(sample) or not span > 0:
        return None
    p = np.maximum(sample.prompt_tokens.astype(float), 1.0)
    out_rate = float(np.maximum(sample.output_tokens.astype(float), 1.0).sum()) / span
    lengths, where = np.unique(p, return_inverse=True)  # once per distinct length
    kv = np.array([kv_tokens(float(x)) for x in lengths])[where]
    epochs = max(1, math.ceil(span / epoch_s - 1e-9))
    idx = np.clip((np.asarray(sample.arrival_s, dtype=float) // epoch_s).astype(np.int64), 0, epochs - 1)
    per_epoch = np.bincount(idx, weights=kv, minlength=epochs)
    length_s = np.minimum(epoch_s, span - epoch_s * np.arange(epochs))
    return float(np.quantile(per_epoch / length_s, quantile)) / out_rate


def kv_model(model: ModelSpec, lengths: LengthSummary, slo: Slo, configs: Sequence[NodeConfig],
             first_token: str = "auto", ttft_share: float = 0.25, tpot_share: float = 0.1,
             intake_per_output: float | None = None) -> KvModel:
    """The model's KV model; `first_token` "auto" picks the mode as the module docstring says, and
    the allowance is `ttft_share` of TTFT ("decode" mode) or `tpot_share` of TPOT ("prefill").
    `intake_per_output` (`kv_intake_per_output`) raises the decode templates' KV per output token
    above the mean ratio `E[K(P)] / E[D]` where the sample's epochs swing above it."""
    if first_token not in FIRST_TOKEN_MODES:
        raise ValueError(f"first_token must be one of {', '.join(FIRST_TOKEN_MODES)}, got {first_token!r}")
    per_token = model.num_layers * model.kv_bytes_per_token_layer
    mode = first_token
    if mode == "auto":
        nic = statistics.median(c.network_bytes_per_s for c in configs) if configs else gbps_bytes_per_s(DEFAULT_NETWORK_GBPS)
        in_ttft = lengths.kv_prompt_q * per_token / nic * 1e3 / (ttft_share * slo.ttft_ms)
        in_tpot = lengths.kv_per_token_q * per_token / nic * 1e3 / (tpot_share * slo.tpot_ms)
        mode = "decode" if in_ttft < in_tpot else "prefill"
    allowance = ttft_share * slo.ttft_ms if mode == "decode" else tpot_share * slo.tpot_ms
    return KvModel(first_token=mode, bytes_per_token=per_token, prompt_q=lengths.kv_prompt_q,
                   per_output_q=lengths.kv_per_token_q,
                   prompt_per_output=max(lengths.kv_prompt_mean / max(lengths.output_mean, 1.0), intake_per_output or 0.0),
                   prompt_share=lengths.kv_prompt_mean / lengths.prompt_mean, allowance_ms=allowance)


def latency_budget_ms(slo: Slo, phase: Phase, *, ttft_headroom: float, tpot_headroom: float,
                      kv: KvModel | None = None) -> float:
    """A template's latency budget (ms) for `phase`: the SLO times its headroom, less the KV
    allowance in the phase the transfer counts in (module docstring). Can be <= 0."""
    if phase is Phase.PREFILL:  # the allowance comes out of the queueing share (coral.allocator.demand)
        return slo.ttft_ms * ttft_headroom
    return slo.tpot_ms * tpot_headroom - (kv.allowance_in_ms(phase) if kv is not None else 0.0)
