"""OLMoE (OLMoE-1B-7B): GQA whose q/k RMSNorm spans the whole projection (all heads at once, not
per head), optional clip_qkv, softmax top-k router (renormalised if norm_topk_prob), SwiGLU experts."""
from __future__ import annotations

from ..config import ModelArgs
from ..errors import CheckpointError
from .base import Block, CausalLM
from .layers import Attention, RMSNorm, Rope, SoftmaxMoE, apply_rope, cached_attention


class OlmoeAttention(Attention):
    """q_norm over [H*Dh] and k_norm over [Hkv*Dh] before the head split; then clamp q, k, v to
    +-clip_qkv (after the norms, as transformers does)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(self.h * self.dh, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.hkv * self.dh, args.rms_norm_eps)
        self.clip = args.get("clip_qkv")

    def forward(self, x, rope, kv, start):
        t = x.shape[0]
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)  # [T, H*Dh] ...
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = apply_rope(q.view(t, self.h, self.dh), *rope)
        k = apply_rope(k.view(t, self.hkv, self.dh), *rope)
        out = cached_attention(kv, q, k, v.view(t, self.hkv, self.dh), start, self.scale)
        return self.o_proj(out.reshape(t, self.h * self.dh))


def moe(args: ModelArgs) -> SoftmaxMoE:
    return SoftmaxMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob,
                      args.intermediate_size)


class Model(CausalLM):
    # save_pretrained writes per-expert gate/up/down_proj; the in-memory state dict is fused (by name)
    CHECKPOINT = {
        "experts": {"gate_up_proj": ["experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"],
                    "down_proj": ["experts.{e}.down_proj.weight"]},
    }

    def __init__(self, args: ModelArgs):
        if args.hidden_act != "silu":
            raise CheckpointError(f"OLMoE with hidden_act={args.hidden_act!r} is not supported (only silu is)")
        rope = Rope(args.rope_parameters, args.head_dim, args.max_position_embeddings)
        super().__init__(args, [Block(args, OlmoeAttention(args), moe(args)) for _ in range(args.num_hidden_layers)], rope)
