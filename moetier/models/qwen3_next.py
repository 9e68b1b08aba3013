"""Qwen3-Next (Qwen3-Next-80B-A3B) and the Qwen3.5-MoE text model: a hybrid of gated DeltaNet
layers (linear attention with a recurrent state, see deltanet.py) and gated full-attention
layers (an output gate from q_proj, q/k norm, partial RoPE), every `full_attention_interval`-th
layer; softmax top-k MoE plus a shared expert scaled by sigmoid(shared_expert_gate(x)).
All RMSNorms except DeltaNet's output norm are zero-centred: x_normed * (1 + weight).

Qwen3.5-MoE differs only in the DeltaNet input projections (in_proj_qkv / z / b / a instead of
the per-key-head interleaved in_proj_qkvz / ba), always renormalised top-k weights, MoE in every
layer and M-RoPE, which for text (equal t/h/w positions) is plain RoPE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..errors import CheckpointError
from ..kernels import deltanet_ops
from ..runtime.kv_cache import KVCache, RecurrentState
from .base import CausalLM
from .deltanet import CHUNK, GatedRMSNorm, causal_conv, l2norm
from .layers import MLP, DenseExperts, Rope, SoftmaxRouter, apply_rope, cached_attention


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (checkpoints hold ~0)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """GQA whose q_proj also yields a per-channel output gate: out = o_proj(attn * sigmoid(gate))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, self.h, self.hkv = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.dh = args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(d, self.h * self.dh * 2, bias=bias)        # per head: [query | gate]
        self.k_proj = nn.Linear(d, self.hkv * self.dh, bias=bias)
        self.v_proj = nn.Linear(d, self.hkv * self.dh, bias=bias)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.dh, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.dh, args.rms_norm_eps)
        self.scale = self.dh ** -0.5

    def make_cache(self, max_len: int, dtype, device) -> KVCache:
        return KVCache(max_len, (self.hkv, self.dh), (self.hkv, self.dh), dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple, kv: KVCache, start: int) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.h, 2 * self.dh).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.hkv, self.dh)), *rope)
        out = cached_attention(kv, q, k, self.v_proj(x).view(t, self.hkv, self.dh), start, self.scale)  # [T, H, Dh]
        return self.o_proj((out * torch.sigmoid(gate)).reshape(t, self.h * self.dh))


class GatedDeltaNet(nn.Module):
    """Linear attention: projections -> causal conv (q, k, v) -> l2-normed q, k -> gated delta rule
    over the recurrent state -> per-head gated RMSNorm with z -> out_proj. Value heads (Hv) share
    key heads (Hk) in consecutive groups of Hv/Hk."""

    chunk = CHUNK   # prefill chunk length (tests may lower it)

    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.hidden_size
        self.hk, self.hv = args.get("linear_num_key_heads"), args.get("linear_num_value_heads")
        self.dk, self.dv = args.get("linear_key_head_dim"), args.get("linear_value_head_dim")
        self.kernel = args.get("linear_conv_kernel_dim", 4)
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim                      # channels [q | k | v]
        self.separate = args.model_type.startswith("qwen3_5")
        if self.separate:   # Qwen3.5: plain concatenations
            self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(d, self.hv, bias=False)
            self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        else:               # Qwen3-Next: grouped per key head
            self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def make_cache(self, max_len: int, dtype, device) -> RecurrentState:
        return RecurrentState((self.kernel - 1, self.conv_dim), (self.hv, self.dk, self.dv), dtype, device)

    def project(self, x: torch.Tensor):
        """-> qkv [T, conv_dim] (conv input), z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        t = x.shape[0]
        if self.separate:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.hv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.hv // self.hk
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, rope, state: RecurrentState, start: int) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.project(x)
        # a sequence starts from zero state, whatever the entry held before; a device-tensor start
        # (CUDA-graph decode) is never the first position
        fresh = not isinstance(start, torch.Tensor) and start == 0
        qkv, conv = causal_conv(qkv, torch.zeros_like(state.conv) if fresh else state.conv, self.conv1d.weight)
        state.conv.copy_(conv)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.hv // self.hk
        q = l2norm(q.float().view(t, self.hk, self.dk)).repeat_interleave(r, dim=1) * self.dk ** -0.5
        k = l2norm(k.float().view(t, self.hk, self.dk)).repeat_interleave(r, dim=1)
        v = v.view(t, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)   # log decay <= 0, [T, Hv]
        s0 = torch.zeros_like(state.ssm) if fresh else state.ssm
        if t == 1:   # the final state is written into state.ssm (in place by the kernels)
            out, _ = deltanet_ops.recurrent(q, k, v, g, beta, s0, out_state=state.ssm)
        else:
            out, _ = deltanet_ops.chunk(q, k, v, g, beta, s0, self.chunk, out_state=state.ssm)
        out = self.norm(out.to(x.dtype), z)                                      # [T, Hv, Dv]
        return self.out_proj(out.reshape(t, self.value_dim))


class MoE(nn.Module):
    """Softmax top-k routed experts plus one shared expert gated per token by a sigmoid."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # Qwen3.5-MoE's config has no norm_topk_prob: it always renormalises
        normalize = args.norm_topk_prob if "norm_topk_prob" in args.extra else True
        self.gate = SoftmaxRouter(args.hidden_size, args.num_experts, args.num_experts_per_tok, normalize)
        self.experts = DenseExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_expert = MLP(args.hidden_size, args.get("shared_expert_intermediate_size"))
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x):
        ids, w = self.gate(x)                                                    # [T, k]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, ids, w) + shared


def layer_types(args: ModelArgs) -> list[str]:
    types = args.get("layer_types")
    if types is None:
        every = args.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(args.num_hidden_layers)]
    return list(types)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, i: int, kind: str):
        super().__init__()
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args)
        elif kind == "full_attention":
            self.self_attn = GatedAttention(args)
        else:
            raise CheckpointError(f"config.json: layer_types[{i}] is {kind!r}; "
                                  "expected 'linear_attention' or 'full_attention'")
        sparse = (i not in args.get("mlp_only_layers", [])) and args.num_experts > 0 \
            and (i + 1) % args.get("decoder_sparse_step", 1) == 0
        self.mlp = MoE(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.linear else self.self_attn

    def make_cache(self, max_len, dtype, device):
        return self.mixer.make_cache(max_len, dtype, device)

    def forward(self, h, rope, cache, start):
        h = h + self.mixer(self.input_layernorm(h), rope, cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    # Qwen3.5's multimodal checkpoints keep the text model under model.language_model (vision
    # tower model.visual.* and mtp.* are not read); per-expert names as save_pretrained writes them.
    CHECKPOINT = {
        "renames": [(r"^model\.language_model\.", "model.")],
        "experts": {"gate_up_proj": ["experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"],
                    "down_proj": ["experts.{e}.down_proj.weight"]},
    }

    def __init__(self, args: ModelArgs):
        rp = args.rope_parameters
        factor = rp.get("partial_rotary_factor") or args.get("partial_rotary_factor") or 0.25
        rope = Rope(rp, int(args.head_dim * factor), args.max_position_embeddings)
        types = layer_types(args)
        if len(types) < args.num_hidden_layers:
            raise CheckpointError(f"config.json: layer_types lists {len(types)} layers but num_hidden_layers "
                             f"is {args.num_hidden_layers}")
        super().__init__(args, [Block(args, i, types[i]) for i in range(args.num_hidden_layers)], rope)
        self.model.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
