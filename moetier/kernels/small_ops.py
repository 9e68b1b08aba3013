"""The import surface of the decode step's small fused ops: RMSNorm (with the residual add before
it) and the softmax top-k router (with its GEMV).
Triton (kernels/triton_small.py, triton_attention.py) on CUDA for a few tokens, else the twins passed in by the
caller (models/layers.py keeps the math). The backend follows kernels.ops; `use` overrides it (tests run the
kernels on CPU tensors under TRITON_INTERPRET=1).

    y = rms_norm(x, weight, eps, twin)           # x [..., N]; weight None | [N] | [R, N] over dim -2
    ids, w = softmax_topk(logits, k, norm, twin)  # logits [T, E]
    ids, w = router_topk(x, weight, k, norm, twin)  # x [1, D], weight [E, D]: the GEMV and the above, one launch
    s, y = add_rms_norm(h, a, weight, eps, twin)   # s = h + a, y = rms_norm(s): residual add + next norm
    s, y, ids, w = router_topk_add_norm(h, a, nw, eps, weight, k, norm)  # add_rms_norm, router_topk: one launch
    out = moe_block(h, a, nw, eps, weight, k, norm, planes)  # that, the experts and the residual add: one C call
    a = attn_block(h, nw, eps, planes, qw, kw, qk_eps, rope, pos, kv, nh, hkv, scale)  # norm + attention: one call
    y, pre = rms_norm_q8(x, weight, eps, twin)     # x [1, N]: y and its int8 copy for a QuantLinear GEMV (or None)
    made_norm_q8(x, weight, eps, y, pre)          # x's writer made those too: rms_norm_q8(x, ...) returns them
"""
from __future__ import annotations

import os

import torch

from ..runtime.kv_cache import KVCache
from . import ops

MAX_TOKENS = 64        # above this the step is a prefill chunk: the twins' big kernels are fine
_enabled = True
_choice = ops.OpBackend("fused decode op")
use = _choice.use


def set_enabled(on: bool) -> None:
    """EngineConfig.fused_decode (--no-fused-decode): off = always the twins."""
    global _enabled
    _enabled = bool(on)


def _triton(x, tokens: int) -> bool:
    if tokens > MAX_TOKENS or not x.is_contiguous():
        return False
    if not _enabled and _choice.name is None:
        return False
    name = _choice.get()
    return name == "triton" and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


CPU_SMALL = os.environ.get("MOETIER_CPU_SMALL", "1") != "0"     # 0: an eager CPU token takes the twins (A/B)


_cpu_module = None


def _cpu():
    """kernels.cpu, imported on first use (it builds the C library)."""
    global _cpu_module
    if _cpu_module is None:
        from . import cpu
        _cpu_module = cpu
    return _cpu_module


def _cpu_small(*ts) -> bool:
    """The C versions (kernels/cpu_small.c) serve this call: tensors of one float32 token on the CPU, the backend not
    forced (tests force "triton" to run the kernels under the interpreter), not traced (torch.export of the compiled
    CPU step keeps the twins' ops)."""
    if not (_enabled and CPU_SMALL and _choice.name is None) or torch.compiler.is_compiling():
        return False
    return _cpu().small_ops_ok(*ts)


def rms_norm(x, weight, eps: float, twin):
    """RMSNorm over the last dim: fp32 statistics, normalised x rounded to x's dtype, times the weight
    in x's dtype (what `twin(x)` computes). Eager CPU rows (a token [1, N], a prompt [T, N]) with a weight [N]:
    cpu_small.c (F.rms_norm took 2.5 ms for 512 x 2048 on the dev box's 2 threads: its CPU form is composite)."""
    if not x.is_cuda and x.dim() >= 2 and weight is not None and weight.dim() == 1 and _cpu_small(x, weight):
        return _cpu().rms_norm(x, weight, eps)
    if not _triton(x, x.shape[0] if x.dim() > 1 else 1) or (weight is not None and weight.dtype != x.dtype):
        return twin(x)
    from .triton_small import rms_norm as kernel
    return kernel(x, weight, eps)


def qk_norm_rope(qkv, h: int, hkv: int, dh: int, qw, kw, eps: float, cos, sin, twin):
    """A prompt's q and k heads [T, h + hkv, dh] from qkv's first (h + hkv) dh columns, each head RMSNorm'd (qw for q
    heads, kw for k heads, None: no norm) and rotated (cos / sin [T, rot], halves): one C pass on the CPU (eager float32;
    the torch ops of rms_norm + apply_rope took ~15 ms of a 512-token Qwen3-30B-A3B layer's prompt on 2 threads), else
    twin()."""
    if (not qkv.is_cuda and qkv.dim() == 2 and qkv.stride(-1) == 1 and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= dh
            and qkv.shape[-1] >= (h + hkv) * dh and cos.shape[0] == qkv.shape[0]
            and _cpu_small(cos, sin, *(w for w in (qw, kw) if w is not None))
            and qkv.dtype == torch.float32 and type(qkv) is torch.Tensor):
        return _cpu().qk_norm_rope(qkv, h, hkv, dh, qw, kw, eps, cos, sin)
    return twin()


def softmax_topk(logits, k: int, normalize: bool, twin):
    if not _triton(logits, logits.shape[0]):
        return twin(logits, k, normalize)
    from .triton_small import softmax_topk as kernel
    return kernel(logits, k, normalize)


ROUTER_MAX_EXPERTS = 256   # the router kernel's last program holds all E probabilities


def router_kernel_ok(x, weight, k: int) -> bool:
    """The one-launch router serves this call (one token on CUDA, matching dtypes, E <= 256)."""
    e = weight.shape[0]
    return (_triton(x, 1) and x.dim() == 2 and x.shape[0] == 1 and weight.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.is_contiguous()
            and weight.device == x.device and e <= ROUTER_MAX_EXPERTS and 0 < k <= e)


def router_topk(x, weight, k: int, normalize: bool, twin):
    """softmax_topk(F.linear(x, weight), k, normalize) for one token in one launch (kernels/triton_small.
    router_topk: logits rounded to x's dtype as F.linear returns them, then the softmax_topk kernel's
    math); `twin(x)` otherwise (several tokens, CPU, other dtypes)."""
    if not router_kernel_ok(x, weight, k):
        return twin(x)
    from .triton_small import router_topk as kernel
    return kernel(x, weight, k, normalize)


def rms_norm_q8_ok(x, weight) -> bool:
    """rms_norm_q8 runs its kernel for this call (one token on CUDA, N a multiple of 32, a matching weight [N])."""
    n = x.shape[-1]
    return (_triton(x, 1) and x.dim() == 2 and x.shape[0] == 1 and n % 32 == 0 and weight is not None
            and weight.dtype == x.dtype and weight.shape == (n,) and weight.is_contiguous()
            and weight.device == x.device)


def rms_norm_q8(x, weight, eps: float, twin):
    """(rms_norm(x, weight), its int8 copy (q, dx, xs) as triton_decode_q8.quantize makes it) for one token in one
    launch, for a QuantLinear that reads it (`pre`: the GEMV skips its quantizer); (twin(x), None) otherwise.
    When the launch that wrote x made them too (made_norm_q8), those."""
    if not rms_norm_q8_ok(x, weight):
        return twin(x), None
    made = getattr(x, "moetier_norm_q8", None)
    if made is not None and made[0] is weight and made[1] == eps:
        return made[2], made[3]
    from .triton_small import rms_norm_q8 as kernel
    return kernel(x, weight, eps)


def made_norm_q8(x, weight, eps: float, out, pre) -> None:
    """Note on x that the kernel which wrote x also made rms_norm_q8(x, weight, eps)'s (out, pre) bit for bit (the
    tiered decode's wait_add with the next layer's input norm): rms_norm_q8 then returns them instead of a launch.
    x must not change after (the decode step's hidden state goes straight into the next block)."""
    x.moetier_norm_q8 = (weight, eps, out, pre)


def _add_norm_kernel_ok(h, y, weight) -> bool:
    return (_triton(h, h.shape[0] if h.dim() > 1 else 1) and y.shape == h.shape and y.dtype == h.dtype
            and y.is_contiguous() and y.device == h.device and weight is not None and weight.dtype == h.dtype
            and weight.shape == h.shape[-1:] and weight.is_contiguous())


def add_rms_norm(h, y, weight, eps: float, twin):
    """(s, normed) = (h + y, RMSNorm(s)): the residual add and the following norm in one launch, s
    rounded to h's dtype as `h + y` is and normed as rms_norm's kernel computes it; `twin(h, y)`
    otherwise (many tokens, CPU, mixed dtypes)."""
    if not _add_norm_kernel_ok(h, y, weight):
        return twin(h, y)
    from .triton_small import add_rms_norm as kernel
    return kernel(h, y, weight, eps)


def add_norm_q8_on() -> bool:
    """A decode block's residual add after its MoE makes the next block's input norm and its int8 copy in the same
    launch (add_norm_q8; H200, 48 layers all on the GPU: 631 -> 668 tok/s, docs/perf-log.md session 29).
    MOETIER_ADD_NORM_Q8=0: two launches (A/B)."""
    return os.environ.get("MOETIER_ADD_NORM_Q8", "1") != "0"


def next_norm_q8(h, then):
    """The next decoder block's input RMSNorm where that block would call rms_norm_q8 on h with its kernel (then = its
    (input norm, attention): an RMSNorm before an attention that takes the int8 copy, models.base.Block), else None.
    The writer of h may make that norm itself (made_norm_q8): the tiered wait_add, add_norm_q8."""
    if then is None or not _triton(h, 1):       # an eager CPU token: no kernel to make it (and no import a call)
        return None
    from ..models.layers import RMSNorm
    norm, attn = then
    q8 = getattr(attn, "q8_input", None)
    if type(norm) is not RMSNorm or q8 is None or not q8(h) or not rms_norm_q8_ok(h, norm.weight):
        return None
    return norm


def add_norm_q8(h, y, then):
    """h + y, and where the next decoder block (then: its (input norm, attention)) would call rms_norm_q8 on it with
    its kernel (next_norm_q8), that norm and its int8 copy made by the same launch and noted on the sum (made_norm_q8:
    the next block's rms_norm_q8 returns them). Bit for bit `h + y` then rms_norm_q8. -> h + y."""
    norm = next_norm_q8(h, then) if add_norm_q8_on() else None
    if norm is None or y.shape != h.shape or y.dtype != h.dtype or not y.is_contiguous() or not h.is_contiguous():
        return h + y
    from .triton_small import add_norm_q8 as kernel
    s, out, pre = kernel(h, y, norm.weight, norm.eps)
    made_norm_q8(s, norm.weight, norm.eps, out, pre)
    return s


def router_add_norm_on() -> bool:
    """MOETIER_ROUTER_ADD_NORM=0: the decode block's residual add + norm and its router stay two launches (A/B)."""
    return os.environ.get("MOETIER_ROUTER_ADD_NORM", "1") != "0"


def router_add_norm_ok(h, a, norm_weight, weight, k: int) -> bool:
    """router_topk_add_norm serves this call: add_rms_norm and router_topk would both run their kernels (one token)
    and one launch gives their answers bit for bit (triton_small.router_add_norm_fits: x in one chunk of the
    router's tile, D >= 1024). In float32 too: session 19's last-bit differences on the H200 came with the float32
    prefill's index_add_, fixed since (models.layers.add_pairs); session 21 found float32 equal bit for bit."""
    if (h.dim() == 2 and h.shape[0] == 1 and a.shape == h.shape and norm_weight is not None
            and norm_weight.shape == h.shape[-1:] and weight.dim() == 2 and weight.shape[1] == h.shape[1]
            and 0 < k <= weight.shape[0] and _cpu_small(h, a, norm_weight, weight)):
        return True       # one eager CPU token: cpu_small.c (not bit-equal to the twin: float32 sums in its order)
    if not (_add_norm_kernel_ok(h, a, norm_weight) and router_kernel_ok(h, weight, k) and router_add_norm_on()):
        return False
    from .triton_small import router_add_norm_fits
    return router_add_norm_fits(weight.shape[0], h.shape[-1])


def router_topk_add_norm(h, a, norm_weight, eps: float, weight, k: int, normalize: bool):
    """(s, x, ids, w) = add_rms_norm(h, a, norm_weight, eps), then router_topk(x, weight, k, normalize), in one launch
    (kernels/triton_small.router_topk_add_norm) or one C call on the CPU (kernels/cpu_small.c), where
    router_add_norm_ok holds; the twin is those two. None (the C call only) where the logits hold a NaN."""
    if h.device.type == "cpu" and _cpu_small(h):
        return _cpu().router_topk_add_norm(h, a, norm_weight, eps, weight, k, normalize)
    from .triton_small import router_topk_add_norm as kernel
    return kernel(h, a, norm_weight, eps, weight, k, normalize)


def attn_block_ok(h, norm_weight, kv, window, sinks, nh: int, dh: int, start) -> bool:
    """attn_block serves this call: one eager CPU token that decode_attention's C kernel takes, an int position within
    its work bound (cpu.ATTN_C_MAX_WORK), float32 weights."""
    return (type(start) is int and norm_weight is not None and norm_weight.shape == h.shape[-1:]
            and decode_attention_ok(h, kv, window, sinks, False) and not _triton(h, 1) and _cpu_small(norm_weight)
            and (start + 1) * nh * dh <= _cpu().ATTN_C_MAX_WORK)


# The compiled CPU step's export sets this (runtime.cpu_compile): while it is on, a traced CPU token's block halves
# become the ops moetier::attn_block / moe_block (the eager step's C calls) instead of their modules' pieces.
TRACE_BLOCKS = False


def _traced_token(h, norm_weight) -> bool:
    """TRACE_BLOCKS, and h one float32 CPU token [1, D] with a float32 norm weight [D]."""
    return (TRACE_BLOCKS and not h.is_cuda and h.dim() == 2 and h.shape[0] == 1 and h.dtype == torch.float32
            and norm_weight is not None and norm_weight.shape == h.shape[-1:] and norm_weight.dtype == torch.float32)


def attn_block_traced_ok(h, norm_weight, kv, window, sinks, start) -> bool:
    """attn_block serves a traced call: TRACE_BLOCKS, one float32 CPU token, a 0-d position tensor, float32 caches."""
    return (_traced_token(h, norm_weight) and isinstance(start, torch.Tensor) and start.dim() == 0
            and window is None and sinks is None and isinstance(kv, KVCache)
            and kv.k.dtype == kv.v.dtype == torch.float32)


def moe_block_traced_ok(h, a, norm_weight) -> bool:
    """moe_block serves a traced call: TRACE_BLOCKS, one float32 CPU token."""
    return _traced_token(h, norm_weight) and a.dtype == torch.float32


def attn_block(h, norm_weight, eps: float, planes: tuple, q_w, k_w, qk_eps: float, rope: tuple, start, kv,
               nh: int, hkv: int, scale: float):
    """Attention.forward(RMSNorm(h) * norm_weight) for one CPU token where attn_block_ok (eager: one C call,
    kernels/cpu_small.c) or attn_block_traced_ok (the op moetier::attn_block, `start` a 0-d tensor) holds; planes:
    the qkv and o GEMVs' blocks (cpu_token_planes). None where a GEMV refuses its blocks (eager: the caller's modules
    then run)."""
    q_w = None if q_w is None else q_w.float().contiguous()
    k_w = None if k_w is None else k_w.float().contiguous()
    if torch.compiler.is_compiling():
        parts, ot, wo, q8 = planes
        (t0, w0), (t1, w1), (t2, w2) = (*parts, *((0, None),) * (3 - len(parts)))
        return torch.ops.moetier.attn_block(h, norm_weight, eps, w0, t0, w1, t1, w2, t2, wo, ot, q8, q_w, k_w, qk_eps,
                                            rope[0], rope[1], start, kv.k, kv.v, nh, hkv, scale)
    return _cpu().attn_block(h, norm_weight, eps, planes, q_w, k_w, qk_eps, rope[0].contiguous(), rope[1].contiguous(),
                             start, kv.k, kv.v, nh, hkv, scale)


def moe_block(h, a, norm_weight, eps: float, weight, k: int, normalize: bool, planes: tuple):
    """s + the experts' sum for router_topk_add_norm's choice, s = h + a (one eager CPU token where
    router_add_norm_ok holds and the experts give their C call's planes: cpu_token_planes), in one C call
    (kernels/cpu_small.c); traced (moe_block_traced_ok): the op moetier::moe_block. None where the logits hold a NaN
    (eager; the caller's twin then decides; the op gives NaN)."""
    if torch.compiler.is_compiling():
        gq, dq, gate, up, down, q8 = planes
        return torch.ops.moetier.moe_block(h, a, norm_weight, eps, weight, k, normalize, gate, up, down, gq, dq, q8)
    return _cpu().moe_block(h, a, norm_weight, eps, weight, k, normalize, planes)


def decode_attention_ok(x, kv, window, sinks, interleaved: bool) -> bool:
    """The fused decode attention serves this call (one token of a CUDA-graph step, or of an eager CPU step: plain
    KV cache)."""
    if not (x.shape[0] == 1 and window is None and sinks is None and not interleaved and type(kv) is KVCache
            and kv.k.dtype == x.dtype):
        return False
    return _triton(x, 1) or (_cpu_small(x, kv.k, kv.v) and kv.k.shape[1:] == kv.v.shape[1:])


def decode_attention(qkv, q_w, k_w, eps, cos, sin, pos, kv, h: int, hkv: int, scale: float, q8: bool = False):
    """qkv [1, (H + 2 Hkv) Dh] of one token at position `pos` (an int or a device tensor): q/k RMSNorm and RoPE, k/v
    into the cache, attention over [0, pos] -> [1, H Dh] (kernels/triton_attention.decode_attention; an eager CPU
    token kernels/cpu_small.c); q8: -> (out, its int8 copy for a QuantLinear o_proj, or None)."""
    if not qkv.is_cuda and not _triton(qkv, 1):
        q_w = None if q_w is None else q_w.float().contiguous()
        k_w = None if k_w is None else k_w.float().contiguous()
        out = _cpu().decode_attention(qkv, q_w, k_w, eps, cos.contiguous(), sin.contiguous(), int(pos), kv.k, kv.v,
                                      h, hkv, scale)
        return (out, None) if q8 else out
    if not isinstance(pos, torch.Tensor):
        pos = torch.tensor(pos, device=qkv.device)
    from .triton_attention import decode_attention as kernel
    return kernel(qkv, q_w, k_w, eps, cos, sin, pos, kv.k, kv.v, h, hkv, scale, q8=q8)
