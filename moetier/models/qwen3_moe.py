"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): GQA with per-head q/k RMSNorm,
softmax top-k router, SwiGLU experts; dense MLP on `mlp_only_layers` / off `decoder_sparse_step`."""
from __future__ import annotations

from ..config import ModelArgs
from .base import Block, CausalLM
from .layers import Attention, MLP, Rope, SoftmaxMoE


def moe(args: ModelArgs) -> SoftmaxMoE:
    return SoftmaxMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob,
                      args.moe_intermediate_size)


def block(args: ModelArgs, i: int) -> Block:
    sparse = (i not in args.get("mlp_only_layers", [])) and args.num_experts > 0 \
        and (i + 1) % args.get("decoder_sparse_step", 1) == 0
    mlp = moe(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
    return Block(args, Attention(args, qk_norm=True), mlp)


class Model(CausalLM):
    CHECKPOINT = {
        "experts": {"gate_up_proj": ["experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"],
                    "down_proj": ["experts.{e}.down_proj.weight"]},
    }

    def __init__(self, args: ModelArgs):
        rope = Rope(args.rope_parameters, args.head_dim, args.max_position_embeddings)
        super().__init__(args, [block(args, i) for i in range(args.num_hidden_layers)], rope)
