import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from helpers import check_against_reference, tiny_checkpoint


def config(**kw):
    base = dict(vocab_size=127, hidden_size=44, intermediate_size=26, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=14, num_local_experts=6,
                num_experts_per_tok=2, max_position_embeddings=128, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1000.0})
    base.update(kw)
    # eager experts: transformers' reference loop (grouped_mm needs 16-byte strides, odd sizes lack them)
    return MixtralConfig(**base, experts_implementation="eager")


@pytest.mark.parametrize("fused", [False, True])
def test_mixtral_matches_transformers(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, MixtralForCausalLM, config(), fused=fused, scale=5.0)
    check_against_reference(tmp_path, ref, 127)


@pytest.mark.parametrize("fused", [False, True])
def test_mixtral_sliding_window(tmp_path, fused):
    # window 6 < the 13-token prompt and the 5 + 32 generated positions
    cfg = config(sliding_window=6, num_local_experts=5, num_experts_per_tok=3, num_key_value_heads=1)
    ref = tiny_checkpoint(tmp_path, MixtralForCausalLM, cfg, seed=2, fused=fused, scale=5.0)
    check_against_reference(tmp_path, ref, 127, seed=3)


def test_mixtral_per_expert_fetch(tmp_path):
    # per-expert reads (memory tiers) from the hub layout: w1|w3 -> gate_up_proj, w2 -> down_proj
    import torch
    from moetier.weights.loader import ExpertSource, load_model
    ref = tiny_checkpoint(tmp_path, MixtralForCausalLM, config(), scale=5.0)
    _, _, ckpt = load_model(tmp_path)
    got = ExpertSource(ckpt, "model.layers.2.mlp", ["gate_up_proj", "down_proj"]).get(4)
    assert torch.equal(got["gate_up_proj"], ref.model.layers[2].mlp.experts.gate_up_proj[4])
    assert torch.equal(got["down_proj"], ref.model.layers[2].mlp.experts.down_proj[4])


def build_for_gpu_test(path):
    """Used by tests/test_gpu.py: a tiny checkpoint to compare CUDA with CPU."""
    tiny_checkpoint(path, MixtralForCausalLM, config(), scale=5.0)
    return path
