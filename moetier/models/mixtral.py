"""Mixtral (8x7B, 8x22B): GQA without biases, optional sliding window on every layer, softmax
top-k router renormalised over the k, SwiGLU experts."""
from __future__ import annotations

from ..config import ModelArgs
from ..errors import CheckpointError
from .base import Block, CausalLM
from .layers import Attention, Rope, SoftmaxMoE


def moe(args: ModelArgs) -> SoftmaxMoE:
    return SoftmaxMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, True, args.intermediate_size)


class Model(CausalLM):
    # Hub checkpoints (and save_pretrained) name the MoE block `block_sparse_moe` with per-expert
    # w1 (gate), w3 (up), w2 (down); transformers 5 in memory: mlp.gate, mlp.experts.{gate_up,down}_proj.
    CHECKPOINT = {
        "renames": [(r"\.block_sparse_moe\.", ".mlp.")],
        "experts": {"gate_up_proj": ["experts.{e}.w1.weight", "experts.{e}.w3.weight"],
                    "down_proj": ["experts.{e}.w2.weight"]},
    }

    def __init__(self, args: ModelArgs):
        if args.hidden_act != "silu":
            raise CheckpointError(f"Mixtral with hidden_act={args.hidden_act!r} is not supported (only silu is)")
        rope = Rope(args.rope_parameters, args.head_dim, args.max_position_embeddings)
        super().__init__(args, [Block(args, Attention(args, window=args.sliding_window), moe(args))
                               for _ in range(args.num_hidden_layers)], rope)
