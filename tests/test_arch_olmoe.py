import pytest
from transformers import OlmoeConfig, OlmoeForCausalLM

from helpers import check_against_reference, tiny_checkpoint


def config(**kw):
    base = dict(vocab_size=113, hidden_size=42, intermediate_size=18, num_hidden_layers=3,
                num_attention_heads=3, num_key_value_heads=3, num_experts=9, num_experts_per_tok=3,
                max_position_embeddings=128, pad_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 2000.0})
    base.update(kw)
    # eager experts: transformers' reference loop (grouped_mm needs 16-byte strides, odd sizes lack them)
    return OlmoeConfig(**base, experts_implementation="eager")


@pytest.mark.parametrize("fused", [False, True])
def test_olmoe_matches_transformers(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, OlmoeForCausalLM, config(), fused=fused, scale=5.0)
    check_against_reference(tmp_path, ref, 113)


@pytest.mark.parametrize("fused", [False, True])
def test_olmoe_gqa_clip_qkv_normalised_topk(tmp_path, fused):
    # clip small enough to bite on the normed q/k; grouped kv heads (k_norm spans Hkv*Dh)
    cfg = config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, clip_qkv=0.9, norm_topk_prob=True,
                 attention_bias=True, tie_word_embeddings=True)
    ref = tiny_checkpoint(tmp_path, OlmoeForCausalLM, cfg, seed=5, fused=fused, scale=5.0)
    check_against_reference(tmp_path, ref, 113, seed=6)


def build_for_gpu_test(path):
    """Used by tests/test_gpu.py: a tiny checkpoint to compare CUDA with CPU."""
    tiny_checkpoint(path, OlmoeForCausalLM, config(), scale=5.0)
    return path
