"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (glm4_moe): GQA with biased q/k/v (no o_proj bias), optional
per-head q/k RMSNorm, partial RoPE on the first half of each head, and DeepSeek-V3's MoE block
(grouped sigmoid routing with correction bias, shared experts, dense first layers)."""
from __future__ import annotations


from ..config import ModelArgs
from .base import Block, CausalLM
from .deepseek_v3 import MoE
from .layers import MLP, Attention, Rope


def rotary_dim(args: ModelArgs) -> int:
    # transformers defaults glm4_moe's partial_rotary_factor to 0.5 when the config omits it
    factor = args.rope_parameters.get("partial_rotary_factor", args.get("partial_rotary_factor", 0.5))
    return int(args.head_dim * factor)


def block(args: ModelArgs, i: int) -> Block:
    dense = i < (args.get("first_k_dense_replace") or 0)
    mlp = MLP(args.hidden_size, args.intermediate_size) if dense else MoE(args)
    return Block(args, Attention(args, qk_norm=bool(args.get("use_qk_norm", False)), o_bias=False), mlp)


class Model(CausalLM):
    # Same expert names as DeepSeek-V3; multi-token-prediction layers past num_hidden_layers are not read.
    CHECKPOINT = {
        "experts": {"gate_up_proj": ["experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"],
                    "down_proj": ["experts.{e}.down_proj.weight"]},
    }

    def __init__(self, args: ModelArgs):
        rope = Rope(args.rope_parameters, rotary_dim(args), args.max_position_embeddings)
        super().__init__(args, [block(args, i) for i in range(args.num_hidden_layers)], rope)
