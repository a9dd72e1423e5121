"""The chaos soak's short forms (bench/chaos_bench.py, 10 minutes in `make bench`): `coral bench` against
`coral serve` while a random engine is killed every few seconds; nobody touches the server. `make test`
runs 36 s with a kill every 12 s, `make test-long` the 60-s form with a kill every 20 s: two kills each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import chaos_bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("duration_s", "kill_every_s"), [
    (36.0, 12.0),
    pytest.param(60.0, 20.0, marks=pytest.mark.long(reduced="its 36-s form, a kill every 12 s")),
])
def test_chaos_soak_loses_and_cuts_nothing_and_every_model_comes_back(tmp_path: Path, duration_s: float,
                                                                      kill_every_s: float) -> None:
    r = chaos_bench.soak(duration_s, kill_every_s, rate_per_s=3.0, workdir=tmp_path)
    assert 2 <= len(r["kills"]), r
    assert r["sent"] > duration_s * 3.0  # half the 2 x 3 req/s offered over the soak
    assert 0 == r["cut"], r["lost"]
    assert r["sent"] == r["completed"] + r["refused"], r["lost"]  # every failure is a refusal with an error
    # every kill was followed by every model's /health back at ok, with no hand action (the soak watches 60 s)
    assert all(k["back_to_ok_s"] is not None for k in r["kills"]), r["kills"]
    assert 0 == r["serve_exit"], r["serve_log_tail"]
