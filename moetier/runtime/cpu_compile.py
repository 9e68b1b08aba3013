"""The CPU decode step compiled ahead of time by AOTInductor (generated C++), cached on disk.

Eager decode of a small model on the CPU is dispatch-bound (~1,000 tiny ops per token; see
docs/perf-log.md). torch.compile removed the dispatch but kept Dynamo's guards and a Python
wrapper (~0.2 ms a token) and recompiled in every process (4-18 s). Here the one-token step
`model(token [1], cache, pos=p)` (the static-shape path CUDA graphs use) is exported once and
built by AOTInductor into a package of a few MB: the weights are not in it, they are bound by name
to the model's own tensors at load (no copy). The package is cached per model shape, dtype,
thread count, torch version, CPU and moetier source, so only the first build pays (15-25 s on the
2-core dev box); later processes load it in milliseconds. Attention reads KV views cut to the next
multiple of `BUCKET` positions past the token (a dynamic dimension of the export); experts take
`fused_gather_experts` (no host sync) inside the graph; GGUF experts kept packed (QuantExperts) stay
one call of the torch op moetier::moe_tokens (C kernels on the stored blocks), which the package calls
back through the dispatcher (C++ kernels, cpu_ops.cpp). Float weights that are exactly Q4_0 / Q8_0 values
(a GGUF file's attention and lm_head, dequantized at load) get those blocks back as `<name>_q` buffers and
the step multiplies on them (moetier::qlinear); with Q8_ACTIVATIONS these products use int8 activations.

    step = CpuDecode.get(model, build=True)   # None when not cached and build=False, or not compilable
    logits = step(cache, token_id)            # [1, V]; advances the cache

Under `--cpu-compile auto` (the default) a model without a cached package decodes eagerly while a
detached, low-priority process builds it (runtime/cpu_build.py): the next run loads it, and a
long-lived engine (serve, chat) switches to it at the next request once it lands.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import os
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import torch

from ..kernels import cpu as cpu_kernels
from ..kernels import small_ops
from ..memory import hugepages
from ..memory.budget import ram_info
from ..models.layers import Attention, DenseExperts
from ..models.quant_linear import released_weight
from ..models.quant_experts import FUSED_CPU_TOKENS
from ..quant.formats import get_format
from .kv_cache import Cache, KVCache

log = logging.getLogger(__name__)

BUCKET = 128  # attention view granularity (positions)
# The traced step's decoder blocks as the eager step's two C calls each (moetier::attn_block / moe_block ops) where
# their modules give the blocks; MOETIER_TRACE_BLOCKS=0: the modules' pieces (A/B).
TRACE_BLOCKS = os.environ.get("MOETIER_TRACE_BLOCKS", "1") != "0"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetier" / "cpu_decode"


def wanted(mode: str, device: str, tiers, cache: Cache) -> bool:
    """`mode` is EngineConfig.cpu_compile: on = load or build the compiled step; auto = use it when a
    package for this model is cached already, else decode eagerly and build it in the background;
    off = eager, never built. Only plain KV caches on the CPU without memory tiers qualify."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_compile must be auto, on or off (got {mode!r})")
    if mode == "off" or device != "cpu" or tiers is not None:
        return False
    return all(type(layer) is KVCache for layer in cache.layers)  # recurrent/int8 caches: eager


class _KVView(KVCache):
    """A KVCache over given k/v views (writes land in the real cache), built inside the graph."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


def _graph_friendly_experts(model: torch.nn.Module) -> None:
    """While tracing, DenseExperts take fused_gather_experts (no `.tolist()` host sync); eager calls
    keep their own path. Installed once per model, per instance (model code untouched)."""
    _fused_quant_experts(model)
    for m in model.modules():
        if getattr(m, "fused_cpu", False):
            continue
        if type(m) is not DenseExperts and isinstance(m, DenseExperts) and not hasattr(m, "gate_up_proj"):
            raise NotImplementedError(f"{type(m).__name__} ({m.extra_repr()}) has no graph path on the CPU "
                                      "(the fused kernel takes SwiGLU experts without biases); pass "
                                      "--dequantize-experts to compile this model")
        if isinstance(m, DenseExperts) and "forward" not in m.__dict__:
            eager = m.forward

            def forward(self, x, ids, w, eager=eager):
                if torch.compiler.is_compiling():
                    if self.half_call(x):       # 16-bit copies: the layer in one moetier::moe_tokens
                        tid, gate, up, down = self.half_planes()
                        return torch.ops.moetier.moe_tokens(x, ids, w.float(), gate, up, down, tid, tid,
                                                            False).to(x.dtype)
                    return fused_gather_experts(x, ids, w, self)
                return eager(x, ids, w)
            m.forward = types.MethodType(forward, m)


def _fused_quant_experts(model: torch.nn.Module) -> None:
    """QuantExperts with the fused CPU call (one torch op) run it while tracing and for eager calls of few tokens on the
    CPU (fused_experts). Installed once per instance."""
    for m in model.modules():
        if getattr(m, "fused_cpu", False) and "forward" not in m.__dict__:
            eager = m.forward

            def forward(self, x, ids, w, eager=eager):
                if torch.compiler.is_compiling() or (ids.shape[0] <= FUSED_CPU_TOKENS and x.device.type == "cpu"):
                    return fused_experts(self, x, ids, w)
                return eager(x, ids, w)
            m.forward = types.MethodType(forward, m)
            m.cpu_token_planes = types.MethodType(_token_planes, m)


def _planes(m) -> tuple:
    """(gate type, down type, gate, up, down, q8) of a fused QuantExperts' C call: its x8 copies where _x8_experts made
    them (int8 activations), else its stored blocks (Q8_ACTIVATIONS)."""
    x8 = m.__dict__.get("_x8_types")
    if x8 and Q8_ACTIVATIONS:
        b = m._buffers
        return x8[0], x8[1], b["gate_x8"], b["up_x8"], b["down_x8"], True
    return (get_format(m.fmt).type_id, get_format(m.down_fmt).type_id, m.gate_raw, m.up_raw, m.down_raw,
            Q8_ACTIVATIONS)


def _token_planes(m, x: torch.Tensor) -> tuple | None:
    """QuantExperts.cpu_token_planes (installed with the fused forward): the planes of a CPU token's call."""
    if x.is_cuda or x.shape[0] != 1 or x.dtype != torch.float32:
        return None
    return _planes(m)


def fused_experts(m, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A QuantExperts layer for few tokens in one C call with int8 activations (Q8_ACTIVATIONS), on its x8 copies
    where _x8_experts made them: what the compiled step and an eager decode step run."""
    if not (m.__dict__.get("_x8_types") and Q8_ACTIVATIONS):
        return m.forward_fused(x, ids, w, q8=Q8_ACTIVATIONS)
    gq, dq, gate, up, down, _ = _planes(m)
    # traced: the torch op (the compiled step keeps it whole); eager: its CPU kernel without the dispatcher (~6 us)
    call = torch.ops.moetier.moe_tokens if torch.compiler.is_compiling() else cpu_kernels.moe_tokens_op
    return call(x, ids, w.float(), gate, up, down, gq, dq, True)


def fused_gather_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: DenseExperts) -> torch.Tensor:
    """gathered_experts written as multiply + reduce, so inductor fuses the weight gather into the
    dot products instead of copying k expert matrices per token. x [T, D], ids/w [T, k] -> [T, D]."""
    t, k = ids.shape
    flat = ids.reshape(-1)                                                  # [T*k]
    xs = x.repeat_interleave(k, dim=0)                                      # [T*k, D]
    h = (ex.gate_up_proj[flat] * xs[:, None, :]).sum(-1)                    # [T*k, 2I]
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[flat]
    gate, up = h.chunk(2, dim=-1)
    y = (ex.down_proj[flat] * ex.act(gate, up)[:, None, :]).sum(-1)         # [T*k, D]
    if ex.down_bias is not None:
        y = y + ex.down_bias[flat]
    return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)


# tried in this order (fewest bytes first); BF16 / F16: the float32 values of a 16-bit checkpoint (the default model's
# bf16 safetensors run in float32 on the CPU), half the bytes of float32, products in float32 (kernels.cpu.HALF_TYPES)
QUANT_COPY_TYPES = ("Q4_0", "Q8_0", "BF16", "F16")
# The compiled step's Q4_0 / Q8_0 products (packed experts, quantized copies) dot activations rounded to
# int8 per 32 values, as llama.cpp does: ~1.5x faster kernels; measured KL vs F32 in docs/perf-log.md.
Q8_ACTIVATIONS = True


def _exact_blocks(w: torch.Tensor):
    """(uint8 blocks, GGML type id) of the first format in QUANT_COPY_TYPES whose dequantized blocks are
    exactly `w` (a GGUF tensor dequantized at load: re-quantizing gives its blocks back), else None."""
    from ..quant.formats import dequantize, get_format
    from ..quant.pack import quantize
    for name in QUANT_COPY_TYPES:
        fmt = get_format(name)
        for part in (w[:64], w):          # a cheap look at the first rows before the whole tensor
            raw = quantize(part, name).view(part.shape[0], -1)
            if not torch.equal(dequantize(raw, fmt, tuple(part.shape)), part):
                break
        else:
            return raw, fmt.type_id
    return None


def _stored_blocks(w: torch.Tensor):
    """(uint8 blocks, GGML type id) the GGUF loader kept for `w` (weights.loader._keep_blocks) while they
    still are `w`: not edited in place since (version counter) and its first rows dequantize to them."""
    from ..quant.formats import dequantize
    kept = getattr(w, "ggml_blocks", None)
    if kept is None or kept[2] != w._version or kept[0].shape[0] != w.shape[0]:
        return None
    if getattr(w, "released", False):        # loaded without values (weights.loader release_dense): the file's blocks
        return kept[0], kept[1]
    rows = min(64, w.shape[0])
    if not torch.equal(dequantize(kept[0][:rows].contiguous(), kept[1], (rows, w.shape[1])), w[:rows]):
        return None
    return kept[0], kept[1]


INTERLEAVE = os.environ.get("MOETIER_X8", "1") != "0"     # 0: Q4_0 / Q8_0 copies keep the file's rows (A/B)


def _quantized_copies(model: torch.nn.Module) -> None:
    """dense_copies, then the packed experts' interleaved copies (_x8_experts) and 16-bit experts' copies
    (_half_expert_copies). Once per model."""
    if cpu_kernels.backend() != "c" or getattr(model, "_quant_copies_done", False):
        return
    model._quant_copies_done = True
    dense_copies(model)
    _x8_experts(model)
    _half_expert_copies(model)          # stacked float experts of a 16-bit checkpoint: 16-bit copies


def dense_copies(model: torch.nn.Module) -> None:
    """Float weights of Linear modules (and 2-D `*weight` buffers: Attention.qkv_weight) get their GGML
    blocks as a buffer `<name>_q`: the blocks a GGUF file stored them in (any C-kernel format: Q6_K
    lm_heads, Q4_K attention), else the Q4_0 / Q8_0 blocks they are exactly the values of. The compiled
    step multiplies on them with the C kernels (3.8-7x fewer bytes than float32). Q4_0 / Q8_0 / IQ4_NL / Q5_1 / Q4_K
    copies of 8k rows are kept interleaved by 8 rows (kernels.cpu.INTERLEAVED: the one-token matvec with rows in lanes;
    on the default model's lm_head, Zen 4 box, Q4_0 2.1x faster; Q4_K 1.4-1.9x from cache, bench/bench_cpu_layout.py).
    MOETIER_X8=0: the file's rows. Then the floats are released (_release_floats, unless MOETIER_FLOAT_COPIES=1) and
    every eager call multiplies on the copies (_eager_quant_linears). Engine.load calls it for a CPU model (its GGUF
    linears were loaded released: no values until here). Once per model."""
    if cpu_kernels.backend() != "c" or model.__dict__.get("_dense_copies_done", False):
        return
    model._dense_copies_done = True
    found = []                                          # (module, attribute, weight)
    for m in model.modules():
        names = ["weight"] if isinstance(m, torch.nn.Linear) else []
        names += [n for n, b in m.named_buffers(recurse=False) if n.endswith("weight") and b is not None]
        found += [(m, a, getattr(m, a)) for a in names]
    found = [(m, a, w) for m, a, w in found if w is not None and w.dim() == 2 and w.dtype == torch.float32
             and w.device.type == "cpu" and w.shape[1] % 32 == 0]
    largest = {}                                        # storage -> most elements a weight of it has
    for _, _, w in found:
        key = w.untyped_storage().data_ptr()
        largest[key] = max(largest.get(key, 0), w.numel())
    for m in model.modules():
        m._quant_copies = {}
    for m, a, w in found:
        if w.numel() < largest[w.untyped_storage().data_ptr()]:
            continue                                    # part of a fused weight (fuse_qkv's q/k/v views)
        stored = _stored_blocks(w)
        hit = stored or _exact_blocks(w.detach())
        if hit is not None:
            blocks, tid = hit
            if tid in cpu_kernels.INTERLEAVED and blocks.shape[0] % 8 == 0 and Q8_ACTIVATIONS and INTERLEAVE \
                    and cpu_kernels.interleaved_supported(tid):
                x8 = hugepages.copy(blocks)     # rows in lanes, in C in place (no temporaries: a 235B's lm_head)
                x8 = x8.clone() if x8 is blocks else x8     # (never the file's own bytes)
                cpu_kernels.interleave_inplace(x8, tid)
                if stored is not None:          # the file's rows stay for a prompt's qgemm (no copy to undo)
                    m.__dict__.setdefault("_file_rows", {})[a] = (blocks, tid)
                blocks, tid = x8, cpu_kernels.INTERLEAVED[tid]
            elif stored is None:
                blocks = hugepages.copy(blocks)   # made here: on 2 MiB pages (the file's own views cost no copy)
            m.register_buffer(f"{a}_q", blocks, persistent=False)
            m._quant_copies[a] = tid
    _release_floats(model, found)
    _eager_quant_linears(model)         # every eager reader of a released weight now takes its copy


# Packed experts (QuantExperts, the file's rows) get a copy interleaved by 8 rows for the one-token C call
# (moetier_moe_tokens with x8 ids), as the dense copies: Qwen3-30B-A3B's layer of 8 Q4_0 experts from RAM on the 2-core
# Zen 4 box read 8.5 -> 10.8 GB/s on 1 thread and 15.4 -> 22.0 on 2 (Q8_0 8.1 -> 14.2 and 16.3 -> 22.3; session 23).
# The copy costs the experts' bytes again in RAM (the file's rows stay for the prefill's tile): made only where
# MemAvailable holds twice the experts. MOETIER_X8_EXPERTS=0: never.
X8_EXPERTS = os.environ.get("MOETIER_X8_EXPERTS", "1") != "0"
# The decision of the process whose background build this process runs (cpu_build.build_from_spec): the package's
# key names the copies, so the build makes them exactly where that process did, whatever RAM is free here
x8_decided: bool | None = None


def _x8_experts(model: torch.nn.Module) -> None:
    """QuantExperts with the fused CPU call, formats with an x8 kernel and rows in multiples of 8: `gate_x8`, `up_x8`,
    `down_x8` buffers (cpu_kernels.interleave_inplace of copies) and `_x8_types` (their INTERLEAVED ids)."""
    if not (X8_EXPERTS and Q8_ACTIVATIONS) or x8_decided is False:
        return
    todo = [m for m in model.modules() if getattr(m, "fused_cpu", False) and getattr(m, "gate_raw", None) is not None
            and all(cpu_kernels.interleaved_supported(get_format(f).type_id) for f in (m.fmt, m.down_fmt))
            and m.gate_raw.shape[1] % 8 == 0 and m.down_raw.shape[1] % 8 == 0]
    need = sum(t.nbytes for m in todo for t in (m.gate_raw, m.up_raw, m.down_raw))
    if not todo or (x8_decided is None and ram_info()[0] < 2 * need):
        return
    for m in todo:
        ids = []
        for name, f in (("gate", m.fmt), ("up", m.fmt), ("down", m.down_fmt)):
            raw, tid = getattr(m, f"{name}_raw"), get_format(f).type_id
            x8 = hugepages.empty(raw.nbytes).view(raw.dtype).view(raw.shape)   # a copy, on 2 MiB pages
            x8.copy_(raw)
            cpu_kernels.interleave_inplace(x8.view(-1, raw.shape[-1]), tid)   # groups of 8 rows stay in one expert
            m.register_buffer(f"{name}_x8", x8, persistent=False)
            ids.append(cpu_kernels.INTERLEAVED[tid])
        m._x8_types = (ids[0], ids[2])



# A CPU-only run multiplies every dense weight that has a quantized copy on the copy: one token through the C GEMV,
# a prompt through qgemm (_prefill_qgemm) or the copy dequantized DEQUANT_CHUNK_BYTES of float rows at a time into
# MKL's GEMM (_dequant_gemm). So the float32 weight the loader made beside the blocks is released: a 235B-A22B file's
# attention alone is ~27 GB of float32 that llama.cpp never holds; the default model's RSS in docs/perf-log.md
# (session 42). The weight stays a tensor of its shape (the trace swaps it for its copy by identity, _QuantLinears;
# package_key and reprs read its shape) viewing one NaN, so a reader of the values that was missed computes NaN
# rather than plausible numbers. MOETIER_FLOAT_COPIES=1 keeps the floats (A/B); _drop_quantized_copies restores them.
KEEP_FLOATS = os.environ.get("MOETIER_FLOAT_COPIES", "0") == "1"
DEQUANT_CHUNK_BYTES = 8 << 20


def _release_floats(model: torch.nn.Module, found: list) -> None:
    """Release the float weights among `found` ((module, attribute, weight) of dense_copies) whose copy every eager and
    traced reader takes (_eager_quant_linears: a Linear's weight, attention's stacked qkv_weight, with fuse_qkv's q, k,
    v views of it), as models.quant_linear.released_weight; weights loaded released stay so. Recorded in
    model._released_floats for _restore_floats. A weight loaded released that got no copy (not expected) is
    dequantized from its blocks here, with a warning: no forward ever reads the NaN."""
    views = {}                                          # storage -> its (module, attribute, weight) entries
    for m, a, w in found:
        views.setdefault(w.untyped_storage().data_ptr(), []).append((m, a, w))
    model._released_floats = []
    for group in views.values():
        m, a, w = max(group, key=lambda e: e[2].numel())
        ok = a in m._quant_copies and (a == "qkv_weight" and len(group) == 4
                                       or isinstance(m, torch.nn.Linear) and a == "weight" and len(group) == 1)
        if getattr(w, "released", False):
            if not ok:
                log.warning("cpu_compile: %s.%s was loaded without its float values but has no quantized copy; "
                            "dequantizing it", type(m).__name__, a)
                _set_float(m, a, cpu_kernels.dequantize_rows(w.ggml_blocks[1], w.ggml_blocks[0]))
                continue
        elif KEEP_FLOATS or not ok:
            continue
        else:
            _set_float(m, a, released_weight(tuple(w.shape)))
        model._released_floats.append((m, a, getattr(w, "ggml_blocks", None)))
        m.__dict__.setdefault("_released", set()).add(a)


def _set_float(m: torch.nn.Module, a: str, w: torch.Tensor) -> None:
    """m's weight `a` := w (a Parameter where it was one); attention's qkv_weight: q/k/v_proj's weights its row views
    again (fuse_qkv)."""
    released = getattr(w, "released", False)
    if a in m._parameters:
        w = torch.nn.Parameter(w, requires_grad=False)
        m._parameters[a] = w
    else:
        m._buffers[a] = w
    w.released = released
    if a == "qkv_weight":
        for lin, part in zip((m.q_proj, m.k_proj, m.v_proj), w.split(m.qkv_rows)):
            lin.weight = torch.nn.Parameter(part, requires_grad=False)
            lin.weight.released = released


def _restore_floats(model: torch.nn.Module) -> None:
    """The float weights _release_floats released, dequantized back from their copies (bit for bit the loader's)."""
    for m, a, kept in model.__dict__.pop("_released_floats", []):
        blocks, tid = m._buffers[f"{a}_q"], m._quant_copies[a]
        base = cpu_kernels._interleaved_base(tid)
        if base is not None:
            blocks, tid = cpu_kernels.deinterleave_rows(blocks, base), base
        _set_float(m, a, cpu_kernels.dequantize_rows(tid, blocks))
        w = getattr(m, a)
        if kept is not None:
            w.ggml_blocks = (kept[0], kept[1], w._version)
        m.__dict__.pop("_released", None)


def _dequant_gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [T, K] @ W.T for a released float weight W: its copy's rows dequantized (kernels.cpu.dequantize_rows, the
    loader's values bit for bit) DEQUANT_CHUNK_BYTES of float32 at a time, each chunk one GEMM."""
    base = cpu_kernels._interleaved_base(qtype)
    rows = max(8, DEQUANT_CHUNK_BYTES // (4 * x.shape[1]) // 8 * 8)     # whole groups of 8 interleaved rows
    y = torch.empty(x.shape[0], blocks.shape[0])
    for r in range(0, blocks.shape[0], rows):
        part, t = blocks[r:r + rows], qtype
        if base is not None:                    # rows in lanes put back in the file's order, in C on a copy
            part, t = part.clone(), base
            cpu_kernels.interleave_inplace(part, base, inverse=True)
        torch.mm(x, cpu_kernels.dequantize_rows(t, part).T, out=y[:, r:r + rows])
    return y


def _drop_quantized_copies(model: torch.nn.Module) -> None:
    _restore_floats(model)
    model._dense_copies_done = False
    for m in model.modules():
        for a in getattr(m, "_quant_copies", {}):
            delattr(m, f"{a}_q")
        m._quant_copies = {}
        if getattr(m, "_x8_types", None):
            for name in ("gate", "up", "down"):
                delattr(m, f"{name}_x8")
            m._x8_types = None
        if "_half" in m.__dict__:
            del m._half, m.gate_up_half, m.down_half
        m.__dict__.pop("_file_rows", None)
    model._quant_copies_done = False


# Eager calls on at most this many rows of x (the prefill's last-token lm_head, eager decode tokens) of a Linear
# with a quantized copy multiply on its blocks too. Measured (2-core box, 1 thread, Qwen3-30B-A3B shape, Q4_K_M):
# the float32 lm_head [151936, 2048] for the last prompt token took 79 ms of a 128-token prefill's 471 ms (1.2 GB
# read), its Q6_K blocks ~5x fewer bytes. Larger x (the prompt's attention) stays on the float GEMM, except:
EAGER_QLINEAR_ROWS = 1
# Q4_0 blocks on more rows of x (the prompt's projections) multiply through the grouped experts' int8 tile
# (kernels.cpu.qgemm: each row of W read once for all rows of x) where the experts' prefill takes int8 activations
# (prefill_int8: timed per machine). Dev box, 1 thread, 128 rows: q/k/v [5120, 2048] 23.7 ms (interleaved copy put
# back in order included) against 49.1 ms for the float32 GEMM, o [2048, 4096] 20.0 against 29.9. Q8_0's tile lost
# there (48.9 against 31-36 ms at q/k/v's shape) until it had its rows in lanes (session 42, dev box, 2 threads, 512
# rows: q/k/v [5120, 2048] 35.4 ms against 44.3 for its released copy dequantized a chunk at a time (34.0 for a float
# copy); o 28.1 against 36.7 (26.5)); where the lanes tile is not built, prefill_int8 times it slower: not taken.
PREFILL_QGEMM_TYPES = {"Q4_0", "Q8_0"}
# The 256-value formats likewise where the build has their rows-in-lanes tile (kernels.cpu.grouped_lanes: AVX-512
# VNNI or AVX-VNNI). Dev box, 1 thread, 256 rows x [1024, 1024]: 1.01-1.23x MKL's AVX-512 sgemm (AVX-VNNI build:
# 1.33-1.57x MKL limited to AVX2); the wide test model's prefill +3-5% (Q2_K, IQ2_XXS, IQ3_XXS; Q4_K_M 1.00x). A
# plain AVX2 build's tile only matches MKL (0.95-1.00x): not taken there.
LANES_QGEMM_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                     "IQ1_M"}


def _eager_quant_linears(model: torch.nn.Module) -> None:
    """Linear modules with a quantized copy (_quantized_copies), and attention's stacked q/k/v (fuse_qkv's
    qkv_weight), run eager calls on few rows as the compiled step runs them (moetier::qlinear on the blocks,
    Q8_ACTIVATIONS), so the prefill's logits match the decode's arithmetic and an eager decode reads the blocks,
    not the float copy; tracing and larger x keep the float weight. Installed once per module instance."""
    for m in model.modules():
        copies = getattr(m, "_quant_copies", {})
        if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__ and "weight" in copies:
            m.forward = types.MethodType(_on_blocks(m.forward, "weight", "bias"), m)
        elif "qkv_weight" in copies and "_qkv" not in m.__dict__:
            m._qkv = types.MethodType(_on_blocks(m._qkv, "qkv_weight", "qkv_bias"), m)


def _blocks_of(m: torch.nn.Module | None, attr: str = "weight") -> bool:
    """m is a Linear without a bias whose `attr` has a quantized copy (an eager call multiplies on it)."""
    return (isinstance(m, torch.nn.Linear) and attr in m.__dict__.get("_quant_copies", {})
            and m._parameters.get("bias") is None)


def _attention_planes(model: torch.nn.Module) -> None:
    """Attention modules whose q/k/v (stacked, or three Linears: a K-quant mix's types) and o GEMVs run on quantized
    copies, without biases: `cpu_token_planes` gives an eager CPU token's one C call (Attention.norm_token) those
    blocks."""
    for m in model.modules():
        if not isinstance(m, Attention) or not _blocks_of(m.o_proj):
            continue
        stacked = "qkv_weight" in m.__dict__.get("_quant_copies", {}) and m._buffers.get("qkv_bias") is None
        if stacked or all(_blocks_of(p) for p in (m.q_proj, m.k_proj, m.v_proj)):
            m.cpu_token_planes = types.MethodType(_attn_token_planes, m)


def _attn_token_planes(m, h: torch.Tensor) -> tuple | None:
    """((qkv parts: (type, blocks), ...), o type, o blocks, q8) for one float32 CPU token, while the copies exist."""
    if h.is_cuda or h.shape[0] != 1 or h.dtype != torch.float32:
        return None
    if m.qkv_rows is not None:
        lins, names = (m,), ("qkv_weight",)
    else:
        lins, names = (m.q_proj, m.k_proj, m.v_proj), ("weight",) * 3
    parts = tuple((lin.__dict__.get("_quant_copies", {}).get(a), lin._buffers.get(f"{a}_q"))
                  for lin, a in zip(lins, names))
    o = m.o_proj
    ob = o._buffers.get("weight_q")
    if ob is None or any(t is None or b is None for t, b in parts):
        return None
    return parts, o._quant_copies["weight"], ob, Q8_ACTIVATIONS


def _on_blocks(eager, attr: str, bias: str):
    """A method f(self, x, *rest) that computes x @ W^T (+ b) on W's quantized copy (`<attr>_q`) for an eager call on
    at most EAGER_QLINEAR_ROWS rows of x on the CPU, on more rows where _prefill_qgemm says so, else calls `eager`
    (the bound float method)."""
    key = f"{attr}_q"

    def forward(self, x, *rest, **kw):
        # the module's dicts read directly: nn.Module.__getattr__ cost ~1 us a name, 9 calls a token (eager step)
        qtype, blocks = self.__dict__.get("_quant_copies", {}).get(attr), self._buffers.get(key)
        if qtype is None or blocks is None or not x.is_cpu or torch.compiler.is_compiling():
            return eager(x, *rest, **kw)
        if x.numel() > EAGER_QLINEAR_ROWS * x.shape[-1]:
            x2 = x.reshape(-1, x.shape[-1])
            if _prefill_qgemm(self, qtype):     # on the file's rows where kept (no interleaved copy put back)
                rows, rtype = self.__dict__.get("_file_rows", {}).get(attr, (blocks, qtype))
                y = cpu_kernels.qgemm(rtype, rows, x2)
            elif attr in self.__dict__.get("_released", ()):
                y = _dequant_gemm(x2.float().contiguous(), blocks, qtype)
            else:
                return eager(x, *rest, **kw)
            y = y.view(*x.shape[:-1], -1).to(x.dtype)
        else:
            y = cpu_kernels.qlinear_op(x, blocks, qtype, Q8_ACTIVATIONS)   # one float32 row: straight to C
        b = self._parameters.get(bias)
        if b is None:
            b = self._buffers.get(bias)
        return y if b is None else y + b
    return forward


def _prefill_qgemm(m: torch.nn.Module, qtype: int) -> bool:
    """Whether module m's prefill multiplies its blocks of type id `qtype` through kernels.cpu.qgemm
    (PREFILL_QGEMM_TYPES, LANES_QGEMM_TYPES); decided on its first prefill and kept on the module."""
    said = m.__dict__.get("_prefill_qgemm")
    if said is None:
        base = cpu_kernels._interleaved_base(qtype)
        name = get_format(qtype if base is None else base).name
        tile = Q8_ACTIVATIONS and cpu_kernels.grouped_int8_tile(name) and prefill_int8(name)
        said = m._prefill_qgemm = bool(tile and (name in PREFILL_QGEMM_TYPES
                                                 or name in LANES_QGEMM_TYPES and cpu_kernels.grouped_lanes() > 0))
    return said


def eager_blocks(model: torch.nn.Module) -> None:
    """An eager CPU decode (no compiled step: --cpu-compile off, or while it is being built) multiplies one-token
    linears on the GGML blocks as the compiled step does (_quantized_copies, _eager_quant_linears). Measured (dev
    box, 2 threads, synthetic Qwen3-30B-A3B Q4_0 of 2 layers): the float32 copies read ~1.3 GB a token (the lm_head
    alone 1.2 GB) and decoded at 12 tok/s against llama.cpp's 90 on the same file. Once per model."""
    if getattr(model, "_eager_blocks_done", False):
        return
    model._eager_blocks_done = True
    _quantized_copies(model)
    _eager_quant_linears(model)
    _attention_planes(model)           # a block's attention half: one C call
    _fused_quant_experts(model)        # packed experts: one C call on their x8 copies, int8 activations


def _half_expert_copies(model: torch.nn.Module) -> None:
    """Stacked float32 experts (DenseExperts) on the CPU whose values are exactly bf16 (or fp16), as a 16-bit
    checkpoint's are once loaded in float32, get buffers `gate_up_half`, `down_half` (uint8 [E, N, 2K]) and `_half` =
    (GGML type id, those two): one CPU token multiplies on them in C (DenseExperts.forward / expert; the compiled step's
    moetier::moe_tokens, _graph_friendly_experts), half the bytes, float32 products. Made only where MemAvailable
    holds twice the copies (they add half the experts' float32 bytes)."""
    if cpu_kernels.backend() != "c":
        return
    todo = []
    for m in model.modules():
        ws = (getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None))
        if type(m) is not DenseExperts or "_half" in m.__dict__ \
                or any(w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[-1] % 32 for w in ws):
            continue      # (the C kernel reads 16-bit rows in units of 32 values: D and I multiples of 32)
        for dt, name in ((torch.bfloat16, "BF16"), (torch.float16, "F16")):
            if all(torch.equal(part.to(dt).float(), part) for w in ws for part in (w[0], w)):   # one expert first
                todo.append((m, dt, get_format(name).type_id))
                break
    need = sum(2 * (m.gate_up_proj.numel() + m.down_proj.numel()) for m, _, _ in todo)
    if not todo or ram_info()[0] < 2 * need:
        return
    for m, dt, tid in todo:
        for name, w in (("gate_up_half", m.gate_up_proj), ("down_half", m.down_proj)):
            m.register_buffer(name, w.detach().to(dt).view(torch.uint8), persistent=False)
        m._half = (tid, m.gate_up_half, m.down_half)


# Eager prefill of packed experts (QuantExperts.forward_grouped) with int8 activations when both of a layer's formats
# are in this set and have an integer tile in the build (kernels.cpu.grouped_int8_tile), as the compiled decode step
# (Q8_ACTIVATIONS). Measured (2-core box, 1 thread, Qwen3-30B-A3B layer, 128 tokens, Q4_K gate/up + Q6_K down):
# float activations 147 ms, int8 per 256 values (the Q8_K tile) 93 ms. The other 256-value formats on the unpacked
# super-block tile (bench/bench_cpu_prefill_tiles.py, 1 thread, 16 experts, D 2048, I 768, 128 tokens x 8): float /
# int8 1.29-1.48x on an AVX-512 Xeon, 1.42-1.59x in its AVX2 build.
PREFILL_INT8_TYPES = {"Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                      "IQ1_S", "IQ1_M"}
# Formats whose int8 tile wins on some CPUs and loses on others: timed once per machine (memory.bandwidth.
# prefill_int8_wins, ~0.1-0.2 s, cached). Q4_0's tile: +12-15% prefill on a Zen 4, 154 vs 130 ms a layer on a
# Sapphire Rapids-class Xeon. Q8_0 (Zen 4, default model, 256 tokens): the int8 tile 7,377 tok/s against 6,409 for
# float activations (dequantize + MKL at 64 pairs an expert), and a Q6_K file's Q8_0 + Q6_K experts 7,292 vs 5,465.
# MOETIER_PREFILL_INT8=on | off skips the timing (tests force either).
TIMED_INT8_TYPES = {"Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS"}
PREFILL_INT8 = os.environ.get("MOETIER_PREFILL_INT8", "auto")


def prefill_int8(fmt: str) -> bool:
    """Whether packed experts in `fmt` prefill with int8 activations (given an integer tile in the build)."""
    if fmt in PREFILL_INT8_TYPES or fmt not in TIMED_INT8_TYPES:
        return fmt in PREFILL_INT8_TYPES
    if PREFILL_INT8 not in ("auto", "on", "off"):
        from ..errors import UserError
        raise UserError(f"MOETIER_PREFILL_INT8 must be auto, on or off (got {PREFILL_INT8!r}): unset it to let "
                        "moetier time both prefill tiles once on this machine")
    if PREFILL_INT8 != "auto":
        return PREFILL_INT8 == "on"
    from ..memory.bandwidth import prefill_int8_wins
    return prefill_int8_wins(fmt)


def prefill_int8_experts(model: torch.nn.Module) -> None:
    """QuantExperts whose formats all prefill with int8 activations (prefill_int8) and have an integer tile do so
    (q8_act: forward_grouped's default; the compiled decode step passes Q8_ACTIVATIONS itself). Engine.load calls it
    for a CPU model, so the first prompt and every eager run prefill so too (until session 24 only a loaded compiled
    step set it: an eager CPU prefill took float activations)."""
    if not Q8_ACTIVATIONS:
        return
    for m in model.modules():
        if getattr(m, "grouped_cpu", False) and all(cpu_kernels.grouped_int8_tile(f) and prefill_int8(f)
                                                    for f in (m.fmt, m.down_fmt)):
            m.q8_act = True


class _QuantLinears(torch.overrides.TorchFunctionMode):
    """While tracing: F.linear on a weight with a quantized copy becomes moetier::qlinear on the copy."""

    def __init__(self, subs: dict):
        super().__init__()
        self.subs = subs       # id(float weight) -> (blocks, type id)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w, *rest = args
            b = rest[0] if rest else kwargs.get("bias")
            hit = self.subs.get(id(w))
            if hit is not None:
                y = torch.ops.moetier.qlinear(x, *hit, Q8_ACTIVATIONS)
                return y if b is None else y + b
        return func(*args, **kwargs)


class _Step(torch.nn.Module):
    """The exported function: (tokens [1], pos 0-d, per-layer k/v views) -> logits [1, V]."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, pos, ks, vs):
        cache = Cache([_KVView(k, v) for k, v in zip(ks, vs)], ks[0].shape[0])
        subs = {id(getattr(m, a)): (getattr(m, f"{a}_q"), t)
                for m in self.model.modules() for a, t in getattr(m, "_quant_copies", {}).items()}
        was, small_ops.TRACE_BLOCKS = small_ops.TRACE_BLOCKS, TRACE_BLOCKS
        try:
            with _QuantLinears(subs):
                return self.model(tokens, cache, pos=pos)
        finally:
            small_ops.TRACE_BLOCKS = was


def package_key(model: torch.nn.Module) -> str:
    """What the built code depends on: model config, tensor names/shapes/dtypes, module types,
    thread count (baked into the OpenMP loops), torch, the CPU's vector ISA, and the source of the
    model's modules, the KV cache and this file."""
    h = hashlib.sha256()
    h.update(repr(getattr(model, "args", None)).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    h.update(" ".join(sorted({type(m).__qualname__ for m in model.modules()})).encode())
    # the quantized copies' type ids are constants of the built code (Q4_0 / Q8_0 copies interleaved or not: same shapes)
    h.update(repr([sorted(getattr(m, "_quant_copies", {}).items()) for m in model.modules()]).encode())
    h.update(repr([getattr(m, "_x8_types", None) for m in model.modules()]).encode())
    h.update(repr([getattr(m, "_half", (None,))[0] for m in model.modules()]).encode())      # 16-bit experts' type
    h.update(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{torch.get_num_threads()}".encode())
    sources = {inspect.getsourcefile(type(m)) for m in model.modules() if type(m).__module__.startswith("moetier.")}
    sources |= {inspect.getsourcefile(KVCache), __file__, cpu_kernels.__file__,   # cpu.py: the moetier:: ops
                small_ops.__file__}                                               # which of them a trace calls
    h.update(f"blocks={TRACE_BLOCKS};".encode())
    for src in sorted(str(Path(f).resolve()) for f in sources):
        h.update(Path(src).read_bytes())
    return h.hexdigest()[:24]


def package_path(model: torch.nn.Module) -> Path:
    """Where the model's package is cached. Adds the quantized copies first: they are named tensors of it."""
    _quantized_copies(model)
    return CACHE_DIR / f"{type(model).__module__.rsplit('.', 1)[-1]}-{package_key(model)}.pt2"


# A package is first loaded by a child process (once: `<package>.loads` records it). On the H200 box (torch 2.11 +
# CUDA 13, CUDA hidden or not) aoti_load_package ended the process with a segmentation fault for every package, the
# default model's and a tiny Linear's included, in a fresh process too, and so did the package's .so alone in
# AOTIModelContainerRunnerCpu (docs/perf-log.md, sessions 23-24): a crash no `except` can catch, so it must happen
# elsewhere.
_LOAD_CHECK = ("import sys, torch\nfrom moetier.kernels import cpu\ncpu.load_native_ops()\n"
               "torch._inductor.aoti_load_package(sys.argv[1])\n")


def child_env(**extra: str) -> dict:
    """The environment of a Python child that imports this moetier (its package directory first on PYTHONPATH)."""
    root = str(Path(__file__).resolve().parents[2])   # the directory holding the moetier package
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), **extra}


def loads_safely(path: Path) -> None:
    """Raise RuntimeError when loading `path` kills a child process (a signal, or no answer in 300 s). Checked once
    per package: `.loads` beside it when the child loaded it, `.crashes` with the exit status when it died."""
    ok, bad = path.with_suffix(".loads"), path.with_suffix(".crashes")
    if ok.exists():
        return
    if not bad.exists():
        try:
            r = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(path)], env=child_env(), capture_output=True,
                               text=True, timeout=300)
            status, tail = r.returncode, r.stderr.strip().splitlines()[-1:] or [""]
        except subprocess.TimeoutExpired:
            status, tail = "timeout", ["no answer in 300 s"]
        if status == 0:
            ok.touch()
            return
        if status != "timeout" and status > 0:
            return          # an error, not a crash: loading here raises it too, and is caught
        bad.write_text(f"exit status {status}: {tail[0][:300]}\n")
    raise RuntimeError(f"loading the package crashed a test process ({bad.read_text().strip()}; {bad}). "
                       "This torch cannot load it here")


class CpuDecode:
    """One AOT-compiled one-token decode step bound to a model's weights."""

    def __init__(self, model: torch.nn.Module, runner, path: Path):
        self.model, self.runner, self.path = model, runner, path
        self.lock = threading.Lock()   # one runner: sessions on several threads take turns
        self.token, self.pos = torch.zeros(1, dtype=torch.long), torch.zeros((), dtype=torch.long)
        self.kv_dtype = next(model.parameters()).dtype   # the KV dtype _build exported with
        # the loader's flat call (inputs in export order, outputs as a list) skips the wrapper's
        # per-call pytree (de)serialisation: ~70 us a token on the dev box
        loader = getattr(runner, "loader", None)
        self.boxed_run = getattr(loader, "boxed_run", None) if loader is not None and \
            torch.utils._pytree.treespec_loads(loader.get_call_spec()[1]).num_leaves == 1 else None
        _eager_quant_linears(model)

    @classmethod
    def get(cls, model: torch.nn.Module, build: bool) -> CpuDecode | None:
        """Load the cached package for this model, or (build=True) export and build it first.
        None when it is not cached and build is False, or when the model cannot be compiled (warned)."""
        try:
            path = package_path(model)
            if not path.exists():
                if not build:
                    return None
                from .cpu_build import locked
                with locked(path, wait=True):         # a background build of it may be running: wait
                    if not path.exists():
                        _build(model, path)
                path.with_suffix(".failed").unlink(missing_ok=True)
            loads_safely(path)
            cpu_kernels.load_native_ops()   # the package's moetier:: op calls skip Python (~6 us each)
            runner = torch._inductor.aoti_load_package(str(path))
            names = dict(_Step(model).named_parameters())
            names.update(_Step(model).named_buffers())
            missing = [n for n in runner.get_constant_fqns() if n not in names]
            if missing:
                raise RuntimeError(f"the compiled step needs tensors the model does not name: {missing[:3]}")
            runner.load_constants({n: names[n] for n in runner.get_constant_fqns()}, check_full_update=True,
                                  user_managed=True)   # the model's own tensors: no copy
        except Exception as e:  # a model or op the exporter cannot take whole: stay eager
            warnings.warn(f"cpu_compile: the compiled CPU decode step is unavailable ({type(e).__name__}: "
                          f"{str(e)[:300]}); decoding eagerly. Pass --cpu-compile off to skip the attempt.")
            return None
        return cls(model, runner, path)

    def __call__(self, cache: Cache, token: int) -> torch.Tensor:
        start = cache.length
        if start + 1 > cache.max_len:
            raise ValueError("the cache is full")
        n = min(cache.max_len, (start // BUCKET + 1) * BUCKET)
        views = getattr(cache, "_decode_views", None)   # (n, k views, v views, layer 0's k buffer)
        if views is None or views[0] != n or views[3] is not cache.layers[0].k:  # new once per BUCKET tokens
            if n < 2 or cache.layers[0].k.dtype != self.kv_dtype:  # outside what was exported: eager
                return self.model(torch.tensor([token], dtype=torch.long), cache)
            views = cache._decode_views = (n, [kv.k[:n] for kv in cache.layers], [kv.v[:n] for kv in cache.layers],
                                           cache.layers[0].k)
        with self.lock:
            self.token.fill_(token)
            self.pos.fill_(start)
            if self.boxed_run is not None:
                logits = self.boxed_run([self.token, self.pos, *views[1], *views[2]])[0]
            else:
                logits = self.runner(self.token, self.pos, views[1], views[2])
        cache.advance(1)
        return logits


def export_step(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """The decode step exported with a dynamic KV length (what _build compiles)."""
    _graph_friendly_experts(model)
    p = next(model.parameters())
    example = model.make_cache(2 * BUCKET, p.dtype, p.device)
    ks, vs = [kv.k for kv in example.layers], [kv.v for kv in example.layers]
    n = torch.export.Dim("kv_len", min=2, max=1 << 20)
    with torch.inference_mode():
        return torch.export.export(_Step(model), (torch.tensor([0]), torch.tensor(BUCKET), ks, vs),
                                   dynamic_shapes=(None, None, [{0: n}] * len(ks), [{0: n}] * len(vs)), strict=False)


def _build(model: torch.nn.Module, path: Path) -> None:
    """Export the step (export_step) and build it with AOTInductor into `path`."""
    t0 = time.perf_counter()
    log.warning("cpu_compile: building the compiled CPU decode step once for this model (~15-25 s on 2 cores); "
                "later runs load it from %s", path.parent)
    ep = export_step(model)
    with torch.inference_mode():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(tmp), inductor_configs={"aot_inductor.package_constants_in_so": False})
            os.replace(tmp, path)   # atomic: another process never sees half a package
            for mark in (".loads", ".crashes"):     # loads_safely's word on an earlier package of this name
                path.with_suffix(mark).unlink(missing_ok=True)
        finally:
            tmp.unlink(missing_ok=True)
    log.warning("cpu_compile: built in %.1f s", time.perf_counter() - t0)


def compiled_step(model: torch.nn.Module, model_path: Path, config) -> tuple[CpuDecode | None, object]:
    """The engine's choice for `config.cpu_compile`: (the loaded step or None, the background build
    started or watched under auto when no package is cached (runtime.cpu_build.BackgroundBuild), else None)."""
    from .cpu_build import start_background_build
    step = CpuDecode.get(model, build=config.cpu_compile == "on")
    if step is not None or config.cpu_compile != "auto":
        return step, None
    return None, start_background_build(model, model_path, config)
