import pytest
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from helpers import check_against_reference, tiny_checkpoint
from test_arch_deepseek_v3 import assert_routing_varies, random_correction_bias

VOCAB = 131


def config(**kw):
    # odd sizes; 10 experts in 2 groups of 5, best group only, top-3; one dense layer first
    base = dict(vocab_size=VOCAB, hidden_size=44, intermediate_size=70, moe_intermediate_size=18,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                n_routed_experts=10, n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=1,
                routed_scaling_factor=1.8, norm_topk_prob=True, first_k_dense_replace=1,
                use_qk_norm=True, attention_bias=True, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    base.update(kw)
    # eager experts: transformers' default grouped_mm needs 16-byte-aligned strides (odd sizes fail)
    return Glm4MoeConfig(**base, experts_implementation="eager")


@pytest.mark.parametrize("fused", [False, True])
def test_glm4_moe_qk_norm_bias_partial_rope(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, Glm4MoeForCausalLM, config(), fused=fused, scale=4.0, init=random_correction_bias)
    model = check_against_reference(tmp_path, ref, VOCAB)
    assert model.rope.dim == 6                                        # half of head_dim 12 is rotated
    assert model.model.layers[1].self_attn.o_proj.bias is None       # GLM has no o_proj bias
    assert_routing_varies(model, torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("fused", [False, True])
def test_glm4_moe_plain_attention_ungrouped(tmp_path, fused):
    cfg = config(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1, norm_topk_prob=False,
                 n_routed_experts=9, num_experts_per_tok=2, n_shared_experts=2, num_hidden_layers=4,
                 first_k_dense_replace=2, head_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75})
    ref = tiny_checkpoint(tmp_path, Glm4MoeForCausalLM, cfg, seed=7, fused=fused, scale=4.0,
                          init=random_correction_bias)
    model = check_against_reference(tmp_path, ref, VOCAB, seed=2)
    assert model.rope.dim == 12
    assert_routing_varies(model, torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4)))


def build_for_gpu_test(path):
    """Used by tests/test_gpu.py: a tiny checkpoint to compare CUDA with CPU."""
    tiny_checkpoint(path, Glm4MoeForCausalLM, config(), scale=4.0, init=random_correction_bias)
    return path
