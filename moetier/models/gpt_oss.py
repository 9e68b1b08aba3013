"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases and per-head attention sinks,
sliding-window and full layers alternating per `layer_types`, YaRN RoPE, a biased router
(top-k over the logits, softmax over those k) and experts with biases and a clamped SwiGLU."""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from .base import Block, CausalLM
from .layers import Attention, DenseExperts, Rope


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation: gate clamped above, up clamped both sides, (up + 1) * glu."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class TopKSoftmaxRouter(nn.Module):
    """Linear gate with bias -> top-k over the raw logits -> softmax over those k."""

    def __init__(self, dim: int, num_experts: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)      # [T, E]
        top, ids = torch.topk(logits, self.k, dim=-1)      # [T, k]
        return ids, torch.softmax(top, dim=-1)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        act = partial(clamped_swiglu, alpha=float(args.get("swiglu_alpha", 1.702)),
                      limit=float(args.get("swiglu_limit", 7.0)))
        self.router = TopKSoftmaxRouter(args.hidden_size, args.num_experts, args.num_experts_per_tok)
        self.experts = DenseExperts(args.num_experts, args.hidden_size, args.intermediate_size, bias=True, act=act)

    def forward(self, x):
        ids, w = self.router(x)           # [T, k]
        return self.experts(x, ids, w)


def layer_types(args: ModelArgs) -> list[str]:
    """transformers' default when the config has none: sliding on even layers, full on odd."""
    return args.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(args.num_hidden_layers)]


def block(args: ModelArgs, kind: str) -> Block:
    window = args.sliding_window if kind == "sliding_attention" else None
    return Block(args, Attention(args, sinks=True, window=window), MoE(args))


# transformers' GptOssExperts layout -> ours. Theirs: gate_up_proj [E, D, 2I] with gate/up interleaved
# on the last dim (gate = [..., ::2], up = [..., 1::2]), down_proj [E, I, D] (x @ W).
# Ours: gate_up_proj [E, 2I, D] gate rows then up rows, down_proj [E, D, I] (F.linear).
def _gate_up_weight(t: torch.Tensor) -> torch.Tensor:      # [E, D, 2I] -> [E, 2I, D]
    e, d, i2 = t.shape
    return t.view(e, d, i2 // 2, 2).permute(0, 3, 2, 1).reshape(e, i2, d)


def _gate_up_bias(t: torch.Tensor) -> torch.Tensor:        # [E, 2I] -> [E, 2I]
    e, i2 = t.shape
    return t.view(e, i2 // 2, 2).transpose(1, 2).reshape(e, i2)


def _down_weight(t: torch.Tensor) -> torch.Tensor:         # [E, I, D] -> [E, D, I]
    return t.transpose(1, 2)


class Model(CausalLM):
    # save_pretrained and the in-memory state dict both use transformers' fused names; they are
    # renamed to hf_* first so that a same-named tensor in their layout never loads as ours.
    CHECKPOINT = {
        "renames": [(r"\.experts\.(gate_up_proj|down_proj)(_bias)?$", r".experts.hf_\1\2")],
        "fused": {"gate_up_proj": ("hf_gate_up_proj", _gate_up_weight),
                  "gate_up_bias": ("hf_gate_up_proj_bias", _gate_up_bias),
                  "down_proj": ("hf_down_proj", _down_weight),
                  "down_bias": ("hf_down_proj_bias", lambda t: t)},
    }

    def __init__(self, args: ModelArgs):
        # transformers' GptOssConfig defaults attention_bias to True (ModelArgs' default is False)
        args = dataclasses.replace(args, attention_bias=bool(args.get("attention_bias", True)))
        rope = Rope(args.rope_parameters, args.head_dim, args.max_position_embeddings)
        super().__init__(args, [block(args, kind) for kind in layer_types(args)], rope)
