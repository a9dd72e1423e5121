"""A performance model of the Coral runtime's own engine, read from a `coral profile` CSV and its host file.

The profile table keys a layer's time by tokens per micro-batch (`b·P` in prefill), which fits
batched kernels. The runtime's engine runs every request of a micro-batch alone, one after
another, so its time is `b ×` the time of one request of the batch's mean length, plus costs
the table has no column for. `EnginePerf` adds them through the `PerfModel` interface only, so
the simulator is used unchanged:

* `layer_time_s`: `t0_layer(x) + b × t_layer(x)` with x = P̄ (prefill) or the context (decode):
  a straight line in `b` fitted to the profiled batch sizes at each length. The first request
  of a micro-batch finds the caches cold (the profile evicts them before every run, as the
  other engines on the host do between two micro-batches of one engine); the next ones find
  them warm and cost less, so averaging per-request costs over batch sizes would time a
  micro-batch of one (the usual case at moderate load) too fast;
* `stage_extra_s`: every stage pays the per-request call cost; the first stage the embedding
  and one scheduler→engine message; the last stage norm + LM head + sampling and one
  engine→scheduler message;
* `transfer_s`: one measured loopback message carrying `tokens × hidden × dtype` bytes;
* `kv_transfer_s`: the hand-off's four messages (DecodeAdmit, KvSend, KvPush, KvLoaded), the
  KvPush carrying the prompt's KV at the runtime's dtype;
* `scale`: one multiplier per phase on node time (layers and stage extras), 1 unless the
  fidelity run calibrates it on isolated requests through the real cluster.

`frontend_s` is the part of the time to first token the simulator has no place for: the
coordinator's Submit and TokenOut messages (two loopback latencies).
"""
from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path

import numpy as np

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.experiments.fidelity_profile import HostProfile, read_host
from coral.perf.model import PerfModel, Phase, Shape
from coral.perf.profile import ProfilePerf, load_profile_csv

__all__ = ["EnginePerf", "load_engine_perf"]

_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


class _Curve:
    """Per-request milliseconds as a function of length: linear interpolation, linear extrapolation."""

    def __init__(self, xs: np.ndarray, ys: np.ndarray) -> None:
        self.xs, self.ys = xs, ys

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return float(ys[0])
        if x <= xs[0]:
            # below the shortest profiled length, scale towards the origin but keep the fixed part
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return float(max(ys[0] + slope * (x - xs[0]), 0.5 * ys[0]))
        if x <= xs[-1]:
            return float(np.interp(x, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + max(slope, 0.0) * (x - xs[-1]))


class EnginePerf(ProfilePerf):
    """Times of the runtime's engine: per-request layers, per-stage calls, loopback messages (see module doc)."""

    def __init__(self, base: ProfilePerf, curves: dict[tuple[str, str, str], dict[str, _Curve]], host: HostProfile) -> None:
        super().__init__(base.table, fallback=base.fallback, system=base.system)
        self.curves = curves
        self.host = host
        self.act_bytes = _DTYPE_BYTES.get(host.dtype, 4.0)
        # The runtime's own path costs beyond the modelled messages, measured with no-maths engines
        # (`fidelity_runtime.runtime_overhead`): HTTP + tokenizer + coordinator per request, and the
        # scheduler's work per decode step. 0 until set.
        self.frontend_extra_s = 0.0
        self.step_extra_s = 0.0
        # Node-time multipliers per phase from isolated requests through the real cluster
        # (`fidelity._calibrate`): what the runtime's engines spend that the profile does not see.
        self.scale = {Phase.PREFILL: 1.0, Phase.DECODE: 1.0}
        blob = repr(sorted((k, {n: (c.xs.tolist(), c.ys.tolist()) for n, c in v.items()}) for k, v in curves.items()))
        blob += repr((host.activation.latency_s, host.activation.bytes_per_s, host.kv.latency_s, host.kv.bytes_per_s))
        self.version = f"engine-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"

    @property
    def frontend_s(self) -> float:
        """Submit (coordinator → scheduler) and the first TokenOut back: added to the simulated TTFT."""
        return 2 * self.host.activation.latency_s + self.frontend_extra_s

    def _curve(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> tuple[dict[str, _Curve] | None, float]:
        c = self.curves.get((config.name, model.name, shape.phase.value))
        x = shape.prompt_tokens if shape.phase is Phase.PREFILL else shape.mean_context
        return c, x

    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:  # noqa: D102
        c, x = self._curve(config, model, shape)
        if c is None:
            return super().layer_time_s(config, model, shape)
        return (c["layer_ms0"](x) + shape.batch * c["layer_ms"](x)) * 1e-3 * self.scale[shape.phase]

    def stage_extra_s(self, config: NodeConfig, model: ModelSpec, shape: Shape, *, first: bool, last: bool) -> float:  # noqa: D102
        c, x = self._curve(config, model, shape)
        if c is None:
            return super().stage_extra_s(config, model, shape, first=first, last=last)
        cols = ["call_ms"] + (["first_ms"] if first else []) + (["last_ms"] if last else [])
        ms = sum(c[k + "0"](x) + shape.batch * c[k](x) for k in cols)
        hops = (1 if first else 0) + (1 if last else 0)
        step = self.step_extra_s if (first and shape.phase is Phase.DECODE) else 0.0
        return (ms * 1e-3 + hops * self.host.activation.latency_s + step) * self.scale[shape.phase]

    def transfer_s(self, model: ModelSpec, shape: Shape, src: NodeConfig, dst: NodeConfig) -> float:  # noqa: D102
        return self.host.activation.time_s(shape.tokens * model.hidden_size * self.act_bytes)

    def kv_transfer_s(self, model: ModelSpec, prompt_tokens: float, src: NodeConfig, dst: NodeConfig) -> float:  # noqa: D102
        nbytes = prompt_tokens * model.num_layers * 2 * model.num_kv_heads * model.head_dim * self.act_bytes
        return 3 * self.host.activation.latency_s + self.host.kv.time_s(nbytes)


def _curves_from_csv(path: Path) -> dict[tuple[str, str, str], dict[str, _Curve]]:
    reader = csv.DictReader(io.StringIO(path.read_text()))
    need = ("batch", "context", "call_ms", "first_ms", "last_ms")
    if any(c not in (reader.fieldnames or []) for c in need):
        raise CoralError(f"{path}: not written by `coral profile` (needs columns {', '.join(need)})")
    cols = ("layer_ms", "call_ms", "first_ms", "last_ms")
    acc: dict[tuple[str, str, str], dict[float, list[tuple[float, ...]]]] = {}
    for i, row in enumerate(reader, start=2):
        try:
            b = float(row["batch"])
            vals = (b, *(float(row[k]) for k in cols))
            ctx = float(row["context"])
            if not b > 0:
                raise ValueError
        except ValueError:
            raise CoralError(f"{path} row {i}: batch, context and the *_ms columns must be numbers, batch > 0") from None
        acc.setdefault((row["config"].strip(), row["model"].strip(), row["phase"].strip()), {}).setdefault(ctx, []).append(vals)
    out = {}
    for key, pts in acc.items():
        xs = np.array(sorted(pts))
        fits = np.array([[_fit_batch(np.array(pts[x])[:, 0], np.array(pts[x])[:, 1 + j]) for j in range(len(cols))] for x in xs])
        curves = {}
        for j, name in enumerate(cols):
            curves[name + "0"] = _Curve(xs, fits[:, j, 0])  # once per micro-batch (cold caches)
            curves[name] = _Curve(xs, fits[:, j, 1])  # per request
        out[key] = curves
    return out


def _fit_batch(b: np.ndarray, ms: np.ndarray) -> tuple[float, float]:
    """(fixed, per request) ms of a micro-batch of b requests: least squares `fixed + b·per`, both >= 0.

    With one batch size, or a fit that goes negative, the cost is all per request (mean of ms / b).
    """
    if len(set(b.tolist())) >= 2:
        per, fixed = np.polyfit(b, ms, 1)
        if fixed >= 0 and per >= 0:
            return float(fixed), float(per)
    return 0.0, float(np.mean(ms / b))


def load_engine_perf(csv_path: str | Path, catalog: Catalog, fallback: PerfModel | None = None) -> EnginePerf:
    """Read a `coral profile` CSV and its `<csv>.host.json` as an `EnginePerf`.

    Raises:
        CoralError: a missing file or a CSV without the engine columns.
    """
    p = Path(csv_path)
    base = load_profile_csv(p, catalog, fallback=fallback)
    return EnginePerf(base, _curves_from_csv(p), read_host(p))
