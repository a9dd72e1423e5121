"""`RooflinePerf.bound`: which of FLOPs and HBM bytes limits one layer (what `coral perf` prints)."""
from coral.catalog import builtin_catalog, builtin_model
from coral.perf import Efficiency, Phase, RooflinePerf, Shape

CAT = builtin_catalog()


def test_long_prefill_is_compute_bound_and_one_request_decode_memory_bound():
    # llama-2-70b on an ideal 1xA100: a 1000-token prefill layer is 1.73e12 FLOPs / 312e12 = 5.5 ms of
    # math against ~1.7 GB of weights / 1555e9 = 1.1 ms of HBM; one decode token is 1.7e9 FLOPs
    # (5.5 µs) against the same 1.1 ms of weights.
    perf = RooflinePerf(efficiency={"A100-40GB": Efficiency(flops=1.0, bandwidth=1.0, layer_overhead_s=0.0)})
    cfg, m = CAT.config("1xA100-40GB"), builtin_model("llama-2-70b")
    prefill = Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=1000, output_tokens=0)
    decode = Shape(phase=Phase.DECODE, batch=1, prompt_tokens=1000, output_tokens=0)
    assert "compute" == perf.bound(cfg, m, prefill)
    assert "memory" == perf.bound(cfg, m, decode)


def test_bound_follows_the_fitted_efficiencies():
    # the same decode layer turns compute-bound when the math runs at a millionth of the datasheet
    perf = RooflinePerf(efficiency={"A100-40GB": Efficiency(flops=1e-6, bandwidth=1.0, layer_overhead_s=0.0)})
    decode = Shape(phase=Phase.DECODE, batch=1, prompt_tokens=1000, output_tokens=0)
    assert "compute" == perf.bound(CAT.config("1xA100-40GB"), builtin_model("llama-2-70b"), decode)
