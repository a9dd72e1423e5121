"""Profile-table backend: measured per-layer latencies, interpolated (DESIGN §2).

CSV columns: `config,model,phase,tokens,layer_ms` and optionally `context` (decode's mean
context; ignored when absent). `tokens` is tokens per micro-batch: `b·P` for prefill, `b` for
decode. Between measured points the time is interpolated linearly in tokens; beyond the last
point it is extrapolated linearly from the last two, never downwards (a noisy profile whose last
point is below the one before would otherwise give negative times for large batches). Keys without a table fall back to the
roofline (or raise when `fallback=None`).
"""
from __future__ import annotations

import csv
import hashlib
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.perf.model import PerfModel, Phase, Shape, SystemParams
from coral.perf.roofline import RooflinePerf

PROFILE_COLUMNS = ("config", "model", "phase", "tokens", "layer_ms")


class ProfilePerf(PerfModel):
    """Per-layer latency from measurements, keyed by `(config, model, phase)`."""

    def __init__(self, table: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]],
                 fallback: PerfModel | None = None, system: SystemParams | None = None) -> None:
        super().__init__(system or (fallback.system if fallback else None))
        self.table = table
        self.fallback = fallback
        blob = repr(sorted((k, v[0].tolist(), v[1].tolist()) for k, v in table.items())).encode()
        digest = hashlib.sha256(blob).hexdigest()[:16]
        self.version = f"profile-{digest}+{fallback.version if fallback else 'none'}"

    def _eta_f(self, config: NodeConfig) -> float:
        return self.fallback._eta_f(config) if self.fallback else super()._eta_f(config)

    def _eta_b(self, config: NodeConfig) -> float:
        return self.fallback._eta_b(config) if self.fallback else super()._eta_b(config)

    def has(self, config: NodeConfig, model: ModelSpec, phase: Phase) -> bool:
        return (config.name, model.name, phase.value) in self.table

    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        key = (config.name, model.name, shape.phase.value)
        if key not in self.table:
            if self.fallback is None:
                raise CoralError(f"no profile for {config.name} / {model.name} / {shape.phase.value} and no fallback")
            return self.fallback.layer_time_s(config, model, shape)
        xs, ys = self.table[key]
        x = shape.tokens
        if x <= xs[-1]:
            return float(np.interp(x, xs, ys)) * 1e-3
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
        return float(ys[-1] + max(slope, 0.0) * (x - xs[-1])) * 1e-3


def _table_from_rows(rows: Iterable[tuple[str, str, str, float, float]]) -> dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]]:
    grouped: dict[tuple[str, str, str], dict[float, float]] = {}
    for config, model, phase, tokens, ms in rows:
        grouped.setdefault((config, model, phase), {})[tokens] = ms
    table = {}
    for key, pts in grouped.items():
        xs = np.array(sorted(pts))
        ys = np.array([pts[x] for x in xs])
        if xs[0] > 0:  # an empty batch costs nothing: anchor interpolation at the origin
            xs, ys = np.concatenate([[0.0], xs]), np.concatenate([[0.0], ys])
        table[key] = (xs, ys)
    return table


def load_profile_csv(path: str | Path, catalog: Catalog, fallback: PerfModel | None = None) -> ProfilePerf:
    """Load our profile CSV (see module docstring).

    Raises:
        CoralError: missing file or columns, unknown configuration, bad phase or numbers (naming the row).
    """
    p = Path(path)
    if not p.exists():
        raise CoralError(f"profile file {p} does not exist")
    reader = csv.DictReader(io.StringIO(p.read_text()))
    missing = [c for c in PROFILE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise CoralError(f"profile file {p}: missing columns {missing}; expected {', '.join(PROFILE_COLUMNS)}")
    rows = []
    for i, row in enumerate(reader, start=2):
        phase = row["phase"].strip()
        if phase not in ("prefill", "decode"):
            raise CoralError(f"profile file {p} row {i}: phase {phase!r} must be 'prefill' or 'decode'")
        try:
            tokens, ms = float(row["tokens"]), float(row["layer_ms"])
        except ValueError:
            raise CoralError(f"profile file {p} row {i}: tokens and layer_ms must be numbers") from None
        if not (tokens >= 0 and ms >= 0) or tokens != tokens or ms != ms:
            raise CoralError(f"profile file {p} row {i}: tokens and layer_ms must be finite and >= 0")
        rows.append((catalog.config(row["config"].strip()).name, row["model"].strip(), phase, tokens, ms))
    return ProfilePerf(_table_from_rows(rows), fallback=fallback)


# --- Helix's per-layer profiles --------------------------------------------------------------------

HELIX_DECODE_CONTEXT = 1024.0
_HELIX_FILE = re.compile(r"^([a-z0-9]+?)(?:x(\d+))?_(prompt|decode)_bs2time\.csv$")
_HELIX_GPU = {"a100": "A100-40GB", "v100": "V100-16GB", "l4": "L4", "t4": "T4"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One Helix point: ms per decoder layer for `tokens` (prompt tokens, or the decode batch) on `config`."""

    config: NodeConfig
    phase: Phase
    tokens: int
    layer_ms: float

    @property
    def shape(self) -> Shape:
        if self.phase is Phase.PREFILL:
            return Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=self.tokens, output_tokens=0)
        return Shape(phase=Phase.DECODE, batch=self.tokens, prompt_tokens=HELIX_DECODE_CONTEXT, output_tokens=0)

    @property
    def counted(self) -> bool:
        """The points the accuracy target is stated on: >= 250 prompt tokens or decode batch >= 8."""
        return self.tokens >= 250 if self.phase is Phase.PREFILL else self.tokens >= 8


def load_helix_profiles(folder: str | Path, catalog: Catalog) -> list[Measurement]:
    """Read every Helix `*_bs2time.csv` in `folder` (rows with 0 tokens are skipped)."""
    root = Path(folder)
    if not root.is_dir():
        raise CoralError(f"profile folder {root} does not exist; pass the folder holding Helix's *_bs2time.csv files")
    out: list[Measurement] = []
    for path in sorted(root.glob("*_bs2time.csv")):
        match = _HELIX_FILE.match(path.name)
        if not match or match.group(1) not in _HELIX_GPU:
            continue
        gpu, count, phase = _HELIX_GPU[match.group(1)], int(match.group(2) or 1), match.group(3)
        config = catalog.config(f"{count}x{gpu}")
        for row in csv.reader(path.read_text().splitlines()):
            if len(row) < 2 or not row[0].strip():
                continue
            tokens, ms = int(float(row[0])), float(row[1])
            if tokens > 0 and ms > 0:
                out.append(Measurement(config=config, phase=Phase.PREFILL if phase == "prompt" else Phase.DECODE,
                                       tokens=tokens, layer_ms=ms))
    if not out:
        raise CoralError(f"no Helix profile files (<gpu>[x<n>]_<prompt|decode>_bs2time.csv) in {root}")
    return out


def profile_from_helix(folder: str | Path, catalog: Catalog, model: str = "llama-2-70b",
                       fallback: PerfModel | None = None) -> ProfilePerf:
    """Helix's `<gpu>[x<n>]_{prompt,decode}_bs2time.csv` files as a profile table for `model`."""
    rows = [(m.config.name, model, m.phase.value, float(m.tokens), m.layer_ms)
            for m in load_helix_profiles(folder, catalog)]
    return ProfilePerf(_table_from_rows(rows), fallback=fallback or RooflinePerf())
