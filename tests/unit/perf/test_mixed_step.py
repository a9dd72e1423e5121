"""The colocated (chunked-prefill) step of the performance model against its two pure phases and
first principles: weights read once per step, FLOPs ~ 2·A·(b + c)."""
import pytest

from coral.catalog import builtin_catalog, builtin_model
from coral.perf import DEMAND_PHASES, Efficiency, Phase, RooflinePerf, Shape

CAT = builtin_catalog()
IDEAL = RooflinePerf(efficiency={"A100-40GB": Efficiency(flops=1.0, bandwidth=1.0, layer_overhead_s=0.0)})


def test_demand_phases_are_the_two_pure_phases():
    assert (Phase.PREFILL, Phase.DECODE) == DEMAND_PHASES
    assert "colocated" == Phase.COLOCATED.value
    with pytest.raises(ValueError, match="mixed_node_time_s"):
        Shape(phase=Phase.COLOCATED, batch=1, prompt_tokens=10, output_tokens=0)


@pytest.mark.parametrize("config", ["1xA100-40GB", "2xL40S", "1xL4"])
@pytest.mark.parametrize("model", ["qwen3-32b", "gpt-oss-20b"])
def test_mixed_step_reduces_to_pure_phases(config, model):
    perf, m, cfg = RooflinePerf(), builtin_model(model), CAT.config(config)
    decode = Shape(phase=Phase.DECODE, batch=16, prompt_tokens=1500, output_tokens=0)  # mean context 1500
    only_decode = perf.mixed_node_time_s(cfg, m, layers=3, decode_batch=16, decode_context=1500, chunk_tokens=0,
                                         chunk_context=0, first=True, last=True)
    assert perf.node_time_s(cfg, m, decode, 3, first=True, last=True) == pytest.approx(only_decode)
    # a whole 512-token prompt in one chunk (mean attended context 256) is a prefill of that prompt
    prefill = Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=512, output_tokens=0)
    only_chunk = perf.mixed_layer_time_s(cfg, m, decode_batch=0, decode_context=0, chunk_tokens=512, chunk_context=256)
    if m.sliding_layers:  # the window caps the mean context and the squared one differently: close, not equal
        assert perf.layer_time_s(cfg, m, prefill) == pytest.approx(only_chunk, rel=0.05)
    else:
        assert perf.layer_time_s(cfg, m, prefill) == pytest.approx(only_chunk)


def test_mixed_step_reads_the_weights_once():
    # llama-2-70b on an ideal 1xA100-40GB: one layer of 32 decodes at context 1000 plus a 64-token chunk
    # starting a prompt. First principles: FLOPs = 2·A·(32 + 64) + 4·h_q·(32·1000 + 64·32) with
    # A = 855,638,016, h_q = 8192; bytes = W (1,711,276,032) + KV: 64 new tokens + 32·1000 decode
    # tokens of 4096 B; plus the chunk's GEMM activations (4 passes) and 7 elementwise passes over all 96
    # tokens of 8192·2 B. Memory-bound: the sum of its parts, the weights counted once.
    m, cfg = builtin_model("llama-2-70b"), CAT.config("1xA100-40GB")
    chunk_flops, decode_flops, nbytes = IDEAL.mixed_flops_bytes(m, decode_batch=32, decode_context=1000,
                                                               chunk_tokens=64, chunk_context=32)
    assert 2 * 855_638_016 * 96 + 4 * 8192 * (32 * 1000 + 64 * 32) == pytest.approx(chunk_flops + decode_flops)
    assert 1_711_276_032 + (64 + 32 * 1000) * 4096 == pytest.approx(nbytes)
    t = IDEAL.mixed_layer_time_s(cfg, m, decode_batch=32, decode_context=1000, chunk_tokens=64, chunk_context=32)
    t_compute = (chunk_flops + decode_flops) / 312e12
    t_memory = (nbytes + 4 * 64 * 8192 * 2) / 1555e9
    assert t_memory > t_compute
    assert t_memory + 7 * 96 * 8192 * 2 / 1555e9 == pytest.approx(t)
    separate = (IDEAL.layer_time_s(cfg, m, Shape(phase=Phase.DECODE, batch=32, prompt_tokens=1000, output_tokens=0))
                + IDEAL.layer_time_s(cfg, m, Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=64, output_tokens=0)))
    assert separate - t == pytest.approx(1_711_276_032 / 1555e9, rel=0.02)  # mixing saves one pass over W


def test_later_chunks_read_their_prompt_prefix():
    m = builtin_model("qwen3-32b")
    _, _, first = IDEAL.mixed_flops_bytes(m, decode_batch=0, decode_context=0, chunk_tokens=256, chunk_context=128)
    _, _, later = IDEAL.mixed_flops_bytes(m, decode_batch=0, decode_context=0, chunk_tokens=256, chunk_context=128 + 1024)
    assert 1024 * m.kv_bytes_per_token_layer == pytest.approx(later - first)


def test_mixed_step_grows_with_chunk_and_rejects_empty_steps():
    perf, m, cfg = RooflinePerf(), builtin_model("qwen3-32b"), CAT.config("2xL40S")
    times = [perf.mixed_node_time_s(cfg, m, layers=m.num_layers, decode_batch=8, decode_context=1200, chunk_tokens=c,
                                    chunk_context=c / 2 + 500, first=True, last=True) for c in (0, 64, 256, 1024)]
    assert times == sorted(times)
    with pytest.raises(ValueError, match="one token at least"):
        perf.mixed_node_time_s(cfg, m, layers=1, decode_batch=0, decode_context=0, chunk_tokens=0, chunk_context=0,
                               first=False, last=False)
