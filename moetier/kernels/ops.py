"""The only import surface for expert kernels. Call sites use `moe` (or `moe_decode` / `moe_grouped`);
the backend is chosen once: MOETIER_KERNELS=auto (Triton on CUDA when it imports, else torch),
torch, or triton; `set_backend` overrides it (EngineConfig, tests).

    out[t] = sum_j w[t, j] * (down[s] @ act(gate_up[s] @ x[t] + b_gu[s]) + b_d[s]),  s = slot_ids[t, j]

gate_up [S, 2I, D] (gate rows, then up rows) and down [S, D, I] are a float tensor (fmt "bf16",
"f16", "f32" or "dense": the tensor's own dtype) or, for a GGML format (KERNEL_FORMATS: "Q8_0", "Q4_K", ...),
the dict of planes `quant.repack(fmt, raw [S, N, row_bytes])` gives. A slot id < 0 adds nothing
(a miss computed elsewhere). `act`: "swiglu", Act("clamped_swiglu", alpha, limit), or the model's
callable (layers.swiglu / partial(clamped_swiglu, alpha=, limit=) are recognised; any other runs
on the torch twin). biases: None or (gate_up_bias [S, 2I] | None, down_bias [S, D] | None).
The intermediate h is rounded to x's dtype between the projections (as the kernels keep it).
Down may be stored in another format than gate_up (llama.cpp's Q4_K_M keeps gate/up in Q4_K and
some layers' down in Q6_K): pass fmt=(gate_up format, down format), or down_fmt=.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

MAX_DECODE_TOKENS = 8        # up to this many tokens: the GEMV decode kernels, above: grouped GEMM
# each matches its twin; the second line's formats are read as stored (kernels/triton_rawq.py: element gathers)
KERNEL_FORMATS = ("dense", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ3_XXS", "IQ2_XXS", "Q2_K", "Q3_K",
                  "IQ4_XS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M")
_FLOAT_NAMES = {None, "dense", "float", "bf16", "bfloat16", "f16", "fp16", "float16", "f32", "fp32", "float32"}


@dataclass(frozen=True)
class Act:
    kind: str = "swiglu"        # swiglu | clamped_swiglu (GPT-OSS)
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"unknown activation {self.kind!r}: use 'swiglu' or 'clamped_swiglu'")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return torch.nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def as_act(act) -> Act | None:
    """An Act for the kernels, or None when `act` is a callable they do not implement."""
    if isinstance(act, Act):
        return act
    if isinstance(act, str):
        return Act(act)
    if getattr(act, "__name__", None) == "swiglu":
        return Act()
    if (isinstance(act, functools.partial) and getattr(act.func, "__name__", None) == "clamped_swiglu"
            and not act.args and set(act.keywords) == {"alpha", "limit"}):
        return Act("clamped_swiglu", float(act.keywords["alpha"]), float(act.keywords["limit"]))
    return None


def normalize_fmt(fmt) -> str:
    """"dense" for float weights, else the GGML format name ("Q4_K")."""
    if fmt is None or isinstance(fmt, str) and fmt.lower() in _FLOAT_NAMES:
        return "dense"
    from moetier.quant.formats import get_format
    return get_format(fmt).name


def split_fmt(fmt, down_fmt=None) -> tuple[str, str]:
    """fmt (one format, or (gate_up format, down format)) and down_fmt (None: as gate_up) ->
    normalized (gate_up format, down format)."""
    if isinstance(fmt, (tuple, list)):
        fmt, down_fmt = fmt
    fmt = normalize_fmt(fmt)
    return fmt, fmt if down_fmt is None else normalize_fmt(down_fmt)


# ------------------------------------------------------------------ backend (chosen once)
_backend: str | None = None
_interpret = False


def set_backend(name: str = "auto") -> str:
    """auto | torch | triton -> the backend in use."""
    global _backend, _interpret
    name = (name or "auto").lower()
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"MOETIER_KERNELS={name!r}: use auto, torch or triton")
    _interpret = os.environ.get("TRITON_INTERPRET") == "1"
    ok = _triton_importable()
    if name == "triton" and not ok:
        raise RuntimeError("MOETIER_KERNELS=triton but triton does not import: pip install triton, "
                           "or use MOETIER_KERNELS=torch")
    if name == "auto":
        name = "triton" if ok and torch.cuda.is_available() else "torch"
    _backend = name
    return name


def backend() -> str:
    if _backend is None:
        set_backend(os.environ.get("MOETIER_KERNELS", "auto"))
    return _backend


class OpBackend:
    """One op family's backend on top of the one chosen here: `name` None follows `backend()`
    (or `default`); `use("torch" | "triton")` overrides it inside a block (tests, benchmarks)."""

    def __init__(self, what: str, default: str | None = None):
        self.what, self.default, self.name = what, default, None

    def get(self) -> str:
        return self.name or self.default or backend()

    @contextlib.contextmanager
    def use(self, name: str):
        if name not in ("torch", "triton"):
            raise ValueError(f"unknown {self.what} backend {name!r}: use 'torch' or 'triton'")
        old, self.name = self.name, name
        try:
            yield
        finally:
            self.name = old


def _triton_importable() -> bool:
    try:
        from . import triton_moe  # noqa: F401
        return True
    except ImportError:
        return False


def _use_triton(x: torch.Tensor, fmt: str, act: Act | None, down_fmt: str | None = None) -> bool:
    down_fmt = down_fmt or fmt          # float with GGML (one projection each): the twin only
    return (backend() == "triton" and (x.is_cuda or _interpret) and fmt in KERNEL_FORMATS
            and down_fmt in KERNEL_FORMATS and (fmt == "dense") == (down_fmt == "dense")
            and act is not None and x.numel() > 0)


def kernel_available(x: torch.Tensor, act="swiglu", fmt="bf16", down_fmt=None) -> bool:
    """Whether moe/moe_decode/moe_grouped run the fused kernels for these inputs (no host sync,
    CUDA-graph capturable); otherwise they run the torch twin, which syncs."""
    fmt, down_fmt = split_fmt(fmt, down_fmt)
    return _use_triton(x, fmt, as_act(act), down_fmt)


def _on_device(x):
    """Triton launches on the current CUDA device: make it x's."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _kernel_args(x, gate_up, down, fmt, act, biases, down_fmt=None):
    from .triton_moe import ACT_CODES, Weights
    gu, dn = Weights(gate_up, fmt), Weights(down, down_fmt or fmt)
    d = x.shape[1]
    if gu.k != d or dn.n != d or gu.n != 2 * dn.k or gu.slots != dn.slots:
        raise ValueError(f"expert shapes disagree: x [T, {d}], gate_up [{gu.slots}, {gu.n}, {gu.k}], "
                         f"down [{dn.slots}, {dn.n}, {dn.k}]; expected [S, 2I, D] and [S, D, I]")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, gu, dn, ACT_CODES[act.kind], act.alpha, act.limit, tuple(biases or (None, None))


def _check_out(out, x):
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(x.shape)} with unit last stride; "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")


# ------------------------------------------------------------------ public ops
def _experts(kernel_name: str, native, x, slot_ids, w, gate_up, down, act, biases, fmt, out, down_fmt):
    """The Triton kernel `kernel_name` of triton_moe when it runs these inputs, else `native`."""
    (fmt, down_fmt), a = split_fmt(fmt, down_fmt), as_act(act)
    if not _use_triton(x, fmt, a, down_fmt):
        return native(x, slot_ids, w, gate_up, down, act, biases, fmt, out, down_fmt)
    from . import triton_moe
    x, gu, dn, code, alpha, limit, b = _kernel_args(x, gate_up, down, fmt, a, biases, down_fmt)
    _check_out(out, x)
    with _on_device(x):
        return getattr(triton_moe, kernel_name)(x, slot_ids, w, gu, dn, code, alpha, limit, b, out)


def moe_decode(x, slot_ids, w, gate_up, down, act="swiglu", biases=None, fmt="bf16", out=None, down_fmt=None):
    """Few tokens (T <= 8): fused GEMV kernels, two launches, no host sync (CUDA-graph capturable)."""
    return _experts("moe_decode", moe_decode_native, x, slot_ids, w, gate_up, down, act, biases, fmt, out, down_fmt)


def moe_grouped(x, slot_ids, w, gate_up, down, act="swiglu", biases=None, fmt="bf16", out=None, down_fmt=None):
    """Many tokens (prefill): pairs sorted by slot, grouped GEMMs on tensor cores, no host sync."""
    return _experts("moe_grouped", moe_grouped_native, x, slot_ids, w, gate_up, down, act, biases, fmt, out,
                    down_fmt)


def combine_pairs(ys: torch.Tensor, order: torch.Tensor, w: torch.Tensor, k: int, dtype) -> torch.Tensor | None:
    """A prefill's expert rows ys [T*k, D] (sorted: row i is pair order[i] = t*k + j) -> [T, D] in dtype, each
    token's k rows times w [T, k] (rounded to ys' dtype) added in float32: one Triton pass on CUDA for 16-bit ys
    (triton_moe.combine_pairs; float32 rows there would have their product fused into the add); None elsewhere (the
    caller's torch ops: models.layers.add_pairs)."""
    if not (ys.is_cuda and backend() == "triton" and ys.dtype in (torch.bfloat16, torch.float16)
            and ys.is_contiguous()):
        return None
    from .triton_moe import combine_pairs as kernel
    with _on_device(ys):
        return kernel(ys, order, w, k, dtype)


def moe(x, slot_ids, w, gate_up, down, act="swiglu", biases=None, fmt="bf16", out=None, down_fmt=None):
    """The experts of one MoE layer: decode kernels up to MAX_DECODE_TOKENS tokens, grouped above."""
    op = moe_decode if x.shape[0] <= MAX_DECODE_TOKENS else moe_grouped
    return op(x, slot_ids, w, gate_up, down, act, biases, fmt, out, down_fmt)


def dequantize(fmt: str, planes: dict[str, torch.Tensor], idx: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Slots idx (int64, on the planes' device) of GGML planes (quant.repack) -> float [n, N, K] in
    dtype: one Triton pass on CUDA (kernels.triton_dequant), else the torch dequantizer in groups
    of DEQUANT_GROUP (which bounds its float32 temporaries). Bit-identical either way."""
    first = next(iter(planes.values()))
    if backend() == "triton" and first.is_cuda and fmt in KERNEL_FORMATS and fmt != "dense":
        from .triton_dequant import dequantize as triton_dequantize
        return triton_dequantize(fmt, planes, idx, dtype, out)
    from moetier.quant.repack import dequantize_repacked
    n = idx.shape[0]
    for a in range(0, n, DEQUANT_GROUP):
        part = dequantize_repacked(fmt, {k: v[idx[a:a + DEQUANT_GROUP]] for k, v in planes.items()})
        if out is None:
            out = torch.empty(n, *part.shape[1:], dtype=dtype, device=first.device)
        out[a:a + DEQUANT_GROUP] = part
    return out


DEQUANT_GROUP = 16      # experts the torch dequantizer takes at a time

# ------------------------------------------------------------------ embedding rows from host memory
def embed_rows(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """weight [V, D] in host memory (pinned on CUDA machines), tokens [...] on any device -> [..., D] on the
    tokens' device: one Triton gather reading the table over PCIe on CUDA (no host sync, graph-capturable),
    else `embed_rows_native`."""
    if backend() == "triton" and (tokens.is_cuda or _interpret):
        from .triton_embed import gather_rows
        with _on_device(tokens):
            return gather_rows(weight, tokens)
    return embed_rows_native(weight, tokens)


def embed_rows_native(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The twin of embed_rows: the rows looked up on the host, then copied to the tokens' device."""
    return torch.nn.functional.embedding(tokens.cpu(), weight).to(tokens.device)


# ------------------------------------------------------------------ dense linear on GGML planes
MAX_GEMV_ROWS = 8                   # decode rows: the int8 GEMV (triton_qlinear); more: dequantize + cuBLAS
DENSE_CHUNK_BYTES = 64 << 20        # bound on the float rows of W a qlinear with more rows holds at once


def qlinear(x: torch.Tensor, planes: dict[str, torch.Tensor], fmt: str, bias: torch.Tensor | None = None,
            pre: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W [N, K] in GGML planes ([1, N, K'] each, quant.repack) -> [..., N] in x's
    dtype. Up to MAX_GEMV_ROWS rows on CUDA: x quantized to int8 per 32-block and one dp4a GEMV (no host sync,
    CUDA-graph capturable); otherwise W is dequantized to x's dtype in row chunks of at most DENSE_CHUNK_BYTES
    and multiplied by torch. pre: x's int8 copy (q, dx, xs) made by the kernel that produced x (the GEMV then
    skips its quantizer). out: [T, N] (unit last stride; a column slice of a wider buffer is fine) to write into,
    x 2-D then."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if gemv_applies(x2, fmt):
        from . import triton_qlinear
        with _on_device(x):
            return triton_qlinear.gemv(x2, planes, fmt, bias, pre=pre, out=out).reshape(*shape[:-1], -1)
    y = qlinear_chunked(x2, planes, fmt, bias)
    return y.reshape(*shape[:-1], -1) if out is None else out.copy_(y)


def gemv_applies(x2: torch.Tensor, fmt: str) -> bool:
    """qlinear runs the int8 GEMV for these rows x2 [T, K] of a weight in fmt (else the dequantized chunks)."""
    if not (backend() == "triton" and (x2.is_cuda or _interpret) and 0 < x2.shape[0] <= MAX_GEMV_ROWS):
        return False
    from . import triton_qlinear
    return triton_qlinear.supports(fmt, x2.shape[1])


def parts_share_x() -> bool:
    """QuantLinear parts of different formats over one x (q / k / v) go through qlinear_parts (H200, Q4_K_M's mixed
    qkv: 3.93 us with the norm's copy of x against 9.45, session 23); MOETIER_QKV_PARTS=0: each part quantizes x
    itself, then a cat (the path before)."""
    return os.environ.get("MOETIER_QKV_PARTS", "1") != "0"


def qlinear_parts(x: torch.Tensor, parts: list, pre: tuple | None = None) -> torch.Tensor:
    """x [T, K] @ [W_1; W_2; ...]^T for QuantLinear parts of different formats (Q4_K_M's q / k in Q4_K and v in Q6_K)
    -> [T, sum N_i], each part's GEMV writing its columns of one buffer from one int8 copy of x (pre, or one quantizer
    launch): two launches fewer per extra part than a quantizer + GEMV per part and a cat. Bit for bit the same."""
    out = x.new_empty(x.shape[0], sum(p.out_features for p in parts))
    if pre is None and all(gemv_applies(x, p.fmt) for p in parts):
        from . import triton_qlinear
        with _on_device(x):
            pre = triton_qlinear.x_int8(x)
    a = 0
    for p in parts:
        qlinear(x, p.planes, p.fmt, p.bias, pre=pre, out=out[:, a:a + p.out_features])
        a += p.out_features
    return out


def qlinear_chunked(x: torch.Tensor, planes: dict[str, torch.Tensor], fmt: str, bias=None) -> torch.Tensor:
    """qlinear by dequantized row chunks (bounded float memory), x [T, K]."""
    first = next(iter(planes.values()))
    n, k = first.shape[1], x.shape[1]
    rows = max(1, DENSE_CHUNK_BYTES // (k * x.element_size()))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    idx = torch.zeros(1, dtype=torch.long, device=first.device)
    for r0 in range(0, n, rows):
        w = dequantize(fmt, {name: p[:, r0:r0 + rows] for name, p in planes.items()}, idx, x.dtype)[0]
        out[:, r0:r0 + rows] = x @ w.T
    return out if bias is None else out.add_(bias)


def qlinear_native(x: torch.Tensor, planes: dict[str, torch.Tensor], fmt: str, bias=None, act_q8: bool = False
                   ) -> torch.Tensor:
    """The twin of qlinear in float32 (act_q8: x quantized as the GEMV does), result in x's dtype."""
    from moetier.quant.repack import dequantize_repacked
    w = dequantize_repacked(fmt, {name: p[0] for name, p in planes.items()})
    xf = _q8_native(x.float()) if act_q8 else x.float()
    y = xf @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


# ------------------------------------------------------------------ the pure-torch twin
def _dense_weight(weight, fmt: str, s: int) -> torch.Tensor:
    """Slot s as float32 [N, K]."""
    if fmt == "dense":
        return weight[s].float()
    from moetier.quant.repack import dequantize_repacked
    return dequantize_repacked(fmt, {name: plane[s] for name, plane in weight.items()})


def moe_native(x, slot_ids, w, gate_up, down, act="swiglu", biases=None, fmt="bf16", out=None, down_fmt=None,
               act_q8: bool | tuple[bool, bool] = False):
    """forward_native of moe_decode / moe_grouped: same signature and result, in float32 (h rounded
    to x's dtype between the projections). Syncs with the host (one loop step per used slot):
    for tests, CPU runs and machines without Triton. act_q8: x and h quantized to int8 per 32-block
    first, as the v5 decode kernels do (triton_decode_q8.quantize_native); a pair (x, h) where only one of
    the projections runs v5 (gate_up and down in formats with different default variants)."""
    qx, qh = act_q8 if isinstance(act_q8, tuple) else (act_q8, act_q8)
    same = lambda v: v      # noqa: E731
    q8x, q8h = (_q8_native if qx else same), (_q8_native if qh else same)
    fmt, down_fmt = split_fmt(fmt, down_fmt)
    fn = as_act(act) or act
    t, k = slot_ids.shape
    flat = slot_ids.reshape(-1).long()
    wf = w.reshape(-1).float()
    rows = torch.arange(t * k, device=x.device) // k
    gb, db = biases or (None, None)
    y = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    for s in torch.unique(flat).tolist():
        if s < 0:
            continue
        sel = (flat == s).nonzero()[:, 0]
        h = q8x(x[rows[sel]].float()) @ _dense_weight(gate_up, fmt, s).T
        if gb is not None:
            h = h + gb[s].float()
        gate, up = h.chunk(2, dim=-1)
        ys = q8h(fn(gate, up).to(x.dtype).float()) @ _dense_weight(down, down_fmt, s).T
        if db is not None:
            ys = ys + db[s].float()
        y[sel] = ys * wf[sel, None]
    res = y.view(t, k, -1).sum(1)
    return res.to(x.dtype) if out is None else out.copy_(res)


def _q8_native(v: torch.Tensor) -> torch.Tensor:
    from .triton_decode_q8 import quantize_native
    return quantize_native(v)


moe_decode_native = moe_grouped_native = moe_native
