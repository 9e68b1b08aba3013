"""The decoder skeleton every architecture shares: embed -> blocks -> norm -> lm_head.

An architecture file defines its `Block` (attention + feed-forward, math only) and a
`CausalLM` subclass naming it. Names follow Hugging Face (`model.layers.N...`), so
checkpoints load mostly by name; the differences live in each file's `CHECKPOINT` table.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelArgs
from ..kernels import small_ops
from ..runtime.kv_cache import Cache
from .layers import RMSNorm, Rope


class Block(nn.Module):
    """Pre-norm decoder layer: h += attn(norm(h)); h += mlp(norm(h)). Names as in HF checkpoints."""

    def __init__(self, args: ModelArgs, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def make_cache(self, max_len, dtype, device):
        return self.self_attn.make_cache(max_len, dtype, device)

    def forward(self, h, rope, kv, start):
        norm = self.input_layernorm
        fused = getattr(self.self_attn, "norm_token", None)
        a = fused(h, norm, rope, kv, start) if fused is not None else None   # one eager CPU token: one C call
        if a is None:
            q8 = getattr(self.self_attn, "q8_input", None)
            if type(norm) is RMSNorm and q8 is not None and q8(h):
                # one CUDA token into a quantized qkv GEMV: the norm writes the GEMV's int8 input too (one launch fewer)
                x, pre = small_ops.rms_norm_q8(h, norm.weight, norm.eps, norm)
                a = self.self_attn(x, rope, kv, start, pre=pre)
            else:
                a = self.self_attn(norm(h), rope, kv, start)
        return self.mlp_half(h, a)

    def mlp_half(self, h, a):
        """h + a + mlp(norm(h + a)): the layer after its attention (runtime.cpu_step finishes a layer with it)."""
        norm = self.post_attention_layernorm
        fused = getattr(self.mlp, "add_norm_forward", None)
        out = fused(h, a, norm) if fused is not None else None
        if out is not None:              # one CUDA token: the residual add and this norm made by the router's launch
            return out
        if type(norm) is RMSNorm:        # a few CUDA tokens: the residual add and this norm in one launch
            h, x = small_ops.add_rms_norm(h, a, norm.weight, norm.eps, self._add_norm)
        else:
            h, x = self._add_norm(h, a)
        if getattr(self.mlp, "takes_residual", False):
            return self.mlp(x, residual=h)
        return h + self.mlp(x)

    def _add_norm(self, h, a):
        h = h + a
        return h, self.post_attention_layernorm(h)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, blocks: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        for blk, nxt in zip(blocks, blocks[1:]):    # an MoE that makes the next block's input norm (SoftmaxMoE)
            mlp = getattr(blk, "mlp", None)
            if mlp is not None and hasattr(mlp, "next_block"):
                mlp.next_block = (nxt,)


class CausalLM(nn.Module):
    """forward(tokens [T], cache) -> logits [T, V] (or [1, V] with last_only) and advances the cache."""

    # Checkpoint name table (see weights/loader.py): regex renames from checkpoint names to ours,
    # and the per-expert tensor names that make up our stacked expert tensors.
    CHECKPOINT: dict = {}

    def __init__(self, args: ModelArgs, blocks: list[nn.Module], rope: Rope | None):
        super().__init__()
        self.args = args
        self.model = Backbone(args, blocks)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = rope

    def make_cache(self, max_len: int, dtype, device) -> Cache:
        return Cache([blk.make_cache(max_len, dtype, device) for blk in self.model.layers], max_len)

    def rope_tables(self, positions: torch.Tensor, dtype):
        return self.rope(positions, dtype) if self.rope is not None else None

    def forward(self, tokens: torch.Tensor, cache: Cache, last_only: bool = False,
                pos: torch.Tensor | None = None, last: torch.Tensor | None = None) -> torch.Tensor:
        """`pos` (a 0-d device tensor) is the start position for CUDA-graph capture: shapes stay
        static, attention covers the whole cache under a mask, and the caller advances the cache.
        `last` (a [1] device tensor): the logits of that position only (a padded prefill graph's last real token)."""
        start = cache.length if pos is None else pos
        t = tokens.shape[0]
        if pos is None and start + t > cache.max_len:
            raise ValueError(f"{start + t} positions exceed the cache's {cache.max_len}")
        h = self.model.embed_tokens(tokens)
        if pos is None and self.rope is not None:
            rope = self.rope.span(start, t, h.dtype, h.device)   # cached tables: no per-step ops
        else:
            rope = self.rope_tables(start + torch.arange(t, device=tokens.device), h.dtype)
        for i, block in enumerate(self.model.layers):
            h = block(h, rope, cache[i], start)
        if pos is None:
            cache.advance(t)
        if last is not None:
            h = h.index_select(0, last)
        elif last_only:
            h = h[-1:]
        return self.lm_head(self.model.norm(h))
