"""Tensor parallelism: the all-reduce link fits (measured NCCL per GPU, the Helix PCIe fit), their
held-out checks (Vidur's DGX curves, Helix with the L40S link), and the TP speedup targets."""

from dataclasses import replace

import pytest

from coral.catalog import builtin_catalog, builtin_model
from coral.catalog.catalog import builtin_links, load_interconnects_csv
from coral.catalog.hardware import LINK_REF_BYTES, LinkFit
from coral.errors import CoralError
from coral.perf import Efficiency, Phase, RooflinePerf, Shape
from coral.perf.calibrate import (
    PCIE_HELIX,
    calibrate,
    fit_pcie,
    helix_heldout,
    helix_speedups,
    link_table,
    single_gpu_efficiency,
    summarize,
    summarize_speedups,
    vidur_speedups,
)
from coral.perf.collectives import (
    AIC_FILE,
    AIC_SYSTEMS,
    LINK_FIT_SIZES,
    MIB,
    VIDUR_HELDOUT_SIZES,
    VIDUR_NODES,
    allreduce_errors,
    fit_allreduce,
    intra_node_curves,
    load_nccl_allreduce,
    load_vidur_network,
    measured_links,
    send_check,
)
from coral.perf.profile import load_helix_profiles

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
    assert perf.tp_time_s(cfg, LLAMA2, shape) == pytest.approx(2 * builtin_links()[(PCIE_HELIX, 2)].allreduce_s(nbytes))
    # An ideal link (no all-reduce cost) still leaves the norms and residual adds unsplit: speedup < 2
    ideal = RooflinePerf(links={(PCIE_HELIX, 2): LinkFit(interconnect=PCIE_HELIX, gpus=2, floor_s=0, latency_s=0,
                                                         bus_gb_per_s=1e9)})
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


@pytest.fixture(scope="module")
def nccl(data_dir):
    return data_dir / "profiles" / AIC_FILE


def test_nccl_data_is_the_wheels_measurements(nccl):
    curves = {(c.node, c.gpus): c for c in load_nccl_allreduce(nccl)}
    assert {(s, n) for s in AIC_SYSTEMS for n in (2, 4, 8)} <= set(curves)
    for c in curves.values():
        assert c.source.startswith(f"aiconfigurator-core==0.12.0:systems/data/{c.node}/comm/nccl/"), c.source
        assert c.sizes[0] == 512 and c.sizes[-1] >= 256 * MIB  # every power of two 512 B .. 256 MiB (or 512)
    # The figures: bus bandwidth 2(n-1)/n * 32 MiB / t on the 8xL40S PCIe host, 19.9 / 5.1 / 1.5 GB/s
    bus = {n: 2 * (n - 1) / n * 32 * MIB / (curves[("l40s", n)].binned_ms((32 * MIB,))[0] * 1e-3) / 1e9
           for n in (2, 4, 8)}
    assert [round(bus[n], 1) for n in (2, 4, 8)] == [19.9, 5.1, 1.5]


def test_every_shipped_row_is_the_fit(nccl, data_dir):
    # interconnects.csv is what tools/fit_links.py writes from the public data (up to SciPy's last digit).
    # A floor at or below the latency never binds (t >= latency), so the optimiser may leave it anywhere
    # there (SciPy 1.17 and earlier releases disagree on A100 x4): the floor compared is the one that acts.
    fits = link_table(nccl, data_dir / "profiles" / "helix_llama2_70b", CAT)
    shipped = builtin_links()
    assert list(fits) == list(shipped)
    for key, fit in fits.items():
        ship = shipped[key]
        assert ship.bus_gb_per_s == pytest.approx(fit.bus_gb_per_s, rel=0.01), key
        assert ship.size_exponent == pytest.approx(fit.size_exponent, abs=0.01), key
        assert ship.latency_s == pytest.approx(fit.latency_s, rel=0.05, abs=0.3e-6), key
        assert max(ship.floor_s, ship.latency_s) == pytest.approx(max(fit.floor_s, fit.latency_s), rel=0.05, abs=0.3e-6), key
        assert [ship.allreduce_s(s) for s in LINK_FIT_SIZES] == pytest.approx([fit.allreduce_s(s) for s in LINK_FIT_SIZES], rel=0.02), key
        assert ship.source == fit.source, key


def test_each_measured_gpu_uses_its_own_rows():
    own = {"L40S": "pcie-l40s", "A100-80GB": "nvlink-a100", "A100-40GB": "nvlink-a100", "H100": "nvlink-h100",
           "H200": "nvlink-h200", "B200": "nvlink-b200"}
    assert {g: CAT.gpu(g).interconnect for g in own} == own
    # no measured collective: L4, T4 (Helix layer speedups), A10G (assumed like them), V100 (scaled A100)
    assert {g: CAT.gpu(g).interconnect for g in ("L4", "T4", "A10G", "V100-16GB", "V100-32GB")} == {
        "L4": PCIE_HELIX, "T4": PCIE_HELIX, "A10G": PCIE_HELIX, "V100-16GB": "nvlink-v100", "V100-32GB": "nvlink-v100"}
    links = builtin_links()
    assert all(links[(ic, n)].source.startswith("fit: aiconfigurator-core") for ic in set(own.values()) for n in (2, 4, 8))
    assert links[(PCIE_HELIX, 8)].source.startswith("assumed:")
    assert all(links[("nvlink-v100", n)].source.startswith("unmeasured:") for n in (2, 4, 8))


def test_nccl_fit_errors_in_sample(nccl):
    # Fitted over 4 KiB - 256 MiB (one point per power of two). Measured: median |error| 2.6-12.6 % per
    # curve; worst 8-31 %, except 8xL40S at 1 MiB (+61.5 %), where the measured time jumps 3x between
    # 1 and 2 MiB (0.86 -> 2.62 ms) and no smooth curve follows it.
    fits = measured_links(nccl)
    worst = {}
    for c in load_nccl_allreduce(nccl):
        if c.node in AIC_SYSTEMS:
            errs = allreduce_errors(fits[(AIC_SYSTEMS[c.node], c.gpus)], c, LINK_FIT_SIZES)
            assert errs["median_binned_abs_error"] <= 0.13, (c.node, c.gpus)
            worst[(c.node, c.gpus)] = errs["worst_binned_abs_error"]
    assert max(w for k, w in worst.items() if k != ("l40s", 8)) <= 0.32
    assert 0.5 < worst[("l40s", 8)] <= 0.62
    # the measured 32 MiB bus bandwidth (19.9 / 5.1 / 1.5 GB/s on L40S) is what the fit says there, within 7 %
    l40s = {n: fits[("pcie-l40s", n)].bus_gb_per_s for n in (2, 4, 8)}
    assert l40s[2] == pytest.approx(19.9, rel=0.03) and l40s[4] == pytest.approx(5.1, rel=0.03)
    assert l40s[8] == pytest.approx(1.5, rel=0.07)


def test_vidur_dgx_curves_held_out(vidur):
    # The shipped A100 / H100 fits (aiconfigurator's measurements) against Vidur's DGX curves, which
    # no fit saw. From 8 MiB the worst error is 23.5 % (2xH100 at 16 MiB); bound 25 %. At 1 MiB the
    # fit is 1-65 % faster than Vidur on every curve: there Vidur measures 33-63 µs and aiconfigurator
    # 14-41 µs; the sources disagree below 8 MiB, so the bound is not stated there.
    curves = intra_node_curves(load_vidur_network(vidur))
    assert {(c.node, c.gpus) for c in curves} == {(n, g) for n in VIDUR_NODES for g in (2, 4, 8)}
    shipped = builtin_links()
    heldout, at_1mib = [], []
    for c in curves:
        ship = shipped[(VIDUR_NODES[c.node], c.gpus)]
        heldout.append(allreduce_errors(ship, c, VIDUR_HELDOUT_SIZES)["worst_binned_abs_error"])
        at_1mib.append(allreduce_errors(ship, c)["error_1mib"])
        # Vidur's own fit of the curve (the old shipped row) still meets the old in-sample target
        own = fit_allreduce(c, VIDUR_NODES[c.node])
        assert allreduce_errors(own, c)["median_raw_abs_error"] <= 0.05
    assert max(heldout) <= 0.25
    assert all(e < 0 for e in at_1mib)


def test_nominal_bandwidth_was_the_bias():
    # The measured bus bandwidth at 32 MiB is well below the NVLink datasheet figure (900 / 600 GB/s)
    links = builtin_links()
    assert all(links[("nvlink-h100", n)].bus_gb_per_s < 0.4 * 900 for n in (2, 4, 8))
    assert all(links[("nvlink-a100", n)].bus_gb_per_s < 0.3 * 600 for n in (2, 4, 8))


def test_pcie_fit_is_shipped(helix_points):
    eff = single_gpu_efficiency(LLAMA2, helix_points)
    fits = fit_pcie(LLAMA2, helix_points, eff)
    assert sorted(fits) == [2, 4]
    for n, fit in fits.items():
        ship = builtin_links()[(PCIE_HELIX, n)]
        assert ship.bus_gb_per_s == pytest.approx(fit.bus_gb_per_s, rel=0.02)
        assert ship.latency_s == pytest.approx(fit.latency_s, rel=0.05)


def test_pcie_fit_refuses_gpus_on_another_link(helix_points):
    other = [replace(m, config=replace(m.config, gpu=replace(m.config.gpu, interconnect="pcie-l40s")))
             if m.config.gpu.name == "T4" else m for m in helix_points]
    with pytest.raises(CoralError, match="T4 have Helix multi-GPU profiles but interconnect != 'pcie-helix'"):
        fit_pcie(LLAMA2, other, single_gpu_efficiency(LLAMA2, helix_points))


def test_helix_speedups_held_out_with_the_l40s_link(helix_points):
    # The L40S host's NCCL fit in place of pcie-helix on Helix's 15 L4 / T4 points: median 12.2 %,
    # worst 28.9 % (4xT4 decode 100), every point too fast (the L40S host all-reduces 4x faster at 2
    # GPUs). That is why L4 and T4 keep their own (in-sample) Helix fit.
    rows = helix_heldout(LLAMA2, helix_points, RooflinePerf())
    assert len(rows) == 15
    errs = sorted(abs(r.error) for r in rows)
    assert errs[len(errs) // 2] <= 0.13 and errs[-1] <= 0.30
    assert all(r.error > 0 for r in rows)


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
    f = other[(PCIE_HELIX, 2)]
    other[(PCIE_HELIX, 2)] = LinkFit(interconnect=PCIE_HELIX, gpus=2, floor_s=f.floor_s, latency_s=f.latency_s,
                                 bus_gb_per_s=2 * f.bus_gb_per_s)
    assert RooflinePerf(links=other).version != base.version  # a template cache keyed by it goes stale
