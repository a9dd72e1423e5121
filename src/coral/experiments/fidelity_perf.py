"""A performance model of the Coral runtime's own engine, read from a `coral profile` CSV and its host file.

The runtime's engine runs a micro-batch as one batched forward pass per stage, and `coral
profile` times exactly that: one pass of `b` requests of length `x` (prompt in prefill,
context in decode) over the engine's paged KV cache. `EnginePerf` reads those measured passes
through the `PerfModel` interface only, so the simulator is used unchanged:

* `layer_time_s`: the measured time of one layer for a micro-batch of `b` at length `x`,
  interpolated piecewise-linearly in `b` between the profiled batch sizes (extrapolated along
  the last segment) and then in `x` between the profiled lengths. The profile evicts the caches
  before every run, as the other engines on the host do between two micro-batches of one engine;
* `stage_extra_s`: every stage pays the measured per-pass call cost (KV indices and masks,
  rotary embedding, packing); the first stage the embedding and one scheduler→engine message;
  the last stage norm + LM head + sampling and one engine→scheduler message;
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
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.experiments.fidelity_profile import HostProfile, read_host
from coral.perf.model import DEMAND_PHASES, PerfModel, Phase, Shape
from coral.perf.profile import ProfilePerf, load_profile_csv

__all__ = ["EnginePerf", "curves_from_csv", "load_engine_perf"]

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
    """Times of the runtime's engine: batched layers, per-stage calls, loopback messages (see module doc).

    Built once per setting and never changed: :meth:`calibrated` gives a copy with the runtime's
    measured overheads or the fitted node-time multipliers, so every simulation that got a
    perf object keeps the times it was given.
    """

    def __init__(self, base: ProfilePerf, curves: dict[tuple[str, str, str], dict[str, _BatchCurve]], host: HostProfile,
                 *, frontend_extra_s: float = 0.0, step_extra_s: float = 0.0,
                 scale: Mapping[Phase, float] | None = None) -> None:
        """Args:
        base: the profile table (its fallback and system parameters are kept).
        curves: the batched passes of `coral profile` (`curves_from_csv`).
        host: the host file's message costs.
        frontend_extra_s, step_extra_s: the runtime's own path costs beyond the modelled messages,
            measured with no-maths engines (`fidelity_runtime.runtime_overhead`): HTTP + tokenizer +
            coordinator per request, and the scheduler's work per decode step.
        scale: node-time multipliers per phase, fitted on isolated requests through the real cluster
            (`fidelity._calibrate`): what the runtime's engines spend that the profile does not see.
        """
        super().__init__(base.table, fallback=base.fallback, system=base.system)
        self.curves = curves
        self.host = host
        self.act_bytes = _DTYPE_BYTES.get(host.dtype, 4.0)
        self.frontend_extra_s = float(frontend_extra_s)
        self.step_extra_s = float(step_extra_s)
        given = dict(scale or {})
        self.scale: Mapping[Phase, float] = MappingProxyType({ph: float(given.get(ph, 1.0)) for ph in DEMAND_PHASES})
        blob = repr(sorted((k, {n: c.key() for n, c in v.items()}) for k, v in curves.items()))
        blob += repr((host.activation.latency_s, host.activation.bytes_per_s, host.kv.latency_s, host.kv.bytes_per_s))
        self.version = f"engine-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"

    def calibrated(self, *, frontend_extra_s: float | None = None, step_extra_s: float | None = None,
                   scale: Mapping[Phase, float] | None = None) -> EnginePerf:
        """A copy with these overheads and / or multipliers (the ones not given are this model's)."""
        return EnginePerf(self, self.curves, self.host,
                          frontend_extra_s=self.frontend_extra_s if frontend_extra_s is None else frontend_extra_s,
                          step_extra_s=self.step_extra_s if step_extra_s is None else step_extra_s,
                          scale=self.scale if scale is None else scale)

    @property
    def frontend_s(self) -> float:
        """Submit (coordinator → scheduler) and the first TokenOut back: added to the simulated TTFT."""
        return 2 * self.host.activation.latency_s + self.frontend_extra_s

    def _curve(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> tuple[dict[str, _BatchCurve] | None, float]:
        c = self.curves.get((config.name, model.name, shape.phase.value))
        x = shape.prompt_tokens if shape.phase is Phase.PREFILL else shape.mean_context
        return c, x

    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:  # noqa: D102
        c, x = self._curve(config, model, shape)
        if c is None:
            return super().layer_time_s(config, model, shape)
        return c["layer_ms"](x, shape.batch) * 1e-3 * self.scale[shape.phase]

    def stage_extra_s(self, config: NodeConfig, model: ModelSpec, shape: Shape, *, first: bool, last: bool) -> float:  # noqa: D102
        c, x = self._curve(config, model, shape)
        if c is None:
            return super().stage_extra_s(config, model, shape, first=first, last=last)
        cols = ["call_ms"] + (["first_ms"] if first else []) + (["last_ms"] if last else [])
        ms = sum(c[k](x, shape.batch) for k in cols)
        hops = (1 if first else 0) + (1 if last else 0)
        step = self.step_extra_s if (first and shape.phase is Phase.DECODE) else 0.0
        return (ms * 1e-3 + hops * self.host.activation.latency_s + step) * self.scale[shape.phase]

    def transfer_s(self, model: ModelSpec, shape: Shape, src: NodeConfig, dst: NodeConfig) -> float:  # noqa: D102
        return self.host.activation.time_s(shape.tokens * model.hidden_size * self.act_bytes)

    def kv_transfer_s(self, model: ModelSpec, prompt_tokens: float, src: NodeConfig, dst: NodeConfig) -> float:  # noqa: D102
        nbytes = prompt_tokens * model.num_layers * 2 * model.num_kv_heads * model.head_dim * self.act_bytes
        return 3 * self.host.activation.latency_s + self.host.kv.time_s(nbytes)


class _BatchCurve:
    """Milliseconds of one batched pass as a function of (length, batch): piecewise-linear in both."""

    def __init__(self, xs: np.ndarray, per_x: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.xs = xs
        self.per_x = per_x  # for each length: (batch sizes ascending, ms)

    def key(self) -> tuple[list[float], list[tuple[list[float], list[float]]]]:
        """The curve's numbers (for the model version hash)."""
        return self.xs.tolist(), [(b.tolist(), m.tolist()) for b, m in self.per_x]

    @staticmethod
    def _in_b(bs: np.ndarray, ms: np.ndarray, b: float) -> float:
        if len(bs) == 1:
            return float(ms[0] * b / bs[0])  # one batch size profiled: proportional
        if b <= bs[-1]:
            if b < bs[0]:
                return float(max(ms[0] + (ms[1] - ms[0]) / (bs[1] - bs[0]) * (b - bs[0]), 0.0))
            return float(np.interp(b, bs, ms))
        slope = (ms[-1] - ms[-2]) / (bs[-1] - bs[-2])
        return float(ms[-1] + max(slope, 0.0) * (b - bs[-1]))

    def __call__(self, x: float, b: float) -> float:
        ys = np.array([self._in_b(bs, ms, b) for bs, ms in self.per_x])
        return _Curve(self.xs, ys)(x)


def curves_from_csv(path: Path) -> dict[tuple[str, str, str], dict[str, _BatchCurve]]:
    """The batched-pass curves of a `coral profile` CSV: (config, model, phase) -> column -> curve.

    Raises:
        CoralError: a CSV without the engine's columns, or a row that is not numbers.
    """
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
        curves = {}
        for j, name in enumerate(cols):
            per_x = []
            for x in xs:
                arr = np.array(sorted(pts[x]))  # rows (batch, *cols) sorted by batch
                bs, idx = np.unique(arr[:, 0], return_index=True)  # a repeated batch size keeps its first row
                per_x.append((bs, arr[idx, 1 + j]))
            curves[name] = _BatchCurve(xs, per_x)
        out[key] = curves
    return out


def load_engine_perf(csv_path: str | Path, catalog: Catalog, fallback: PerfModel | None = None) -> EnginePerf:
    """Read a `coral profile` CSV and its `<csv>.host.json` as an `EnginePerf`.

    Raises:
        CoralError: a missing file or a CSV without the engine columns.
    """
    p = Path(csv_path)
    base = load_profile_csv(p, catalog, fallback=fallback)
    return EnginePerf(base, curves_from_csv(p), read_host(p))
