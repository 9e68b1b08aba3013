import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from helpers import check_against_reference, tiny_checkpoint
from moetier.models.layers import GroupedSigmoidRouter

VOCAB = 131


def config(**kw):
    # odd sizes; 12 experts in 4 groups of 3, top-2 groups, top-3 experts; one dense layer first
    base = dict(vocab_size=VOCAB, hidden_size=44, intermediate_size=70, moe_intermediate_size=18,
                num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                q_lora_rank=28, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                max_position_embeddings=256, rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8})
    base.update(kw)
    # eager experts: transformers' default grouped_mm needs 16-byte-aligned strides (odd sizes fail)
    return DeepseekV3Config(**base, experts_implementation="eager")


def random_correction_bias(model):
    # transformers keeps e_score_correction_bias as a (saved) buffer initialised to zero
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.1)


def assert_routing_varies(model, tokens):
    """The routers see varied inputs, pick more than k experts overall, and the bias changes choices."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0], o[0])))
             for m in model.modules() if isinstance(m, GroupedSigmoidRouter)]
    with torch.no_grad():
        model(tokens, model.make_cache(len(tokens), torch.float32, "cpu"))
    for h in hooks:
        h.remove()
    assert seen
    bias_matters = False
    for router, x, ids in seen:
        assert router.e_score_correction_bias.abs().sum() > 0, "correction bias did not load"
        assert len(ids.unique()) > router.k
        saved = router.e_score_correction_bias.clone()
        with torch.no_grad():
            router.e_score_correction_bias.zero_()
            plain, _ = router(x)
            router.e_score_correction_bias.copy_(saved)
        bias_matters |= not torch.equal(plain.sort(-1).values, ids.sort(-1).values)
    assert bias_matters, "the correction bias never changed a routing decision"


@pytest.mark.parametrize("fused", [False, True])
def test_deepseek_v3_q_lora_yarn(tmp_path, fused):
    cfg = config()
    ref = tiny_checkpoint(tmp_path, DeepseekV3ForCausalLM, cfg, fused=fused, scale=4.0, init=random_correction_bias)
    model = check_against_reference(tmp_path, ref, VOCAB)
    cache = model.make_cache(8, torch.float32, "cpu")
    assert tuple(cache[0].k.shape) == (8, cfg.kv_lora_rank)          # the compressed latent ...
    assert tuple(cache[0].v.shape) == (8, cfg.qk_rope_head_dim)      # ... and the shared rope key
    assert_routing_varies(model, torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("fused", [False, True])
def test_deepseek_v3_no_q_lora(tmp_path, fused):
    cfg = config(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=1.5,
                 n_routed_experts=10, n_group=2, topk_group=1, num_experts_per_tok=4, n_shared_experts=1,
                 num_hidden_layers=4, first_k_dense_replace=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    ref = tiny_checkpoint(tmp_path, DeepseekV3ForCausalLM, cfg, seed=5, fused=fused, scale=4.0,
                          init=random_correction_bias)
    model = check_against_reference(tmp_path, ref, VOCAB, seed=2)
    assert not hasattr(model.model.layers[0].self_attn, "q_a_proj")
    assert_routing_varies(model, torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4)))


def build_for_gpu_test(path):
    """Used by tests/test_gpu.py: a tiny checkpoint to compare CUDA with CPU."""
    tiny_checkpoint(path, DeepseekV3ForCausalLM, config(), scale=4.0, init=random_correction_bias)
    return path
