"""The fidelity study's phases on a stand-in runtime: deterministic replays, meters and overheads instead
of `coral serve`, a recorded profile of the engine, and the real simulator. The reduced form of
`coral experiment fidelity` for `make test` (the real one is tests/integration/test_fidelity.py):
every phase hands the next its values, the perf objects are built once and never changed, and the
outputs are written whole."""
from __future__ import annotations

import itertools
import json
import shutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import coral.experiments.fidelity as fid
from coral.experiments.fidelity_runtime import RealRequest
from coral.perf import Phase

DATA = Path(__file__).with_name("data")


def _replay(url: str, model: str, arrival_s: Any, prompt_tokens: Any, output_tokens: Any, *, vocab_size: int,
            seed: int = 0, timeout_s: float = 300.0) -> list[RealRequest]:
    """A runtime that answers every request: TTFT grows with the prompt, TPOT is about 3 ms."""
    out = []
    for i, (a, p, d) in enumerate(zip(arrival_s, prompt_tokens, output_tokens, strict=True)):
        r = RealRequest(index=i, arrival_s=float(a), prompt_tokens=int(p), output_tokens=int(d))
        r.sent_s = float(a)
        r.first_s = r.sent_s + 0.004 + 2e-5 * p + 1e-4 * ((7 * i + seed) % 5)
        r.received = int(d)
        r.last_s = r.first_s + (d - 1) * (0.003 + 1e-4 * ((i + seed) % 3))
        out.append(r)
    return out


class _Served:
    def __init__(self, cluster: dict[str, Any], out: Path, step_trace_dir: Path | None = None) -> None:
        self.url, self.proc = "http://stand-in", types.SimpleNamespace(pid=1)

    def __enter__(self) -> _Served:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Meter:
    count = itertools.count()

    def __init__(self) -> None:
        k = next(self.count)
        self.ours_cores, self.others_cores, self.background, self.ours_wait_share = 1.2 + 0.1 * k, 0.3, 0.25, 0.1
        self.samples, self.window_s = 10, 0.5
        self.taken = [(0.5 * j, 0.2 + 0.05 * ((j + k) % 3)) for j in range(40)]
        self.steps = [(0.5 * j, 0.1 * ((j + k) % 4)) for j in range(40)]

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture()
def stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> fid.FidelityOptions:
    cpu = itertools.count()
    monkeypatch.setattr(fid, "replay", _replay)
    monkeypatch.setattr(fid, "Served", _Served)
    monkeypatch.setattr(fid, "CpuMeter", _Meter)
    monkeypatch.setattr(fid, "proc_cpu_s", lambda pid: 0.37 * next(cpu))
    monkeypatch.setattr(fid, "runtime_overhead", lambda cluster: (0.006, 0.0025))
    profile = tmp_path / "profile.csv"
    shutil.copy(DATA / "fid-llama-1xL4.csv", profile)
    shutil.copy(DATA / "fid-llama-1xL4.csv.host.json", tmp_path / "profile.csv.host.json")
    return fid.FidelityOptions(out=tmp_path / "fid", profile=profile, quick=True, repeat=True, **fid.QUICK)


def test_each_phase_hands_the_next_its_values_and_no_perf_object_changes(stand_in: fid.FidelityOptions) -> None:
    say: list[str] = []
    stand_in.out.mkdir(parents=True)
    setup = fid.calibrate_host(stand_in, say.append)
    # the runtime's overheads, measured once, are in the engine's perf from the start: 6 ms TTFT and
    # 2.5 ms TPOT of the no-maths runtime, less the messages the perf model already counts
    assert setup.engine.frontend_extra_s > 0 and setup.engine.step_extra_s > 0
    assert {Phase.PREFILL: 1.0, Phase.DECODE: 1.0} == dict(setup.engine.scale)
    real = fid.replay_runtime(setup, stand_in, say.append)
    assert len(setup.trace) == len(real.recs) == len(real.recs2 or [])
    assert 2 * len(real.cal) == len(real.cal_recs) == len(real.cal_group)
    bench = fid.SimBench.of(setup, real, stand_in)
    fit = fid.fit_engine(bench, real, say.append)
    assert fit.perf is not setup.engine
    assert {Phase.PREFILL: 1.0, Phase.DECODE: 1.0} == dict(setup.engine.scale)  # the fit made a new one
    assert (fit.calibration["prefill_scale"], fit.calibration["decode_scale"]) == (fit.perf.scale[Phase.PREFILL],
                                                                                  fit.perf.scale[Phase.DECODE])
    assert all(0.5 <= v <= 3.0 for v in fit.perf.scale.values())
    with pytest.raises(TypeError):
        fit.perf.scale[Phase.PREFILL] = 2.0  # type: ignore[index]
    sims, steps = fid.simulate_variants(bench, real, fit)
    assert {"engine", "table", "independent", "no_taken", "with_background", "scale_1", "uncalibrated",
            "taken_vs_one_thread"} == set(sims)
    assert steps and all(len(s) == 7 for s in steps)
    for label, (_, ttft, tpot) in sims.items():
        assert (len(setup.trace),) == ttft.shape == tpot.shape, label
        assert np.isfinite(ttft).all() and (ttft > 0).all(), label
    summary = fid.summarize(stand_in, setup, real, bench, fit, sims, steps, (1.0, 1.0, 1.0))
    req = summary["requests"]
    assert req["trace"] == req["real_finished"] == req["sim_finished"] == req["matched"] == len(setup.trace)
    assert summary["repeatability"] is not None and summary["repeatability"]["requests"] == len(setup.trace)
    assert any(line.startswith("calibration: node time x") for line in say)


def test_run_fidelity_writes_every_output_whole(stand_in: fid.FidelityOptions) -> None:
    s = fid.run_fidelity(stand_in)
    out = stand_in.out
    names = sorted(p.name for p in out.iterdir())
    assert ["calibration.csv", "fidelity_cdf.png", "host_load.json", "model", "report.md", "requests.csv", "summary.json"] == names
    assert not list(out.rglob("*.tmp*"))  # nothing half-written left behind
    assert json.loads((out / "summary.json").read_text())["ttft"]["mape"] == pytest.approx(s["ttft"]["mape"])
    assert (out / "fidelity_cdf.png").read_bytes().startswith(b"\x89PNG")
    rows = (out / "requests.csv").read_text().splitlines()
    assert s["requests"]["trace"] + 1 == len(rows) and rows[0].startswith("index,arrival_s,")
    assert ["calibration_before", "trace", "calibration_after"] == list(json.loads((out / "host_load.json").read_text()))
    assert (out / "report.md").read_text().startswith("# Simulator fidelity: fid-llama (quick)")
