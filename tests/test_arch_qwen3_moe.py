import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from helpers import check_against_reference, tiny_checkpoint


def config(**kw):
    base = dict(vocab_size=131, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                max_position_embeddings=256, rope_theta=1000.0)
    base.update(kw)
    return Qwen3MoeConfig(**base)


@pytest.mark.parametrize("fused", [False, True])
def test_qwen3_moe_matches_transformers(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, config(), fused=fused, scale=4.0)
    check_against_reference(tmp_path, ref, 131)


def test_qwen3_moe_unnormalised_topk_tied(tmp_path):
    ref = tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, config(norm_topk_prob=False, tie_word_embeddings=True,
                                                                 mlp_only_layers=[]), scale=4.0)
    check_against_reference(tmp_path, ref, 131)
