"""The chaos soak's 60-s form (bench/chaos_bench.py, 10 minutes in `make bench`): `coral bench` against
`coral serve` while a random engine is killed every 20 s; nobody touches the server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import chaos_bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chaos_soak_loses_and_cuts_nothing_and_every_model_comes_back(tmp_path: Path) -> None:
    r = chaos_bench.soak(60.0, 20.0, rate_per_s=3.0, workdir=tmp_path)
    assert 2 <= len(r["kills"]), r
    assert r["sent"] > 100
    assert 0 == r["cut"], r["lost"]
    assert r["sent"] == r["completed"] + r["refused"], r["lost"]  # every failure is a refusal with an error
    # every kill was followed by every model's /health back at ok, with no hand action (the soak watches 60 s)
    assert all(k["back_to_ok_s"] is not None for k in r["kills"]), r["kills"]
    assert 0 == r["serve_exit"], r["serve_log_tail"]
