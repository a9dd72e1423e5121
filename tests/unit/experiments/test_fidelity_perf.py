"""The fidelity engine model (`fidelity_perf`): measured batched passes, interpolated in batch and length."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from coral.errors import CoralError
from coral.experiments.fidelity_perf import curves_from_csv
from coral.experiments.fidelity_report import taken_steps

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
    c = curves_from_csv(p)[("1xL4", "m", "decode")]
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
        curves_from_csv(bad)


def test_taken_steps_cap_the_others_at_a_fair_share() -> None:
    # windows of 0.5 s on 2 cores, the runtime counted as 2 threads: others used 1.9 cores with 10
    # runnable threads (cap 2 * 10 / 12 = 1.667), 1.5 with 2 threads (cap 2 * 2 / 4 = 1.0),
    # 0.3 with 1 thread (cap 0.667: kept), 0.2 with none sampled (cap 0)
    meter = SimpleNamespace(taken=[(0.0, 1.9), (0.5, 1.5), (1.0, 0.3), (1.5, 0.2)], window_s=0.5, background=1.0,
                            steps=[(0.1, 10.0), (0.3, 10.0), (0.6, 2.0), (0.9, 2.0), (1.2, 1.0), (1.7, 0.0)])
    got = taken_steps(meter, 10.0, 2, 2.0)
    assert [10.0, 10.5, 11.0, 11.5, 12.0] == [t for t, _ in got]
    assert [2 * 10 / 12, 1.0, 0.3, 0.0, 0.0] == pytest.approx([v for _, v in got])
    # against one runtime thread the neighbours keep more: 2 * 10 / 11, 2 * 2 / 3 = 1.333
    assert [2 * 10 / 11, 4 / 3, 0.3, 0.0, 0.0] == pytest.approx([v for _, v in taken_steps(meter, 10.0, 2, 1.0)])
    # a window with no sample uses the mean runnable threads (1 -> cap 2 * 1 / 3)
    one = SimpleNamespace(taken=[(0.0, 1.2)], window_s=0.5, background=1.0, steps=[])
    assert [(0.0, pytest.approx(2 / 3)), (0.5, 0.0)] == taken_steps(one, 0.0, 2, 2.0)
    assert [] == taken_steps(SimpleNamespace(taken=[], window_s=0.5, background=0.0, steps=[]), 0.0, 2, 2.0)
