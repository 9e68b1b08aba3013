"""DeepSeek-V3 / R1 (and Kimi-K2, which shares the architecture): multi-head latent attention
(MLA) with an optional low-rank query, a decoupled RoPE key shared by all heads, grouped sigmoid
routing with a correction bias, shared experts, and dense MLPs on the first layers."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelArgs
from ..errors import CheckpointError
from ..runtime.kv_cache import KVCache
from .base import Block, CausalLM
from .layers import MLP, DenseExperts, GroupedSigmoidRouter, RMSNorm, Rope, apply_rope, attention


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def softmax_scale(rp: dict, head_dim: int) -> float:
    """1/sqrt(head_dim), times mscale(factor, mscale_all_dim)^2 when RoPE is scaled (as transformers does)."""
    scale = head_dim ** -0.5
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        m = yarn_mscale(float(rp.get("factor") or 1.0), float(rp["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLA(nn.Module):
    """Multi-head latent attention. Per token: one latent c [R] (kv_lora_rank) and one rotated
    key part k_rope [Dr] shared by all heads; per head k = [kv_b(c)_nope, k_rope], v = kv_b(c)_v."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, self.h = args.hidden_size, args.num_attention_heads
        self.dn, self.dr = args.get("qk_nope_head_dim"), args.get("qk_rope_head_dim")
        self.dv, self.rank = args.get("v_head_dim"), args.get("kv_lora_rank")
        q_rank, bias = args.get("q_lora_rank"), args.attention_bias
        dq = self.dn + self.dr
        if q_rank is None:
            self.q_proj = nn.Linear(d, self.h * dq, bias=False)
        else:  # low-rank query: d -> q_rank -> norm -> heads
            self.q_a_proj = nn.Linear(d, q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_rank)          # eps 1e-6 regardless of rms_norm_eps, as trained
            self.q_b_proj = nn.Linear(q_rank, self.h * dq, bias=False)
        self.low_rank_q = q_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, d, bias=bias)
        self.scale = softmax_scale(args.rope_parameters, dq)
        # checkpoints store the rope features as interleaved pairs unless the config says otherwise
        self.interleaved = bool(args.get("rope_interleave", True))

    def make_cache(self, max_len: int, dtype, device) -> KVCache:
        # "k" holds the normed latent c [S, R], "v" the rotated shared key part k_rope [S, Dr]
        return KVCache(max_len, (self.rank,), (self.dr,), dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple, kv: KVCache, start: int) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q_nope, q_rope = q.view(t, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.dr], dim=-1)   # [T, R], [T, Dr]
        c = self.kv_a_layernorm(c)
        q_rope = apply_rope(q_rope, *rope, interleaved=self.interleaved)             # [T, H, Dr]
        k_rope = apply_rope(k_rope[:, None], *rope, interleaved=self.interleaved)[:, 0]
        c, k_rope = kv.update(start, c, k_rope)                                        # [S, R], [S, Dr]
        # expand the latent every step; absorbing kv_b_proj into q and o_proj is the later fast path
        s = c.shape[0]
        k_nope, v = self.kv_b_proj(c).view(s, self.h, self.dn + self.dv).split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(s, self.h, self.dr)], dim=-1)  # [S, H, Dn+Dr]
        q = torch.cat([q_nope, q_rope], dim=-1)                                        # [T, H, Dn+Dr]
        out = attention(q, k, v, start, self.scale)                                    # [T, H, Dv]
        return self.o_proj(out.reshape(t, self.h * self.dv))


class MoE(nn.Module):
    """Grouped sigmoid router -> routed experts, plus always-on shared experts (also GLM4-MoE's block)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, n_group = args.num_experts, args.get("n_group") or 1
        if e % n_group:
            raise CheckpointError(f"config.json: n_routed_experts={e} is not divisible by n_group={n_group}")
        self.gate = GroupedSigmoidRouter(
            args.hidden_size, e, args.num_experts_per_tok, n_group, args.get("topk_group") or 1,
            args.norm_topk_prob, float(args.get("routed_scaling_factor", 1.0)))
        self.experts = DenseExperts(e, args.hidden_size, args.moe_intermediate_size)
        n_shared = args.num_shared_experts
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * n_shared) if n_shared else None

    def forward(self, x):
        ids, w = self.gate(x)                                  # [T, k]
        if self.shared_experts is None:
            return self.experts(x, ids, w)
        return self.experts(x, ids, w) + self.shared_experts(x)


def block(args: ModelArgs, i: int) -> Block:
    dense = i < (args.get("first_k_dense_replace") or 0)
    return Block(args, MLA(args), MLP(args.hidden_size, args.intermediate_size) if dense else MoE(args))


class Model(CausalLM):
    # save_pretrained writes per-expert names; the in-memory layout (experts.gate_up_proj) loads by name.
    # mlp.gate.e_score_correction_bias is a buffer in transformers but is saved; ours is a parameter.
    # Multi-token-prediction layers (model.layers.{num_hidden_layers}) are not read.
    CHECKPOINT = {
        "experts": {"gate_up_proj": ["experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"],
                    "down_proj": ["experts.{e}.down_proj.weight"]},
    }

    def __init__(self, args: ModelArgs):
        rope = Rope(args.rope_parameters, args.get("qk_rope_head_dim"), args.max_position_embeddings)
        super().__init__(args, [block(args, i) for i in range(args.num_hidden_layers)], rope)
