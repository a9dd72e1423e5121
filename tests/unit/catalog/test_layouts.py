"""The one TP rule (vLLM's) and the TP-group names a template's stages use."""
import pytest

from coral.catalog.catalog import builtin_catalog
from coral.catalog.hardware import split_config_name, split_group_name
from coral.catalog.models import builtin_model, builtin_model_names
from coral.errors import CoralError

CAT = builtin_catalog()


def test_phi4_refuses_tp4_and_tp8():
    phi = builtin_model("phi-4")  # 40 heads, 10 KV heads
    assert phi.valid_tp(8) == (1, 2)
    assert "10 KV heads" in (phi.tp_problem(4) or "")
    with pytest.raises(CoralError, match=r"valid TP degrees on 4 GPUs: 1, 2"):
        phi.check_tp(4, 4)


def test_kv_heads_may_be_replicated():
    qwen = builtin_model("qwen3-235b-a22b")  # 4 KV heads: TP 8 replicates each over 2 GPUs
    assert qwen.tp_problem(8) is None
    assert builtin_model("qwen3-32b").valid_tp(8) == (1, 2, 4, 8)


@pytest.mark.parametrize("name", builtin_model_names())
def test_every_builtin_model_runs_tp1(name):
    assert builtin_model(name).valid_tp(1) == (1,)


def test_group_names_round_trip():
    node = CAT.config("4xL40S")
    g = CAT.config("4xL40S/tp1")
    assert (g.count, g.node_count, g.groups_per_node, g.node_name, g.name) == (1, 4, 4, "4xL40S", "4xL40S/tp1")
    assert g.network_gbps == pytest.approx(node.network_gbps / 4)
    assert node.group(4) is node
    assert split_group_name("8xH100/tp2") == ("8xH100", 2) and split_config_name("8xH100/tp2") == (8, "H100")
    with pytest.raises(CoralError, match="does not divide"):
        CAT.config("4xL40S/tp3")
