"""The fidelity engine model (`fidelity_perf`): measured batched passes, interpolated in batch and length."""
from __future__ import annotations

import pytest

from coral.errors import CoralError
from coral.experiments.fidelity_perf import _curves_from_csv

HEADER = "config,model,phase,tokens,layer_ms,batch,context,call_ms,first_ms,last_ms\n"


def test_curves_interpolate_batched_passes(tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "prof.csv"
    p.write_text(HEADER + "".join([
        "1xL4,m,decode,1,0.5,1,32,1.5,0.0,0.2\n",
        "1xL4,m,decode,4,2.0,4,32,3.0,0.0,0.8\n",
        "1xL4,m,decode,8,2.4,8,32,3.4,0.0,1.0\n",
        "1xL4,m,decode,1,1.0,1,64,1.5,0.0,0.2\n",
        "1xL4,m,decode,4,4.0,4,64,3.0,0.0,0.8\n",
        "1xL4,m,decode,8,4.4,8,64,3.4,0.0,1.0\n",
    ]))
    c = _curves_from_csv(p)[("1xL4", "m", "decode")]
    # measured points come back exactly
    assert c["layer_ms"](32, 4) == pytest.approx(2.0) and c["call_ms"](64, 8) == pytest.approx(3.4)
    # between batch sizes: 0.5 + (2.0 - 0.5) * (2 - 1) / 3 = 1.0 at length 32; 2.0 at 64; 1.5 at 48
    assert c["layer_ms"](48, 2) == pytest.approx(1.5)
    # a batched pass is not b x one request: 8 requests cost 2.4 ms, not 8 x 0.5
    assert c["layer_ms"](32, 8) == pytest.approx(2.4)
    # beyond the largest batch: along the last segment, (2.4 - 2.0) / 4 = 0.1 ms per extra request
    assert c["layer_ms"](32, 12) == pytest.approx(2.8)
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "1xL4,m,decode,1,0.5,0,32,1.5,0.0,0.2\n")
    with pytest.raises(CoralError, match="batch > 0"):
        _curves_from_csv(bad)
