"""The fidelity engine model's per-micro-batch cost fit (`fidelity_perf`): fixed + b x per request."""
from __future__ import annotations

import numpy as np
import pytest

from coral.errors import CoralError
from coral.experiments.fidelity_perf import _curves_from_csv, _fit_batch

HEADER = "config,model,phase,tokens,layer_ms,batch,context,call_ms,first_ms,last_ms\n"


def test_fit_separates_the_cold_first_request() -> None:
    # 1.5 ms alone, 3.0 ms for 4: fixed + b*per -> per = (3.0 - 1.5) / 3 = 0.5, fixed = 1.0.
    fixed, per = _fit_batch(np.array([1.0, 4.0]), np.array([1.5, 3.0]))
    assert fixed == pytest.approx(1.0) and per == pytest.approx(0.5)


def test_fit_falls_back_to_per_request_mean() -> None:
    # a negative intercept (0.6 alone, 2.8 for 4) is noise: all per request, mean(0.6/1, 2.8/4) = 0.65
    assert (0.0, pytest.approx(0.65)) == _fit_batch(np.array([1.0, 4.0]), np.array([0.6, 2.8]))
    # one batch size: per request
    assert (0.0, pytest.approx(0.5)) == _fit_batch(np.array([2.0, 2.0]), np.array([1.0, 1.0]))


def test_curves_from_csv_fit_by_context(tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "prof.csv"
    p.write_text(HEADER + "".join([
        "1xL4,m,decode,1,0.5,1,32,1.5,0.0,0.2\n",
        "1xL4,m,decode,4,2.0,4,32,3.0,0.0,0.8\n",
        "1xL4,m,decode,1,1.0,1,64,1.5,0.0,0.2\n",
        "1xL4,m,decode,4,4.0,4,64,3.0,0.0,0.8\n",
    ]))
    c = _curves_from_csv(p)[("1xL4", "m", "decode")]
    assert c["call_ms0"](48) == pytest.approx(1.0) and c["call_ms"](48) == pytest.approx(0.5)
    # layer: linear in b with no fixed part; per request interpolated between the contexts
    assert c["layer_ms0"](48) == pytest.approx(0.0) and c["layer_ms"](48) == pytest.approx(0.75)
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "1xL4,m,decode,1,0.5,0,32,1.5,0.0,0.2\n")
    with pytest.raises(CoralError, match="batch > 0"):
        _curves_from_csv(bad)
