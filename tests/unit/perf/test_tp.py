"""Tensor parallelism: the all-reduce link fits, the PCIe fit, and the TP speedup targets."""

import pytest

from coral.catalog import builtin_catalog, builtin_model
from coral.catalog.catalog import builtin_links, load_interconnects_csv
from coral.catalog.hardware import LINK_REF_BYTES, LinkFit
from coral.errors import CoralError
from coral.perf import Efficiency, Phase, RooflinePerf, Shape
from coral.perf.calibrate import (
    MIB,
    VIDUR_NODES,
    allreduce_errors,
    calibrate,
    fit_allreduce,
    fit_pcie,
    helix_speedups,
    intra_node_curves,
    load_helix_profiles,
    load_vidur_network,
    send_check,
    single_gpu_efficiency,
    summarize,
    summarize_speedups,
    vidur_speedups,
)

CAT = builtin_catalog()
LLAMA2 = builtin_model("llama-2-70b")


def test_linkfit_hand_computed():
    fit = LinkFit(interconnect="x", gpus=4, floor_s=50e-6, latency_s=10e-6, bus_gb_per_s=100.0, size_exponent=1.0)
    # ring 2*3/4 = 1.5; 32 MiB: 10 µs + 1.5 * 33,554,432 / 100e9 = 10 µs + 503.3 µs
    assert fit.allreduce_s(LINK_REF_BYTES) == pytest.approx(10e-6 + 1.5 * LINK_REF_BYTES / 100e9)
    assert fit.allreduce_s(1024) == pytest.approx(50e-6)  # below the floor
    half = LinkFit(interconnect="x", gpus=2, floor_s=0.0, latency_s=0.0, bus_gb_per_s=100.0, size_exponent=0.5)
    # (s/R)^0.5 with s = R/4: half the 32 MiB time
    assert half.allreduce_s(LINK_REF_BYTES / 4) == pytest.approx(0.5 * LINK_REF_BYTES / 100e9)
    with pytest.raises(ValueError, match="bus_gb_per_s must be > 0"):
        LinkFit(interconnect="x", gpus=2, floor_s=0, latency_s=0, bus_gb_per_s=0)


def test_interconnects_csv_errors():
    head = "interconnect,gpus,floor_us,latency_us,bus_gb_per_s,size_exponent,source\n"
    with pytest.raises(CoralError, match="row 2: column 'gpus' is 'two'"):
        load_interconnects_csv(head + "pcie,two,1,1,5,1,x\n")
    with pytest.raises(CoralError, match="row 3: pcie x2 is listed twice"):
        load_interconnects_csv(head + "pcie,2,1,1,5,1,x\npcie,2,1,1,5,1,x\n")
    with pytest.raises(CoralError, match="row 2: column 'bus_gb_per_s' is empty"):
        load_interconnects_csv(head + "pcie,2,1,1,,1,x\n")


def test_every_gpu_has_a_link_fit():
    links = builtin_links()
    for gpu in CAT.gpus.values():
        assert {n for ic, n in links if ic == gpu.interconnect} >= {2, 4, 8}, gpu.name


def test_tp_uses_the_measured_link_and_replicates_elementwise_work():
    perf = RooflinePerf()
    shape = Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=2000, output_tokens=0)
    cfg = CAT.config("2xL4")
    nbytes = 2000 * LLAMA2.hidden_size * 2.0
    assert perf.tp_time_s(cfg, LLAMA2, shape) == pytest.approx(2 * builtin_links()[("pcie", 2)].allreduce_s(nbytes))
    # An ideal link (no all-reduce cost) still leaves the norms and residual adds unsplit: speedup < 2
    ideal = RooflinePerf(links={("pcie", 2): LinkFit(interconnect="pcie", gpus=2, floor_s=0, latency_s=0, bus_gb_per_s=1e9)})
    one, two = ideal.layer_time_s(CAT.config("1xL4"), LLAMA2, shape), ideal.layer_time_s(cfg, LLAMA2, shape)
    e = ideal.eff(cfg)
    elementwise = 7 * 2000 * LLAMA2.hidden_size * 2.0 / (CAT.gpu("L4").hbm_gb_per_s * 1e9 * e.bandwidth)
    assert one - elementwise == pytest.approx(2 * (two - elementwise - e.layer_overhead_s) + e.layer_overhead_s, rel=1e-6)


@pytest.fixture(scope="module")
def vidur(data_dir):
    return data_dir / "profiles" / "vidur"


@pytest.fixture(scope="module")
def helix_points(data_dir):
    return load_helix_profiles(data_dir / "profiles" / "helix_llama2_70b", CAT)


def test_allreduce_fit_meets_target_and_is_shipped(vidur):
    curves = intra_node_curves(load_vidur_network(vidur))
    assert {(c.node, c.gpus) for c in curves} == {(n, g) for n in VIDUR_NODES for g in (2, 4, 8)}
    shipped = builtin_links()
    worst = []
    for c in curves:
        fit = fit_allreduce(c, VIDUR_NODES[c.node])
        ship = shipped[(fit.interconnect, fit.gpus)]
        assert ship.bus_gb_per_s == pytest.approx(fit.bus_gb_per_s, rel=0.01)  # the CSV is this fit
        assert ship.size_exponent == pytest.approx(fit.size_exponent, abs=0.01)
        errs = allreduce_errors(ship, c)
        assert errs["median_raw_abs_error"] <= 0.05
        worst.append(errs["worst_binned_abs_error"])
    # Within 15 % at every size 1-64 MiB on 5 of the 6 curves; 8xA100 misses at 1 MiB (16.7 %), where
    # Vidur's own medians are non-monotone (0.040 ms at 1 MiB, 0.071 ms at 1.25 MiB).
    assert sum(w <= 0.15 for w in worst) >= 5 and max(worst) <= 0.17


def test_nominal_bandwidth_was_the_bias(vidur):
    # The measured bus bandwidth at 32 MiB is well below the NVLink datasheet figure (900 / 600 GB/s)
    links = builtin_links()
    assert all(links[("nvlink4", n)].bus_gb_per_s < 0.45 * 900 for n in (2, 4, 8))
    assert all(links[("nvlink3", n)].bus_gb_per_s < 0.3 * 600 for n in (2, 4, 8))


def test_pcie_fit_is_shipped(helix_points):
    eff = single_gpu_efficiency(LLAMA2, helix_points)
    fits = fit_pcie(LLAMA2, helix_points, eff)
    assert sorted(fits) == [2, 4]
    for n, fit in fits.items():
        ship = builtin_links()[("pcie", n)]
        assert ship.bus_gb_per_s == pytest.approx(fit.bus_gb_per_s, rel=0.02)
        assert ship.latency_s == pytest.approx(fit.latency_s, rel=0.05)


def test_tp_speedup_targets(helix_points, vidur):
    perf = RooflinePerf()
    rows = helix_speedups(LLAMA2, helix_points, perf) + vidur_speedups(vidur, LLAMA2, CAT, perf)
    assert len(rows) == 19  # 3 Helix nodes x (3 prefill + 2 decode) + 4 Vidur whole layers
    s = summarize_speedups(rows)
    assert s["median_abs_error"] <= 0.10 and s["worst_abs_error"] <= 0.20  # the targets, in-sample
    # Leave-one-node-out meets the median but not the worst: 4xT4 predicted from the 2-GPU fit alone
    assert s["loo_median_abs_error"] <= 0.10
    worst = max(rows, key=lambda r: abs(r.loo_error))
    assert worst.config == "4xT4" and worst.loo_error > 0.20


def test_single_gpu_error_stays_within_target(helix_points):
    _, rows = calibrate(LLAMA2, helix_points)
    s = summarize(rows)
    assert s["single_gpu_median_abs_error"] <= 0.20
    assert s["median_abs_error"] <= 0.20  # multi-GPU nodes included


def test_send_check_numbers(vidur):
    perf = RooflinePerf()
    rows = send_check(vidur, perf, CAT)
    r = next(r for r in rows if r["node"] == "h100_dgx" and r["size_mib"] == 32)
    cfg = CAT.config("8xH100")
    assert r["model_ms"] == pytest.approx((32 * MIB / cfg.network_bytes_per_s + perf.system.network_latency_s) * 1e3)
    assert 25 < r["measured_gb_per_s"] < 50  # one 400 Gbps NIC's worth, not the node's aggregate


def test_unfitted_interconnect_falls_back_to_nominal_ring():
    perf = RooflinePerf(efficiency={"L4": Efficiency(flops=1, bandwidth=1, layer_overhead_s=0)}, links={})
    shape = Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=1000, output_tokens=0)
    nbytes = 1000 * LLAMA2.hidden_size * 2.0
    assert perf.tp_time_s(CAT.config("4xL4"), LLAMA2, shape) == pytest.approx(2 * 1.5 * nbytes / 64e9)


def test_version_follows_the_links():
    base = RooflinePerf()
    assert base.version.startswith("roofline-2+links-") and base.version == RooflinePerf().version
    other = dict(builtin_links())
    f = other[("pcie", 2)]
    other[("pcie", 2)] = LinkFit(interconnect="pcie", gpus=2, floor_s=f.floor_s, latency_s=f.latency_s,
                                 bus_gb_per_s=2 * f.bus_gb_per_s)
    assert RooflinePerf(links=other).version != base.version  # a template cache keyed by it goes stale
