"""The engine's lean batched step: the same bits as the transformers modules, weights shared, hooks honoured."""

from __future__ import annotations

import pytest
import torch

from coral.runtime.engine.layers import LeanStep
from coral.runtime.engine.model import BUILTIN_CONFIGS, ShardSpec, load_shard, seeded_state_dict

from .test_engine_batched import SLIDING_QWEN3

CONFIGS = {"tiny-llama": BUILTIN_CONFIGS["tiny-llama"], "tiny-qwen3": BUILTIN_CONFIGS["tiny-qwen3"], "tiny-qwen3-moe": BUILTIN_CONFIGS["tiny-qwen3-moe"], "sliding-qwen3": SLIDING_QWEN3}

#: prefill rows alone, decode rows beside a new prompt, then decode rows only (the lean decode path)
STEPS = [
    [("a", 0, 5), ("b", 0, 9), ("c", 0, 1)],
    [("a", 5, 1), ("b", 9, 1), ("c", 1, 1), ("d", 0, 7)],
    [("a", 6, 1), ("b", 10, 1), ("c", 2, 1), ("d", 7, 1)],
    [("a", 7, 1), ("b", 11, 1), ("c", 3, 1), ("d", 8, 1)],
]


def _run(cfg: dict, layers: tuple[int, int], lean: bool, steps: list, hook: list | None = None) -> list[torch.Tensor]:
    """Each step's output of a shard's layers on seeded random hidden states."""
    shard = load_shard(ShardSpec(config=cfg, layer_start=layers[0], layer_end=layers[1], seed=3))
    if hook is not None:
        shard.model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda _m, _i, out: hook.append(out.shape))
    kv = shard.new_kv_cache(max_tokens_wanted=4096, block_size=4)
    step = LeanStep(shard.model, lean=lean)
    g = torch.Generator().manual_seed(1)
    out = []
    with torch.inference_mode():
        for rows in steps:
            meta = kv.prepare(rows)
            out.append(step.run(torch.randn(sum(n for _, _, n in rows), cfg["hidden_size"], generator=g), meta))
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_lean_step_gives_the_modules_bits(arch: str) -> None:
    cfg = CONFIGS[arch]
    layers = (1, cfg["num_hidden_layers"] - 1)  # a middle stage: neither embedding nor head
    lean = _run(cfg, layers, True, STEPS)
    ref = _run(cfg, layers, False, STEPS)
    for k, (a, b) in enumerate(zip(lean, ref, strict=True)):
        assert torch.equal(b, a), f"step {k}: max difference {(a - b).abs().max().item():.2e}"


def test_lean_step_covers_the_stock_layers_and_falls_back_on_others() -> None:
    shard = load_shard(ShardSpec(config=CONFIGS["tiny-qwen3-moe"], layer_start=0, layer_end=2, seed=3))
    step = LeanStep(shard.model)
    assert all(p is not None for p in step.plans)
    assert [False, False] == [p.dense for p in step.plans if p is not None]  # experts run through their module
    assert [None, None] == LeanStep(shard.model, lean=False).plans


def test_fused_projections_share_the_weights() -> None:
    cfg = CONFIGS["tiny-llama"]
    shard = load_shard(ShardSpec(config=cfg, layer_start=0, layer_end=2, seed=3))
    before = shard.weights_bytes
    step = LeanStep(shard.model)
    attn = shard.model.model.layers[1].self_attn
    plan = step.plans[1]
    assert plan is not None
    # q/k/v are views of the fused tensor: nothing copied, and the loaded values are unchanged
    assert attn.q_proj.weight.data_ptr() == plan.w_qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == plan.w_qkv[64:].data_ptr()
    full = seeded_state_dict(cfg, 3)
    assert torch.equal(full["model.layers.1.self_attn.v_proj.weight"], attn.v_proj.weight)
    assert torch.equal(full["model.layers.1.mlp.up_proj.weight"], shard.model.model.layers[1].mlp.up_proj.weight)
    assert before == sum(p.numel() * p.element_size() for p in shard.model.parameters())
    # the engine builds its step on the first batch: the weights stay ordinary (not inference) tensors
    served = load_shard(ShardSpec(config=cfg, layer_start=0, layer_end=2, seed=3))
    served.forward_batch(served.new_kv_cache(max_tokens_wanted=64).prepare([("a", 0, 3)]), torch.tensor([5, 6, 7]), None)
    assert served.lean is not None and not served.model.model.layers[0].self_attn.q_proj.weight.is_inference()
    # a weight loaded in place afterwards reaches the fused tensor too
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
    assert torch.equal(plan.w_qkv[64:96], attn.k_proj.weight)


def test_a_hooked_projection_runs_through_its_module() -> None:
    # tensor parallelism all-reduces o_proj's output in a forward hook: the lean step must call it
    cfg = CONFIGS["tiny-llama"]
    seen: list = []
    lean = _run(cfg, (0, 2), True, STEPS[:2], hook=seen)
    assert [torch.Size([15, 64]), torch.Size([10, 64])] == seen
    assert all(torch.equal(a, b) for a, b in zip(lean, _run(cfg, (0, 2), False, STEPS[:2]), strict=True))


def test_rope_table_grows_past_its_first_size() -> None:
    # the cos/sin table starts at 256 positions; a row at position 300 grows it, same bits as the module
    cfg = CONFIGS["tiny-qwen3"]
    steps = [[("a", 0, 300), ("b", 0, 3)], [("a", 300, 1), ("b", 3, 1)]]
    lean, ref = _run(cfg, (0, 2), True, steps), _run(cfg, (0, 2), False, steps)
    assert all(torch.equal(a, b) for a, b in zip(lean, ref, strict=True))


def test_decode_step_indices_follow_the_block_tables() -> None:
    shard = load_shard(ShardSpec(config=CONFIGS["tiny-llama"], layer_start=0, layer_end=1, seed=3))
    kv = shard.new_kv_cache(max_tokens_wanted=4096, block_size=4)
    kv.prepare([("a", 0, 6), ("b", 0, 3)])
    kv.prepare([("c", 0, 2)])  # c's block sits between a's and b's next ones
    meta = kv.prepare([("a", 6, 1), ("b", 3, 1), ("c", 2, 1)])
    tables = {s: kv.pool.tables[s] for s in "abc"}
    # token t of a sequence lives in slot table[t // 4] * 4 + t % 4
    want = [tables["a"][1] * 4 + 2, tables["b"][0] * 4 + 3, tables["c"][0] * 4 + 2]
    assert want == meta.slot_mapping.tolist()
    assert (3, 1, 7) == (meta.rows, meta.q_max, meta.kv_max)
    assert [[6], [3], [2]] == meta.position_ids.view(3, 1).tolist()
    assert [7, 4, 3] == meta.mask.view(3, 7).sum(1).tolist()  # every row sees its whole context, nothing past it
    ctx = meta.gather.view(3, 7)
    assert [tables["b"][0] * 4 + t for t in range(4)] == ctx[1, :4].tolist()


def test_a_step_that_does_not_fit_reserves_nothing() -> None:
    from coral.runtime.engine.kv_cache import KvCacheFull, PagedKvCache

    kv = PagedKvCache(num_layers=1, kv_heads=2, head_dim=4, num_blocks=3, block_size=4)
    kv.prepare([("a", 0, 4), ("b", 0, 3)])  # one block each, one left
    # a needs a second block (token 4) and c two more: 3 > 1 free, so neither grows
    with pytest.raises(KvCacheFull, match="needs 3 more block"):
        kv.prepare([("a", 4, 1), ("b", 3, 1), ("c", 0, 5)])
    assert (1, 4, 3) == (kv.pool.num_free, kv.length("a"), kv.length("b")) and "c" not in kv.pool
    with pytest.raises(ValueError, match="position 2 does not follow the 3 tokens"):
        kv.prepare([("b", 2, 1)])
    meta = kv.prepare([("a", 4, 1), ("b", 3, 1)])  # b's token 3 still fits its block
    assert (0, 5, 4) == (kv.pool.num_free, kv.length("a"), kv.length("b")) and 1 == meta.q_max
