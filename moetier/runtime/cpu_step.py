"""The eager CPU decode token's decoder layers in one C call (kernels/cpu_small.c `moetier_layers`).

An eager CPU token already computes each layer as two C calls (the attention half: Attention.norm_token ->
kernels.cpu.attn_block; the MoE half: SoftmaxMoE.add_norm_forward -> kernels.cpu.moe_block), and between them runs
~45 us of Python a layer (the modules' checks, tensors, the ctypes arguments; dev box): as much as the C work of a
small model's layer. Where every layer of a session's model takes both calls, their arguments are built once a
session (`EagerLayers.get`) and one C call runs all the layers: the same calls in the same order, so the same bits.
A layer where a call does not complete (a GEMV refusing its blocks, NaN router logits) is finished, with the layers
after it, by the modules. MOETIER_CPU_LAYERS=0 turns this off (A/B)."""
from __future__ import annotations

import ctypes
import os

import torch

from ..kernels import cpu as cpu_kernels
from ..kernels import small_ops
from ..models.base import Block, CausalLM
from ..models.layers import Attention, RMSNorm, SoftmaxMoE, SoftmaxRouter

_p, _i64, _i, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class AttnArgs(ctypes.Structure):
    """cpu_small.c attn_args: moetier_attn_block's arguments without h, the rope tables, the position, the output."""
    _fields_ = [("nw", _p), ("w", _p * 3), ("wo", _p), ("qw", _p), ("kw", _p), ("kc", _p), ("vc", _p),
                ("s", _i64 * 3), ("n", _i64 * 3), ("o_stride", _i64), ("t", _i * 3), ("ot", _i), ("q8", _i),
                ("nh", _i), ("hkv", _i), ("dh", _i), ("eps", _f), ("qk_eps", _f), ("scale", _f)]


class MoeArgs(ctypes.Structure):
    """cpu_small.c moe_args: moetier_moe_block's arguments without h, a and the output."""
    _fields_ = [("nw", _p), ("rw", _p), ("gate", _p), ("up", _p), ("down", _p), ("g_estride", _i64),
                ("g_rstride", _i64), ("d_estride", _i64), ("d_rstride", _i64), ("I", _i64), ("e", _i), ("k", _i),
                ("normalize", _i), ("gq", _i), ("dq", _i), ("q8", _i), ("eps", _f)]


def _attn_args(block, kv, h, keep: list) -> AttnArgs | None:
    """The attention half's arguments where Attention.norm_token would make its C call for this session's tokens
    (Attention.token_block's checks at position 0; EagerLayers.__call__ checks the position's bound a token)."""
    attn, norm = block.self_attn, block.input_layernorm
    args = attn.token_block(h, norm, kv, 0) if type(attn).forward is Attention.forward else None
    if args is None or len(args[0][0]) > 3 or kv.k.dtype != torch.float32 or kv.v.dtype != torch.float32:
        return None
    (parts, ot, wo, q8), qw, kw, qk_eps = args
    qw, kw = (None if w is None else w.float().contiguous() for w in (qw, kw))
    keep += [args, qw, kw]
    a = AttnArgs(nw=norm.weight.data_ptr(), wo=wo.data_ptr(), qw=qw.data_ptr() if qw is not None else None,
                 kw=kw.data_ptr() if kw is not None else None, kc=kv.k.data_ptr(), vc=kv.v.data_ptr(),
                 o_stride=wo.stride(0), ot=ot, q8=int(q8), nh=attn.h, hkv=attn.hkv, dh=kv.k.shape[-1],
                 eps=norm.eps, qk_eps=qk_eps, scale=attn.scale)
    for i, (t, w) in enumerate(parts):
        a.t[i], a.w[i], a.s[i], a.n[i] = t, w.data_ptr(), w.stride(0), w.shape[0]
    return a


def _moe_args(block, h, keep: list) -> MoeArgs | None:
    """The MoE half's arguments where SoftmaxMoE.add_norm_forward would make its C call (an eager CPU token), else
    None."""
    mlp, norm = block.mlp, block.post_attention_layernorm
    if type(mlp) is not SoftmaxMoE or type(mlp.gate) is not SoftmaxRouter or type(norm) is not RMSNorm:
        return None
    gate = mlp.gate
    if getattr(mlp.experts, "add_norm_routed", None) is not None \
            or not small_ops.router_add_norm_ok(h, h, norm.weight, gate.weight, gate.k):
        return None
    p = mlp.token_planes(h)
    if p is None:
        return None
    gq, dq, g, u, d, q8 = p
    keep += [p, norm.weight, gate.weight]
    return MoeArgs(nw=norm.weight.data_ptr(), rw=gate.weight.data_ptr(), gate=g.data_ptr(), up=u.data_ptr(),
                   down=d.data_ptr(), g_estride=g.stride(0), g_rstride=g.stride(1), d_estride=d.stride(0),
                   d_rstride=d.stride(1), I=g.shape[1], e=gate.weight.shape[0], k=gate.k, normalize=int(gate.normalize),
                   gq=gq, dq=dq, q8=int(q8), eps=norm.eps)


class EagerLayers:
    """step(token) -> logits [V] for one eager CPU token of `model` on `cache`, its layers in one C call."""

    decode_path = "eager"

    def __init__(self, model, cache, attn: list, moe: list, keep: list):
        n, d = len(attn), model.args.hidden_size
        self.model, self.cache, self.n = model, cache, n
        self.attn, self.moe, self.keep = (AttnArgs * n)(*attn), (MoeArgs * n)(*moe), keep
        self.kv = [(kv.k, kv.v) for kv in cache.layers]        # the buffers the arguments point at
        self.h, self.a, self.tmp = (torch.empty(1, d) for _ in range(3))
        self.max_pos = min(cpu_kernels.ATTN_C_MAX_WORK // (b.self_attn.h * b.self_attn.dh)
                           for b in model.model.layers) - 1     # attn_block_ok's work bound
        self.rc = ctypes.c_int()

    @classmethod
    def get(cls, model, cache) -> "EagerLayers | None":
        """The session's EagerLayers (made at its first token, kept on the cache), or None where a layer does not
        take both block calls (then the modules run every token), where MOETIER_CPU_LAYERS=0, or where the C
        kernels are not loaded."""
        if os.environ.get("MOETIER_CPU_LAYERS", "1") == "0":
            return None
        got = cache.__dict__.get("_eager_layers")
        if got is not None and got.model is model \
                and all(kv.k is k and kv.v is v for kv, (k, v) in zip(cache.layers, got.kv)):
            return got
        if type(model).forward is not CausalLM.forward or model.rope is None or cpu_kernels.backend() != "c":
            return None     # (a model's own forward: its token is not embed -> layers -> norm -> lm_head)
        layers = model.model.layers
        h = torch.zeros(1, model.args.hidden_size)
        attn, moe, keep = [], [], []
        for blk, kv in zip(layers, cache.layers):
            if type(blk).forward is not Block.forward or not hasattr(blk, "self_attn"):
                return None
            a, m = _attn_args(blk, kv, h, keep), _moe_args(blk, h, keep)
            if a is None or m is None:
                return None
            attn.append(a)
            moe.append(m)
        got = cache.__dict__["_eager_layers"] = cls(model, cache, attn, moe, keep)
        return got

    def __call__(self, token: int) -> torch.Tensor:
        model, cache = self.model, self.cache
        start = cache.length
        if start > self.max_pos or start + 1 > cache.max_len:     # the modules' path (its attention; its error)
            return model(torch.tensor([token]), cache, last_only=True)[-1]
        h = self.h
        h.copy_(model.model.embed_tokens(torch.tensor([token])))
        cos, sin = model.rope.span(start, 1, torch.float32, "cpu")
        cos, sin = cos.contiguous(), sin.contiguous()
        stop = cpu_kernels._lib.moetier_layers(
            self.n, self.attn, self.moe, h.data_ptr(), self.a.data_ptr(), self.tmp.data_ptr(), h.shape[-1],
            cos.data_ptr(), sin.data_ptr(), cos.shape[-1], start, torch.get_num_threads(), ctypes.byref(self.rc))
        if stop:                # layer i's half did not complete: the modules finish it and the layers after it
            i, half = divmod(stop - 1, 2)
            if self.rc.value == -3:
                raise MemoryError("eager CPU decode layers: out of memory")
            blocks, rope = model.model.layers, (cos, sin)
            h = blocks[i](h, rope, cache[i], start) if half == 0 else blocks[i].mlp_half(h, self.a)
            for j in range(i + 1, self.n):
                h = blocks[j](h, rope, cache[j], start)
        cache.advance(1)
        return model.lm_head(model.model.norm(h))[-1]
