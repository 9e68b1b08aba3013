import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from helpers import check_against_reference, tiny_checkpoint
from moetier.models.layers import rope_inv_freq

# YaRN with a small original context so the ramp and the attention factor matter at test lengths
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}


def config(**kw):
    base = dict(vocab_size=131, hidden_size=36, intermediate_size=22, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, head_dim=10, num_local_experts=7,
                num_experts_per_tok=3, sliding_window=8, max_position_embeddings=64,
                rope_parameters=dict(YARN), swiglu_limit=1.5)
    base.update(kw)
    # eager experts: transformers' reference loop (grouped_mm needs 16-byte strides, odd sizes lack them)
    return GptOssConfig(**base, experts_implementation="eager")


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_matches_transformers(tmp_path, fused):
    ref = tiny_checkpoint(tmp_path, GptOssForCausalLM, config(), fused=fused, scale=6.0)
    check_against_reference(tmp_path, ref, 131)


def test_gpt_oss_layer_types_truncated_yarn(tmp_path):
    # full layer first, window 5, truncated YaRN ramp, an explicit attention factor
    rp = dict(YARN, truncate=True, attention_factor=1.3)
    cfg = config(layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_hidden_layers=3,
                 sliding_window=5, rope_parameters=rp, num_experts_per_tok=2, swiglu_limit=7.0)
    ref = tiny_checkpoint(tmp_path, GptOssForCausalLM, cfg, seed=3, scale=6.0)
    check_against_reference(tmp_path, ref, 131, seed=4)


@pytest.mark.parametrize("extra", [{}, {"truncate": True}, {"attention_factor": 0.9},
                                   {"mscale": 1.0, "mscale_all_dim": 0.5, "truncate": True},
                                   {"factor": 32.0, "beta_fast": 32.0, "original_max_position_embeddings": 4096}])
def test_yarn_inv_freq_matches_transformers(extra):
    rp = dict(YARN, **extra)
    cfg = config(rope_parameters=rp)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, scale = rope_inv_freq(rp, 10, 64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-7)


def test_gpt_oss_expert_layout():
    # the fused transforms put gate rows first, then up rows, and transpose down
    from moetier.models.gpt_oss import _down_weight, _gate_up_bias, _gate_up_weight
    e, d, i = 3, 5, 4
    gu = torch.randn(e, d, 2 * i)
    ours = _gate_up_weight(gu)
    assert torch.equal(ours[:, :i], gu[..., ::2].transpose(1, 2))
    assert torch.equal(ours[:, i:], gu[..., 1::2].transpose(1, 2))
    b = torch.randn(e, 2 * i)
    assert torch.equal(_gate_up_bias(b), torch.cat([b[:, ::2], b[:, 1::2]], dim=1))
    down = torch.randn(e, i, d)
    assert torch.equal(_down_weight(down), down.transpose(1, 2))


def test_gpt_oss_per_expert_fetch(tmp_path):
    # the memory tiers read one expert at a time through ExpertSource.get: same tensors as the stacked load
    from moetier.weights.loader import ExpertSource, load_model
    tiny_checkpoint(tmp_path, GptOssForCausalLM, config(num_hidden_layers=2), scale=6.0)
    model, _, ckpt = load_model(tmp_path)
    names = ["gate_up_proj", "down_proj", "gate_up_bias", "down_bias"]
    got = ExpertSource(ckpt, "model.layers.1.mlp", names).get(5)
    for n in names:
        assert torch.equal(got[n], getattr(model.model.layers[1].mlp.experts, n)[5]), n


def build_for_gpu_test(path):
    """Used by tests/test_gpu.py: a tiny checkpoint to compare CUDA with CPU."""
    tiny_checkpoint(path, GptOssForCausalLM, config(), scale=6.0)
    return path


def test_mxfp4_safetensors_experts_give_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from moetier.errors import CheckpointError
    from moetier.weights.loader import load_model
    tiny_checkpoint(tmp_path, GptOssForCausalLM, config(num_hidden_layers=1), scale=6.0)
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("experts.gate_up_proj"))
    sd[key.replace("gate_up_proj", "gate_up_proj_blocks")] = torch.zeros(4, dtype=torch.uint8)
    del sd[key]
    save_file(sd, str(f))
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="MXFP4"):
        load_model(tmp_path)
