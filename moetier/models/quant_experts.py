"""QuantExperts: a layer's experts kept in their GGML storage format (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and
computed on it, instead of being dequantized to bf16/fp32 at load (3.5-7x the bytes). gate/up and down
may differ in format (llama.cpp's Q4_K_M: gate/up Q4_K, down Q6_K in some layers).

Same call as DenseExperts: forward(x [T, D], ids [T, k], w [T, k]) -> [T, D]. Two layouts:
  "planes" (CUDA): `quant.repack(fmt, raw)` planes on the device, run by kernels.ops (fused Triton
           GEMVs for T <= ops.MAX_DECODE_TOKENS, grouped GEMMs above; no host sync).
  "raw"    (CPU):  the GGUF blocks as stored (zero-copy views of the file's mmap), run by the C
           kernels (kernels/cpu.py): SwiGLU without biases: decode one moe_tokens call per layer
           (forward_fused), more tokens one moe_grouped call (forward_grouped: expert-major, each
           weight row read once per call). Other experts (biases, gpt-oss's activation): few-token
           calls matvecs; prefill dequantizes each used expert once per call and runs F.linear.
`forward_native` is the pure-torch twin: every used expert dequantized, then grouped_experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu as _cpu     # also registers the torch op moetier::moe_tokens
from ..kernels import ops
from ..quant.formats import get_format
from ..quant.repack import dequantize_repacked, repack
from .layers import DenseExperts, grouped_experts, grouped_mm_experts, swiglu

# CPU: the C matvec kernel runs (token, expert) pairs while they average at most this many per used
# expert (each pair re-reads its expert's blocks); above, each used expert is dequantized once and
# multiplied. Measured on the 2-core box, 1 thread, default model's experts (8 used, D 384, I 256),
# matvec vs dequantize+linear per layer call: Q8_0 4 pairs/expert 3.1 vs 5.2 ms, 16: 6.7 vs 6.7 ms;
# Q4_0 (slower torch dequantizer) 16: 6.0 vs 12.6 ms, 32: 10.5 vs 8.8 ms. K-quants: not measured, as Q4_0.
# MXFP4 / IQ3_XXS (8 experts all used, D 512, I 256, 1 thread, float-activation matvecs): MXFP4 8: 2.5 vs 3.7 ms,
# 16: 4.9 vs 4.4; IQ3_XXS 24: 15.6 vs 17.1, 32: 21.0 vs 17.6 (its dequantizer is slower; Q4_0 then: 8: 2.7 vs 3.7).
CPU_MATVEC_PAIRS_PER_EXPERT = {"Q8_0": 12, "Q4_0": 24, "Q5_1": 24, "Q4_K": 24, "Q5_K": 24, "Q6_K": 24, "MXFP4": 12, "IQ3_XXS": 24,
                               "IQ4_XS": 24, "IQ4_NL": 24, "Q2_K": 24, "Q3_K": 24, "IQ2_XXS": 24, "IQ2_XS": 24,
                               "IQ2_S": 24, "IQ3_S": 24, "IQ1_S": 24, "IQ1_M": 24}   # 2-3-bit: as IQ3_XXS, unmeasured
# CPU prefill of SwiGLU experts without biases: moe_grouped (forward_grouped) unless a format has more pairs per used
# expert than this (then dequantize + F.linear, MKL's GEMM, wins). Measured (1 thread, default model's experts: 8, D 384,
# I 256, k 2; grouped vs dequantize+linear per call): Q8_0 16 pairs/expert 1.22 vs 2.74 ms, 48: 4.11 vs 3.86, 128: 11.1
# vs 7.1; Q4_0 64: 5.38 vs 5.80 (its dequantizer is slower: no limit). 30B-A3B shape (8 pairs/expert): grouped 2.5-3x.
CPU_GROUPED_MAX_PAIRS_PER_EXPERT = {"Q8_0": 32}


def cpu_formats() -> set[str]:
    """GGML formats the CPU kernels compute on directly."""
    from ..kernels import cpu
    return set(cpu.FAST_TYPES) if cpu.backend() in ("c", "numba") else set()


def cuda_formats() -> set[str]:
    """GGML formats kernels.ops runs fused on CUDA (empty without Triton)."""
    return {f for f in ops.KERNEL_FORMATS if f != "dense"} if ops.backend() == "triton" else set()


# CPU: up to this many tokens run the fused one-call layer (forward_fused) when it applies.
FUSED_CPU_TOKENS = 1

# CUDA bf16 prefill (_forward_dequant_grouped): a chunk with at least this many routes per expert dequantizes every
# expert of the layer, when their float copies fit DEQUANT_ALL_BYTES, instead of the used ones (torch.unique: a host
# sync per layer). A 512-token prompt on the 48-layer Q4_0 30B-A3B shape (32 routes per expert: all used) spent 267
# of 338 ms of its device span idle, the host and the GPU taking turns at every layer's sync (session 12).
DEQUANT_ALL_ROUTES = 4
DEQUANT_ALL_BYTES = 2 << 30



class QuantExperts(DenseExperts):
    """All experts of one layer in GGML formats: qtype one format, or (gate/up format, down format).
    gate/up/down: uint8 [E, rows, row_bytes] storage blocks (gate [E, I, .], up [E, I, .], down [E, D, .]); biases float [E, 2I] / [E, D] or None.
    A DenseExperts subclass so code that finds expert modules by type (profiles) sees it; it has no
    float weights, and memory tiers (which need `type(m) is DenseExperts`) never get one."""

    def __init__(self, qtype, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 biases: tuple | None = None, act=swiglu, layout: str = "raw", device="cpu"):
        torch.nn.Module.__init__(self)
        fmt, dfmt = (get_format(q) for q in (qtype if isinstance(qtype, (tuple, list)) else (qtype, qtype)))
        self.fmt, self.down_fmt = fmt.name, dfmt.name      # gate_up's, down's
        self.num_experts, self.hidden, self.dim = gate.shape[0], gate.shape[1], down.shape[1]
        self.act, self.layout = act, layout
        self.fused_cpu = self.grouped_cpu = False
        self.q8_act = False    # forward_fused: int8 activations for Q4_0 / Q8_0 (llama.cpp's way; not exact)
        if layout == "planes":
            planes = {"gate_up": repack(fmt, torch.cat([gate, up], dim=1)), "down": repack(dfmt, down)}
            for proj, ps in planes.items():
                for name, t in ps.items():
                    self.register_buffer(f"{proj}_{name}", t.to(device), persistent=False)
            self.plane_names = {proj: list(ps) for proj, ps in planes.items()}
        elif layout == "raw":
            for name, t in (("gate_raw", gate), ("up_raw", up), ("down_raw", down)):
                self.register_buffer(name, t, persistent=False)
            ok = {self.fmt, self.down_fmt} <= cpu_formats()
            self.matvec_pairs = min(CPU_MATVEC_PAIRS_PER_EXPERT.get(f, 0) for f in (self.fmt, self.down_fmt)) if ok else 0
            # the whole layer in one C call (kernels/cpu.moe_tokens) for decode: SwiGLU without biases
            self.fused_cpu = ok and act is swiglu and biases is None
            # prefill (T > FUSED_CPU_TOKENS): the same layer expert-major in one C call (kernels/cpu.moe_grouped)
            self.grouped_cpu = self.fused_cpu and _cpu.backend() == "c"
        else:
            raise ValueError(f"QuantExperts layout must be 'planes' or 'raw', got {layout!r}")
        gb, db = biases or (None, None)
        self.gate_up_bias = None if gb is None else torch.nn.Parameter(gb, requires_grad=False)
        self.down_bias = None if db is None else torch.nn.Parameter(db, requires_grad=False)

    def extra_repr(self) -> str:
        fmt = self.fmt if self.down_fmt == self.fmt else f"{self.fmt}/{self.down_fmt}"
        return f"{fmt}, experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, layout={self.layout}"

    # -- weights
    def planes(self, proj: str) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"{proj}_{name}") for name in self.plane_names[proj]}

    def weight(self, proj: str, e) -> torch.Tensor:
        """Expert(s) e's float32 weight: proj "gate_up" [2I, D] or "down" [D, I] (e an int or an
        index tensor: then [n, rows, cols])."""
        name = self.fmt if proj == "gate_up" else self.down_fmt
        if self.layout == "planes":
            return dequantize_repacked(name, {n: p[e] for n, p in self.planes(proj).items()})
        raws = [self.gate_raw[e], self.up_raw[e]] if proj == "gate_up" else [self.down_raw[e]]
        ws = [_cpu.dequantize_rows(name, r) for r in raws]
        return ws[0] if len(ws) == 1 else torch.cat(ws, dim=-2)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on rows x [n, D] -> [n, D], as DenseExperts.expert on the dequantized weights."""
        h = F.linear(x, self.weight("gate_up", e).to(x.dtype),
                     None if self.gate_up_bias is None else self.gate_up_bias[e])
        gate, up = h.chunk(2, dim=-1)
        return F.linear(self.act(gate, up), self.weight("down", e).to(x.dtype),
                        None if self.down_bias is None else self.down_bias[e])

    # -- compute
    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.layout == "planes":
            return self._forward_planes(x, ids, w)
        if self.fused_cpu and ids.shape[0] <= FUSED_CPU_TOKENS:
            return self.forward_fused(x, ids, w)
        if self.grouped_cpu:     # (the limit was measured with float activations: the int8 tile has none)
            limit = None if self.q8_act else CPU_GROUPED_MAX_PAIRS_PER_EXPERT.get(self.fmt)
            if limit is None or ids.numel() <= limit or ids.numel() <= limit * ids.unique().numel():
                return self.forward_grouped(x, ids, w)
        if self.matvec_pairs and (ids.numel() <= self.matvec_pairs
                                  or ids.numel() <= self.matvec_pairs * ids.unique().numel()):
            return self._forward_matvec(x, ids, w)
        return grouped_experts(x, ids, w, self.num_experts, self.expert)

    def forward_native(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The pure-torch twin: each used expert dequantized, then the dense model's grouped path."""
        return grouped_experts(x, ids, w, self.num_experts, self.expert)

    def _biases(self):
        return None if self.gate_up_bias is None else (self.gate_up_bias, self.down_bias)

    def _forward_planes(self, x, ids, w):
        if (x.is_cuda and x.shape[0] > ops.MAX_DECODE_TOKENS and x.dtype == torch.bfloat16 and self._biases() is None
                and hasattr(torch, "_grouped_mm")
                and (self._dequant_all(x, ids) or not torch.cuda.is_current_stream_capturing())):
            return self._forward_dequant_grouped(x, ids, w)   # (captured: the all-experts form only, no sync)
        if ops.kernel_available(x, self.act, self.fmt, self.down_fmt):   # Triton: decode GEMVs or grouped GEMMs
            return ops.moe(x, ids, w, self.planes("gate_up"), self.planes("down"), self.act,
                           self._biases(), fmt=self.fmt, down_fmt=self.down_fmt)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():   # no host sync under capture
            return self._forward_gathered(x, ids, w)
        return grouped_experts(x, ids, w, self.num_experts, self.expert)

    def _forward_dequant_grouped(self, x, ids, w):
        """CUDA bf16 prefill: the experts this chunk uses dequantized to bf16 (kernels.ops.dequantize:
        one Triton pass), then the dense model's grouped GEMMs (torch._grouped_mm).
        Measured on the H200 (48-layer Q4_0 30B-A3B shape, 512-token prompt): the Triton grouped
        kernels on the planes gave 247 tok/s prefill. Without a host sync when the chunk routes
        DEQUANT_ALL_ROUTES or more rows to the average expert and all E float copies fit DEQUANT_ALL_BYTES
        (then all E are dequantized: a big chunk uses nearly all of them anyway); else one (the used experts)."""
        e = self.num_experts
        if self._dequant_all(x, ids):
            idx = torch.arange(e, device=x.device)
        else:
            idx, inv = torch.unique(ids, return_inverse=True)
            ids = inv.view_as(ids)
        gu = ops.dequantize(self.fmt, self.planes("gate_up"), idx, x.dtype)
        dn = ops.dequantize(self.down_fmt, self.planes("down"), idx, x.dtype)
        return grouped_mm_experts(x, ids, w, gu, dn, self.act)[0]

    def _dequant_all(self, x, ids) -> bool:
        """_forward_dequant_grouped dequantizes every expert (no host sync)."""
        e = self.num_experts
        return ids.numel() >= DEQUANT_ALL_ROUTES * e and self.float_bytes(x.dtype) * e <= DEQUANT_ALL_BYTES

    def float_bytes(self, dtype: torch.dtype) -> int:
        """One expert's gate_up and down in `dtype`."""
        return 3 * self.hidden * self.dim * dtype.itemsize

    def _forward_matvec(self, x, ids, w):
        """CPU, few tokens: the C kernels over the stored blocks, all pairs of a projection in one call.
        x [T, D] -> [T, D]; P = T * k pairs."""
        from ..kernels import cpu
        t, k = ids.shape
        flat = ids.reshape(-1).tolist()
        p, threads = len(flat), torch.get_num_threads()
        xs = x.float().repeat_interleave(k, dim=0)                                  # [P, D]
        ws = [self.gate_raw[e] for e in flat] + [self.up_raw[e] for e in flat]
        h = cpu.matvec_batch(self.fmt, ws, torch.cat([xs, xs]), threads=threads)    # [2P, I]: gates, ups
        gate, up = h[:p], h[p:]
        if self.gate_up_bias is not None:
            b = self.gate_up_bias[flat].float()
            gate, up = gate + b[:, :self.hidden], up + b[:, self.hidden:]
        a = self.act(gate, up).to(x.dtype).float()                                 # [P, I], rounded as h is
        y = cpu.matvec_batch(self.down_fmt, [self.down_raw[e] for e in flat], a, threads=threads)  # [P, D]
        if self.down_bias is not None:
            y = y + self.down_bias[flat].float()
        return (y * w.reshape(-1, 1).float()).view(t, k, -1).sum(1).to(x.dtype)

    def forward_grouped(self, x, ids, w, q8: bool | None = None):
        """CPU, many tokens, SwiGLU without biases: one C call (kernels/cpu.moe_grouped) that reads each used
        expert's rows once for all its tokens (llama.cpp's way). Float activations unless q8 / self.q8_act:
        Q8_0 / Q4_0 / MXFP4 / IQ3_XXS rows dequantized to float per tile (exact products), K-quants the row dot.
        x [T, D] -> [T, D]."""
        y = _cpu.moe_grouped((self.fmt, self.down_fmt), self.gate_raw, self.up_raw, self.down_raw, x, ids, w,
                             q8=self.q8_act if q8 is None else q8, threads=torch.get_num_threads())
        return y.to(x.dtype)

    def forward_fused(self, x, ids, w, q8: bool | None = None):
        """CPU, few tokens, SwiGLU without biases: the layer as one C call through the torch op
        moetier::moe_tokens (kernels/cpu.py), which torch.export keeps whole, so the compiled CPU
        decode step (runtime/cpu_compile.py) runs the stored blocks too. x [T, D] -> [T, D]."""
        return torch.ops.moetier.moe_tokens(x, ids, w.float(), self.gate_raw, self.up_raw, self.down_raw,
                                            get_format(self.fmt).type_id, get_format(self.down_fmt).type_id,
                                            self.q8_act if q8 is None else q8)

    def _forward_gathered(self, x, ids, w):
        """No host sync (CUDA-graph capturable) when the fused kernels are missing: dequantize the
        T*k gathered experts and bmm. Slow (k full experts per token): a correctness fallback."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)[:, :, None]                                  # [T*k, D, 1]
        h = torch.bmm(self.weight("gate_up", flat).to(x.dtype), xs)[..., 0]             # [T*k, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[flat]
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.weight("down", flat).to(x.dtype), self.act(gate, up)[:, :, None])[..., 0]
        if self.down_bias is not None:
            y = y + self.down_bias[flat]
        return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)
