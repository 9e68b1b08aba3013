"""Building blocks shared by the architectures: math only, no devices, files or caches policy.

Shapes: a sequence is flat, x [T, D] (T tokens of one sequence); heads are [T, H, Dh].
Module and parameter names follow the Hugging Face checkpoints, so most tensors load by name.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..kernels import ops, small_ops
from ..runtime.kv_cache import KVCache
from .quant_linear import QuantLinear, released_weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_ops.rms_norm(x, self.weight, self.eps, self.native)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one op (same math)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without the weight, over the last dim: computed in fp32, returned in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(rp: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale for rope types default, linear and yarn."""
    base = float(rp.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(rp["factor"]), 1.0
    if kind != "yarn":
        raise NotImplementedError(f"RoPE type {kind!r} is not supported yet (default, linear and yarn are)")
    factor = rp.get("factor") or max_position_embeddings / rp["original_max_position_embeddings"]
    orig = rp["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rp.get("attention_factor")
    if attn is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


class Rope(nn.Module):
    """cos/sin tables for positions; `apply` rotates the first `dim` features of each head."""

    def __init__(self, rp: dict, dim: int, max_position_embeddings: int, interleaved: bool = False):
        super().__init__()
        inv, self.scale = rope_inv_freq(rp, dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.dim = dim
        self.interleaved = interleaved
        self._tables: dict = {}  # (dtype, device) -> (cos, sin) [N, dim] for positions [0, N): see span

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def span(self, start: int, t: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(start + arange(t)) as views of tables kept per (dtype, device), grown by doubling:
        a decode step then costs two slices instead of ~8 small ops."""
        key = (dtype, torch.device(device))
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or cos.shape[0] < start + t:
            n = max(256, start + t, 2 * (0 if cos is None else cos.shape[0]))
            cos, sin = self._tables[key] = self.forward(torch.arange(n, device=device), dtype)
        return cos[start:start + t], sin[start:start + t]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [T, H, Dh]; cos/sin [T, R] with R <= Dh: rotate the first R features (partial RoPE)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:  # pairs (0,1),(2,3)... -> halves, as DeepSeek's checkpoints store them
        t, h, _ = rot.shape
        rot = rot.view(t, h, r // 2, 2).transpose(-1, -2).reshape(t, h, r)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = rot * cos + rotate_half(rot) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


# ---------------------------------------------------------------- attention
def causal_mask(t: int, s: int, start, window: int | None, device) -> torch.Tensor:
    """Bool [T, S]: query start+i sees key j when j <= start+i (and j > start+i-window).
    `start` is an int, or a device tensor in CUDA-graph decode (then S is the whole cache)."""
    q = (start + torch.arange(t, device=device))[:, None]
    k = torch.arange(s, device=device)[None, :]
    mask = k <= q
    if window:
        mask &= k > q - window
    return mask


def attend_in_bf16(kv, q: torch.Tensor) -> bool:
    """CPU attention of float32 activations over a cache that stores K / V as bf16 (`--kv-dtype bf16`), on a CPU that
    multiplies bf16 in hardware: it runs in bf16 (K / V as stored, so exactly; q rounded to bf16; torch's flash kernel
    accumulates in float32), prompts and one-token steps alike. A 512-token prompt's attention 16.3 -> 3.7 ms on 2 AMX
    cores; a step reads the stored K / V where the float32 path converted the whole cache first."""
    store = getattr(kv, "k", None)
    return (isinstance(store, torch.Tensor) and store.dtype == torch.bfloat16 and q.dtype == torch.float32
            and not q.is_cuda and _bf16_native())


def cached_attention(kv, q, k, v, start, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """k, v (this call's positions) into the cache kv, then attention over all of them: in bf16 where attend_in_bf16
    (K / V read as stored where the cache can give them without a conversion: CastKVCache.update_stored)."""
    bf16 = sinks is None and attend_in_bf16(kv, q)
    if bf16 and isinstance(start, int) and hasattr(kv, "update_stored"):
        k, v = kv.update_stored(start, k, v)
    else:
        k, v = kv.update(start, k, v)
    return attention(q, k, v, start, scale, window, sinks, bf16)


def _bf16_native() -> bool:
    from ..kernels.cpu import bf16_native
    return bf16_native()


def attention(q, k, v, start, scale: float, window: int | None = None,
              sinks: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
    """q [T, H, Dh], k [S, Hkv, Dh], v [S, Hkv, Dv] with S = start + T -> [T, H, Dv]
    (S = the whole cache when `start` is a device tensor: the mask does the rest). bf16 (attend_in_bf16): the
    products in bf16, the result in q's dtype."""
    if bf16 and sinks is None:
        return attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), start, scale, window).to(q.dtype)
    t, h, _ = q.shape
    s, hkv = k.shape[0], k.shape[1]
    if t == 1 and q.dtype == torch.float32 and sinks is None and not q.is_cuda and (window is None or s <= window):
        return one_token_attention(q, k, v, start, scale)
    # a fresh CPU prompt (keys = its own tokens, no window cut): is_causal instead of the mask (torch's CPU flash
    # kernel then skips the masked blocks: 512 tokens x 32 heads 19.6 -> 17.4 ms on 2 threads, the same bits)
    causal = (sinks is None and not q.is_cuda and t > 1 and t == s and isinstance(start, int) and start == 0
              and (window is None or t <= window))
    need_mask = not causal and (t > 1 or (window is not None and s > window) or isinstance(start, torch.Tensor))
    mask = causal_mask(t, s, start, window, q.device) if need_mask else None
    if sinks is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=hkv != h)
        return out[0].transpose(0, 1)
    # attention sinks (GPT-OSS): one extra logit per head that takes probability mass, no value
    rep = h // hkv
    kr = k.repeat_interleave(rep, dim=1).transpose(0, 1)           # [H, S, Dh]
    vr = v.repeat_interleave(rep, dim=1).transpose(0, 1)           # [H, S, Dv]
    scores = torch.matmul(q.transpose(0, 1), kr.transpose(1, 2)) * scale  # [H, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(h, t, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, vr).transpose(0, 1)


def one_token_attention(q, k, v, start, scale: float) -> torch.Tensor:
    """CPU decode (T = 1): two batched GEMVs per KV head group and a softmax; SDPA's flash kernel
    costs ~45 us of setup per call at this size. q [1, H, Dh], k [S, Hkv, Dh], v [S, Hkv, Dv] -> [1, H, Dv].
    With `start` a tensor (compiled decode over a longer KV view) keys past it are masked."""
    s, hkv, dh = k.shape
    h = q.shape[1]
    qg = (q * scale).view(hkv, h // hkv, dh)                              # [Hkv, R, Dh]
    scores = torch.bmm(qg, k.permute(1, 2, 0).to(q.dtype))               # [Hkv, R, S]
    if isinstance(start, torch.Tensor):
        scores = scores.masked_fill(torch.arange(s, device=q.device) > start, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v.transpose(0, 1).to(q.dtype)).view(1, h, v.shape[-1])  # [1, H, Dv]


class Attention(nn.Module):
    """Grouped-query attention with optional per-head q/k RMSNorm, biases, sinks, sliding window."""

    def __init__(self, args: ModelArgs, qk_norm: bool = False, sinks: bool = False,
                 window: int | None = None, o_bias: bool | None = None, rotary_dim: int | None = None):
        super().__init__()
        d, self.h, self.hkv, self.dh = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(d, self.h * self.dh, bias=bias)
        self.k_proj = nn.Linear(d, self.hkv * self.dh, bias=bias)
        self.v_proj = nn.Linear(d, self.hkv * self.dh, bias=bias)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=bias if o_bias is None else o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.dh, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.dh, args.rms_norm_eps)
        self.qk_norm = qk_norm
        self.sinks = nn.Parameter(torch.zeros(self.h)) if sinks else None
        self.window = window
        self.scale = self.dh ** -0.5
        self.qkv_rows = None   # q/k/v row counts of the stacked qkv_weight/qkv_bias, after fuse_qkv()
        self.qkv_q = None      # after fuse_qkv() of QuantLinear q/k/v (GGUF on CUDA): ModuleList, one per format run

    def make_cache(self, max_len: int, dtype, device) -> KVCache:
        return KVCache(max_len, (self.hkv, self.dh), (self.hkv, self.dh), dtype, device)

    def fuse_qkv(self) -> None:
        """One GEMM for q, k and v: the three weights (and biases) become views of one stacked
        tensor, so names, values and memory stay as they were. Call once the weights are loaded.
        GGUF blocks the loader kept (weights.loader._keep_blocks) are joined row-wise when q, k and v
        share a format; when they differ (Q4_K_M's Q6_K attn_v) the three stay apart on their own blocks."""
        lins = (self.q_proj, self.k_proj, self.v_proj)
        if any(isinstance(lin, QuantLinear) for lin in lins):     # subclasses with their own forward keep theirs
            if all(isinstance(lin, QuantLinear) for lin in lins) and type(self).forward is Attention.forward:
                # one GEMV per run of a format (Q4_K_M: q, k Q4_K then v Q6_K in some layers); the parts' planes
                # are freed
                runs = [[lins[0]]]
                for lin in lins[1:]:
                    if lin.fmt == runs[-1][-1].fmt and lin.in_features == runs[-1][-1].in_features:
                        runs[-1].append(lin)
                    else:
                        runs.append([lin])
                self.qkv_q = nn.ModuleList(QuantLinear.stack(r) if len(r) > 1 else r[0] for r in runs)
                self.q_proj = self.k_proj = self.v_proj = None
                self.qkv_rows = [lin.out_features for lin in lins]
            return
        blocks = [getattr(lin.weight, "ggml_blocks", None) for lin in lins]
        blocks = [b if b is not None and b[2] == lin.weight._version else None for b, lin in zip(blocks, lins)]
        if any(blocks) and len({b and (b[1], b[0].shape[1]) for b in blocks}) > 1:
            return
        released = [getattr(lin.weight, "released", False) for lin in lins]   # GGUF on the CPU: blocks, no values
        if any(released) and not all(released):
            return
        with torch.no_grad():
            n = [lin.weight.shape[0] for lin in lins]
            w = released_weight((sum(n), lins[0].weight.shape[1])) if all(released) else \
                torch.cat([lin.weight for lin in lins])                      # [(H + 2 Hkv) Dh, D]
            b = None if lins[0].bias is None else torch.cat([lin.bias for lin in lins])
            for lin, wp, bp in zip(lins, w.split(n), b.split(n) if b is not None else (None,) * 3):
                lin.weight = nn.Parameter(wp, requires_grad=False)
                lin.weight.released = all(released)
                if bp is not None:
                    lin.bias = nn.Parameter(bp, requires_grad=False)
        # non-persistent buffers: not in checkpoints, but named (compiled steps bind weights by name)
        self.register_buffer("qkv_weight", w, persistent=False)
        self.register_buffer("qkv_bias", b, persistent=False)
        self.qkv_rows = n
        if blocks[0] is not None:
            w.ggml_blocks = (torch.cat([b[0] for b in blocks]), blocks[0][1], w._version)

    def norm_token(self, h: torch.Tensor, norm: nn.Module, rope: tuple | None, kv: KVCache,
                   start) -> torch.Tensor | None:
        """forward(norm(h), rope, kv, start) for one CPU token in one C call (kernels.cpu.attn_block: the norm,
        the qkv GEMV, decode_attention, the o GEMV) where the engine gave this module its GEMVs' blocks
        (cpu_token_planes, runtime.cpu_compile): eagerly, and as the op moetier::attn_block while the compiled CPU
        step is traced (small_ops.TRACE_BLOCKS); None otherwise (Block norms and calls forward)."""
        args = self.token_block(h, norm, kv, start) if rope is not None else None
        if args is None:
            return None
        p, qw, kw, eps = args
        return small_ops.attn_block(h, norm.weight, norm.eps, p, qw, kw, eps, rope, start, kv, self.h, self.hkv,
                                    self.scale)

    def token_block(self, h: torch.Tensor, norm: nn.Module, kv: KVCache, start) -> tuple | None:
        """(planes, q norm weight, k norm weight, their eps) of norm_token's one C call for this token, or None where
        it makes none (runtime.cpu_step builds a session's calls from it)."""
        planes = self.__dict__.get("cpu_token_planes")
        if planes is None or type(norm) is not RMSNorm or type(self).forward is not Attention.forward:
            return None
        p = planes(h)
        if p is None:
            return None
        traced = torch.compiler.is_compiling()
        if traced and not small_ops.attn_block_traced_ok(h, norm.weight, kv, self.window, self.sinks, start):
            return None
        if not traced and not small_ops.attn_block_ok(h, norm.weight, kv, self.window, self.sinks, self.h, self.dh,
                                                      start):
            return None
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        return p, qw, kw, self.q_norm.eps if self.qk_norm else 0.0

    def q8_input(self, x: torch.Tensor) -> bool:
        """forward takes `pre`, x's int8 copy, for its qkv GEMVs (Block then norms and quantizes in one launch)."""
        return (type(self).forward is Attention.forward and self.qkv_q is not None and x.shape[0] == 1
                and x.is_cuda and (len(self.qkv_q) == 1 or ops.parts_share_x()))

    def _qkv(self, x: torch.Tensor, pre: tuple | None = None) -> torch.Tensor:
        """x @ [Wq; Wk; Wv]^T (+ biases) after fuse_qkv (pre: x's int8 copy for the QuantLinear GEMVs; runs of
        different formats share it and write one buffer: ops.qlinear_parts)."""
        if self.qkv_q is None:
            return F.linear(x, self.qkv_weight, self.qkv_bias)
        if len(self.qkv_q) == 1:
            return self.qkv_q[0](x, pre=pre)
        if not ops.parts_share_x():
            return torch.cat([lin(x) for lin in self.qkv_q], dim=-1)
        x2 = x.reshape(-1, x.shape[-1])
        return ops.qlinear_parts(x2 if x2.stride(-1) == 1 else x2.contiguous(), list(self.qkv_q), pre
                                 ).reshape(*x.shape[:-1], -1)

    def _fused_qkv(self, x: torch.Tensor, rope: tuple) -> tuple:
        """The forward's q/k/v after fuse_qkv: one GEMM, and q and k (adjacent heads of its output,
        [T, H + Hkv, Dh]) normed and rotated together: the same math as separately, half the ops."""
        t, nq, nk = x.shape[0], self.qkv_rows[0], self.qkv_rows[1]
        qkv = self._qkv(x)                                                   # [T, (H + 2 Hkv) Dh]
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        eps = self.q_norm.eps if self.qk_norm else 0.0

        def twin():
            qk = qkv[:, :nq + nk].view(t, self.h + self.hkv, self.dh)
            if self.qk_norm:   # per-head RMSNorm: q heads take q_norm's weight, k heads k_norm's
                w = torch.cat([qw.expand(self.h, -1), kw.expand(self.hkv, -1)])
                qk = small_ops.rms_norm(qk, w, eps, lambda y: rms_normalize(y, eps) * w)
            return apply_rope(qk, *rope)
        qk = small_ops.qk_norm_rope(qkv, self.h, self.hkv, self.dh, qw, kw, eps, *rope, twin)
        return qk[:, :self.h], qk[:, self.h:], qkv[:, nq + nk:].view(t, self.hkv, self.dh)

    def forward(self, x: torch.Tensor, rope: tuple, kv: KVCache, start: int, pre: tuple | None = None) -> torch.Tensor:
        """pre: x's int8 copy (q8_input), used by the decode path's qkv GEMV."""
        t = x.shape[0]
        if (t == 1 and (self.qkv_rows is not None or not x.is_cuda) and rope is not None
                and small_ops.decode_attention_ok(x, kv, self.window, self.sinks, False)):
            # CUDA decode: norm + rope + cache write, split-K attention over [0, start]: 3 launches
            # (eager steps too, so a graph replay and an eager step compute the same numbers); an eager CPU token:
            # one C call (kernels/cpu_small.c), q/k/v fused or not (a model loaded without the engine: the same bits)
            qkv = self._qkv(x, pre) if self.qkv_rows is not None else \
                torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            eps = self.q_norm.eps if self.qk_norm else 0.0
            q8 = isinstance(self.o_proj, QuantLinear)   # its GEMV takes the output's int8 copy (one launch fewer)
            out = small_ops.decode_attention(qkv, qw, kw, eps, rope[0], rope[1], start, kv, self.h, self.hkv,
                                             self.scale, q8=q8)
            return self.o_proj(out[0], pre=out[1]) if q8 else self.o_proj(out)
        if self.qkv_rows is not None and not torch.compiler.is_compiling():
            q, k, v = self._fused_qkv(x, rope)   # eager only: the compiled step ran 3% faster with the form below
        else:
            if self.qkv_rows is not None:
                q, k, v = self._qkv(x).split(self.qkv_rows, -1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(t, self.h, self.dh), k.view(t, self.hkv, self.dh), v.view(t, self.hkv, self.dh)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = cached_attention(kv, q, k, v, start, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(t, self.h * self.dh))


# ---------------------------------------------------------------- feed-forward
class MLP(nn.Module):
    """Dense SwiGLU feed-forward (dense layers, shared experts)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class DenseExperts(nn.Module):
    """All experts of one layer as stacked tensors, computed in place.

    gate_up_proj [E, 2I, D] (gate rows first, then up rows), down_proj [E, D, I]; optional biases
    gate_up_bias [E, 2I], down_bias [E, D]. `act(gate, up)` is the gated activation.
    forward(x [T, D], ids [T, k], w [T, k]) -> [T, D] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, bias: bool = False,
                 act: Callable = swiglu):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * hidden))
            self.down_bias = nn.Parameter(torch.zeros(num_experts, dim))
        else:
            self.gate_up_bias = self.down_bias = None
        self.act = act

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on rows x [n, D] -> [n, D]."""
        half = self.__dict__.get("_half")     # 16-bit copies for an eager CPU token (cpu_compile._half_expert_copies)
        if half is not None and x.shape[0] == 1 and x.dtype == torch.float32 and not torch.compiler.is_compiling():
            return self._expert_half(e, x, *half)
        h = F.linear(x, self.gate_up_proj[e], None if self.gate_up_bias is None else self.gate_up_bias[e])
        gate, up = h.chunk(2, dim=-1)
        return F.linear(self.act(gate, up), self.down_proj[e],
                        None if self.down_bias is None else self.down_bias[e])

    def _expert_half(self, e: int, x: torch.Tensor, tid: int, gate_up: torch.Tensor, down: torch.Tensor):
        """`expert` for one float32 row on the 16-bit copies (uint8 [E, N, 2K]): the C matvec, float32 products."""
        from ..kernels import cpu
        h = cpu.qlinear_op(x.contiguous(), gate_up[e], tid, False)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e]
        gate, up = h.chunk(2, dim=-1)
        y = cpu.qlinear_op(self.act(gate, up).contiguous(), down[e], tid, False)
        return y if self.down_bias is None else y + self.down_bias[e]

    def half_call(self, x: torch.Tensor) -> bool:
        """Whether the layer's k experts for x run in one C call on their 16-bit copies (`_half`, made by
        runtime.cpu_compile for a 16-bit checkpoint on the CPU): one float32 row, SwiGLU, no biases."""
        return ("_half" in self.__dict__ and x.shape[0] == 1 and x.dtype == torch.float32 and self.act is swiglu
                and self.gate_up_bias is None)

    def half_planes(self) -> tuple:
        """(type id, gate, up, down) of the 16-bit copies, as the buffers the module names (a traced step takes them
        as its constants): gate and up are the halves of gate_up's rows."""
        i = self.gate_up_half.shape[1] // 2
        return self._half[0], self.gate_up_half[:, :i], self.gate_up_half[:, i:], self.down_half

    def cpu_token_planes(self, x: torch.Tensor) -> tuple | None:
        """(gate type, down type, gate, up, down, q8) of the one C call forward makes for x (an eager CPU token on the
        16-bit copies: half_call), for a caller that fuses the router and the residual add around it
        (SoftmaxMoE.add_norm_forward -> kernels.cpu.moe_block, eagerly or as the traced op); None otherwise."""
        if not self.half_call(x):
            return None
        tid, gate, up, down = self.half_planes()
        return tid, tid, gate, up, down, False

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.half_call(x) and not torch.compiler.is_compiling():
            # an eager CPU token of a 16-bit checkpoint: the layer's k experts in one C call on the 16-bit copies
            from ..kernels import cpu
            tid, gate, up, down = self.half_planes()
            return cpu.moe_tokens((tid, tid), gate, up, down, x, ids, w).to(x.dtype)
        if x.is_cuda and x.shape[0] <= ops.MAX_DECODE_TOKENS and ops.kernel_available(x, self.act):
            # fused Triton decode kernels: no host sync, CUDA-graph capturable
            biases = None if self.gate_up_bias is None else (self.gate_up_bias, self.down_bias)
            return ops.moe_decode(x, ids, w, self.gate_up_proj, self.down_proj, self.act, biases)
        if x.is_cuda and x.dtype == torch.bfloat16 and self.gate_up_bias is None and hasattr(torch, "_grouped_mm"):
            return grouped_mm_experts(x, ids, w, self.gate_up_proj, self.down_proj, self.act)[0]   # (no host sync)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return gathered_experts(x, ids, w, self)
        return grouped_experts(x, ids, w, self.num_experts, self.expert)


def gathered_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: DenseExperts) -> torch.Tensor:
    """No host sync (CUDA-graph capturable): gather each (token, slot)'s weights and bmm.
    Copies k expert matrices per token, so it is only the correctness fallback for small T;
    kernels.ops' fused decode kernel is the fast path."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)[:, :, None]                       # [T*k, D, 1]
    h = torch.bmm(ex.gate_up_proj[flat], xs)[..., 0]                      # [T*k, 2I]
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[flat]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(ex.down_proj[flat], ex.act(gate, up)[:, :, None])[..., 0]  # [T*k, D]
    if ex.down_bias is not None:
        y = y + ex.down_bias[flat]
    return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)


def grouped_mm_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, act: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 prefill over all experts' float weights gate_up [E, 2I, D], down [E, D, I]: pairs sorted
    by expert, one grouped GEMM per projection (torch._grouped_mm; measured faster than our Triton
    grouped kernel for bf16). No host sync: the per-expert counts and group ends come from a
    scatter-add on the device (torch.bincount on CUDA reads the maximum id back to the host first); the k rows of a
    token added by add_pairs. -> (out [T, D], rows per expert [E] on the device)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    offs = counts.cumsum(0).to(torch.int32)                                          # group ends
    h = torch._grouped_mm(x[rows], gate_up.transpose(-2, -1), offs=offs)             # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(act(gate, up).contiguous(), down.transpose(-2, -1), offs=offs)
    out = ops.combine_pairs(y, order, w, k, x.dtype)     # CUDA: y * w and add_pairs in one pass
    if out is not None:
        return out, counts
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    return add_pairs(x, rows, order, y, k), counts


def add_pairs(x: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, ys: torch.Tensor, k: int,
              fp32_sum: bool | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, D] (x's dtype): each token's k weighted expert rows ys [T*k, D] (sorted pairs: pair order[i] of token
    rows[i], order a permutation of all T*k pairs) added up, into zeros or into `into` (in place). fp32_sum (default:
    on CUDA): back to (token, j) order and summed in fp32 (as kernels.triton_moe.moe_grouped does), because index_add_
    there adds by atomics in a varying order: two prefills of one prompt gave different last bits (docs/perf-log.md,
    session 19). Else index_add_ (on the CPU: ascending expert order, what _one_token_experts reproduces)."""
    if not (ys.is_cuda if fp32_sum is None else fp32_sum):
        return (torch.zeros_like(x) if into is None else into).index_add_(0, rows, ys.to(x.dtype))
    pairs = torch.empty_like(ys)
    pairs[order] = ys
    out = pairs.view(-1, k, ys.shape[-1]).sum(1, dtype=torch.float32).to(x.dtype)
    return out if into is None else into.add_(out)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, num_experts: int,
                    run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sort the T*k (token, expert) pairs by expert, run each used expert once over its rows,
    scale by the routing weights and add back per token (in ascending expert order, as
    transformers does). One host sync (the per-expert counts)."""
    t, k = ids.shape
    if t == 1 and not x.is_cuda:
        return _one_token_experts(x, ids, w, run)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = order // k                                   # token of each sorted pair
    xs = x[rows]                                        # [T*k, D]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = run(e, xs[start:start + n])
            start += n
    ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
    return add_pairs(x, rows, order, ys, k)


def _one_token_experts(x, ids, w, run):
    """T = 1 on the CPU: the same sum as grouped_experts (ascending expert order, fp32 accumulation
    like index_add_, so bit-identical) without the sort/bincount/index_add dispatch overhead."""
    acc = None
    for e, wj in sorted(zip(ids[0].tolist(), w[0].tolist())):   # w is already x's dtype: exact floats
        y = (run(e, x) * wj).float()
        acc = y if acc is None else acc.add_(y)                   # 0 + a + b == a + b: same bits
    return acc.to(x.dtype)


# ---------------------------------------------------------------- routers
def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k (renormalised if asked). -> ids [T, k], w [T, k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(logits.dtype)


class SoftmaxRouter(nn.Module):
    """Linear gate -> softmax -> top-k (Qwen3-MoE, Mixtral, OLMoE)."""

    def __init__(self, dim: int, num_experts: int, k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.k, self.normalize = k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one token on CUDA: GEMV + softmax + top-k in one launch; else the two steps below
        return small_ops.router_topk(x, self.weight, self.k, self.normalize, self.native)

    def native(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return small_ops.softmax_topk(F.linear(x, self.weight), self.k, self.normalize, softmax_topk)


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-V3 / GLM4-MoE router. Sigmoid scores [T, E]; experts are chosen by score +
    e_score_correction_bias, only inside the best `topk_group` of `n_group` equal groups (a group
    scores as the sum of its top 2); the weights are the chosen experts' uncorrected scores,
    renormalised if asked, times `scaling`. -> ids [T, k], w [T, k]."""

    def __init__(self, dim: int, num_experts: int, k: int, n_group: int = 1, topk_group: int = 1,
                 normalize: bool = True, scaling: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        # a parameter (not a buffer) so it loads from the checkpoint like any other weight
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()        # [T, E], fp32 as trained
        choice = scores + self.e_score_correction_bias.float()
        t, e = choice.shape
        if self.n_group > 1:
            per = e // self.n_group
            groups = choice.view(t, self.n_group, per)
            group_scores = groups.topk(min(2, per), dim=-1).values.sum(dim=-1)          # [T, G]
            keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
        ids = torch.topk(choice, self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        if self.normalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (w * self.scaling).to(x.dtype)


class SoftmaxMoE(nn.Module):
    """Softmax top-k router + routed SwiGLU experts (Qwen3-MoE, Mixtral, OLMoE)."""
    takes_residual = True       # forward(x, residual) = residual + forward(x) (Block's add, fused where it can be)

    def __init__(self, dim: int, num_experts: int, k: int, normalize: bool, hidden: int):
        super().__init__()
        self.gate = SoftmaxRouter(dim, num_experts, k, normalize)
        self.experts = DenseExperts(num_experts, dim, hidden)
        self.next_block = ()        # (the next decoder block,): models.base.Backbone sets it (a tuple: no submodule)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # tiered experts inside a captured decode step: the router, the doorbell and the residual add fused
        routed = getattr(self.experts, "routed", None)
        out = routed(x, self.gate, residual) if routed is not None and residual is not None else None
        if out is not None:
            return out
        ids, w = self.gate(x)             # [T, k]
        y = self.experts(x, ids, w)
        return y if residual is None else residual + y

    def add_norm_forward(self, h: torch.Tensor, a: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        """s + forward(norm(s)) with s = h + a (Block's residual add and post-attention norm), the add and the norm
        made by the router's launch (one CUDA token: small_ops.router_add_norm_ok); None otherwise (Block adds,
        norms and calls forward)."""
        gate = self.gate
        if type(gate) is not SoftmaxRouter or type(norm) is not RMSNorm:
            return None
        if small_ops.TRACE_BLOCKS and torch.compiler.is_compiling():   # the compiled CPU step being traced
            planes = getattr(self.experts, "cpu_token_planes", None)
            planes = planes(h) if planes is not None and small_ops.moe_block_traced_ok(h, a, norm.weight) else None
            if planes is not None:          # the layer's one op (moetier::moe_block)
                return small_ops.moe_block(h, a, norm.weight, norm.eps, gate.weight, gate.k, gate.normalize, planes)
        if not small_ops.router_add_norm_ok(h, a, norm.weight, gate.weight, gate.k):
            return None
        routed = getattr(self.experts, "add_norm_routed", None)     # tiered experts inside a captured decode step
        out = routed(h, a, norm, gate) if routed is not None else None
        if out is not None:
            return out
        planes = self.token_planes(h)
        if planes is not None:           # an eager CPU token: router, experts and the residual add in one C call
            return small_ops.moe_block(h, a, norm.weight, norm.eps, gate.weight, gate.k, gate.normalize, planes)
        out = small_ops.router_topk_add_norm(h, a, norm.weight, norm.eps, gate.weight, gate.k, gate.normalize)
        if out is None:                  # NaN logits in the CPU's C router: the Block's own ops decide
            return None
        s, x, ids, w = out
        return small_ops.add_norm_q8(s, self.experts(x, ids, w), self.next_input())

    def token_planes(self, h: torch.Tensor) -> tuple | None:
        """The experts' planes of add_norm_forward's one C call for an eager CPU token (their cpu_token_planes), or
        None (runtime.cpu_step builds a session's calls from them)."""
        planes = getattr(self.experts, "cpu_token_planes", None)
        return planes(h) if planes is not None and not h.is_cuda else None

    def next_input(self) -> tuple[nn.Module, nn.Module] | None:
        """(input norm, attention) of the decoder block after this one (next_block), or None (the last block)."""
        nb = self.next_block[0] if self.next_block else None
        norm, attn = getattr(nb, "input_layernorm", None), getattr(nb, "self_attn", None)
        return (norm, attn) if norm is not None and attn is not None else None
