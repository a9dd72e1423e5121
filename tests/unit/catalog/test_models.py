"""Derived model quantities, checked against hand arithmetic."""
import json

import pytest

from coral.catalog import builtin_model, builtin_model_names, from_hf_config, load_hf_config
from coral.catalog.models import MXFP4_BYTES_PER_PARAM
from coral.errors import CoralError, UnknownNameError


def test_llama2_70b_layer_params():
    m = builtin_model("llama-2-70b")
    # attention: q 8192*8192 + k,v 2*8192*1024 + o 8192*8192 = 150,994,944
    assert m.attention_params == 8192 * 8192 * 2 + 2 * 8192 * 1024 == 150_994_944
    # gated MLP: 3 * 8192 * 28672 = 704,643,072
    assert m.mlp_params == 704_643_072
    assert m.layer_params == 855_638_016
    assert m.layer_weight_bytes == 2 * 855_638_016
    # 80 layers + untied embedding and LM head (32000 * 8192 each) = 68.98 B
    assert m.total_params == 80 * 855_638_016 + 2 * 32000 * 8192


def test_qwen3_32b_kv_bytes():
    m = builtin_model("qwen3-32b")
    # 2 (K and V) * 8 kv heads * 128 head dim * 2 bytes * 64 layers
    assert m.kv_bytes_per_token == 2 * 8 * 128 * 2 * 64 == 262144


def test_gpt_oss_mxfp4_and_sliding():
    m = builtin_model("gpt-oss-20b")
    assert m.num_experts == 32 and m.experts_per_token == 4
    assert m.expert_weight_bytes == MXFP4_BYTES_PER_PARAM == 4.25 / 8
    assert m.sliding_layers == 12 and m.sliding_window == 128
    # total params agree with the public count (20.9 B) within biases
    assert m.total_params / 1e9 == pytest.approx(20.91, rel=0.002)
    # weights: attention+router bf16, experts MXFP4 -> about 13.7 GB, far below 2 bytes * 20.9 B
    expected = 24 * ((m.attention_params + 2880 * 32) * 2 + 32 * 3 * 2880 * 2880 * 4.25 / 8) + 2 * 201088 * 2880 * 2
    assert m.weights_bytes == pytest.approx(expected)
    # a decode batch of 1 touches 4 of 32 experts
    assert m.layer_touched_bytes(1) == pytest.approx((m.attention_params + 2880 * 32) * 2 + 4 * m.expert_bytes)


def test_moe_active_params_qwen3_235b():
    m = builtin_model("qwen3-235b-a22b")
    assert m.total_params / 1e9 == pytest.approx(235.09, rel=1e-3)
    assert m.active_params / 1e9 == pytest.approx(22.19, rel=1e-3)


def test_effective_context_sliding():
    m = builtin_model("gpt-oss-20b")
    # half the layers see at most 128 tokens
    assert m.effective_context(1000) == pytest.approx(0.5 * 128 + 0.5 * 1000)
    assert m.effective_context(100) == 100


@pytest.mark.parametrize("name,file", [("qwen3-32b", "qwen3-32b"), ("gpt-oss-120b", "gpt-oss-120b"),
                                       ("phi-4", "phi-4"), ("llama-3-70b", "llama-3.1-70b")])
def test_builtin_matches_public_config(name, file, data_dir):
    path = data_dir / "models" / f"{file}.json"
    from_file = load_hf_config(path, name=name)
    assert from_file == builtin_model(name)


def test_unknown_model_lists_valid():
    with pytest.raises(UnknownNameError, match="valid models: .*qwen3-32b"):
        builtin_model("qwen-999")
    assert "phi-4" in builtin_model_names()


def test_bad_configs(tmp_path):
    with pytest.raises(CoralError, match="architecture 'BertModel' is not supported"):
        from_hf_config({"architectures": ["BertModel"]}, "x")
    with pytest.raises(CoralError, match="no 'hidden_size'"):
        from_hf_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}, "x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(CoralError, match="not valid JSON"):
        load_hf_config(bad)
    with pytest.raises(CoralError, match="does not exist"):
        load_hf_config(tmp_path / "missing.json")
    assert json.loads('{"a": 1}') == {"a": 1}
