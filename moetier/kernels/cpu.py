"""CPU expert kernels for cache misses: y[N] = W_q[N, K] @ x[K] read straight from GGML blocks.

Backend, chosen once at first use:
  "c"     cpu_kernels.c built with the system compiler (-O3 -march=native -fopenmp) into
          ~/.cache/moetier/kernels and called through ctypes (the GIL is released for the
          whole call; OpenMP splits rows over threads). FAST_TYPES: Q8_0, Q4_0, Q5_1, Q2_K..Q6_K, MXFP4,
          IQ3_XXS, IQ3_S, IQ4_XS / IQ4_NL, IQ2_XXS / IQ2_XS / IQ2_S, IQ1_S / IQ1_M
          (one compile unit: cpu_kernels.c #includes cpu_kquants.c, cpu_iquants.c, cpu_iq2.c, cpu_moe.c and the
          codebook header generated from moetier.quant's tables, iq_tables_header).
  "numba" the same loops in numba (parallel, nogil) when no compiler is found (Q8_0, Q4_0, Q4_K).
  "torch" any other type, or neither of the above: the reference (dequantize, then matmul).
The pure-torch twin is kernels.reference.expert_matvec; tests/test_quant_cpu_kernels.py
compares the two on random inputs. `expert_ffn` runs one whole expert (gate_up matvecs, the
activation in float32, down matvecs; gate_up and down may differ in format, as llama.cpp's
Q4_K_M stores some layers' down in Q6_K) for the memory tiers' CPU misses; its twin is
`expert_ffn_native` (tests/test_memory_gguf.py).
Prefill op (tests/test_cpu_grouped.py): `moe_grouped`, moe_tokens expert-major (each weight row read once per
call for all its tokens; twin moe_tokens_native).
Decode ops (tests/test_cpu_moe_fused.py): `moe_tokens` (a SwiGLU MoE layer's k experts for a few tokens
in one C call; twin moe_tokens_native) and `qlinear` (twin qlinear_native), also the torch ops
moetier::moe_tokens / moetier::qlinear so torch.export keeps them whole in the compiled CPU decode step;
their CPU kernels are Python until `load_native_ops()` swaps in cpu_ops.cpp (no Python per call).
A decode token's small ops (tests/test_cpu_small.py; kernels/small_ops.py calls them for an eager CPU step):
`decode_attention` (q / k norm, RoPE, cache write, attention) and `router_topk_add_norm`, in cpu_small.c.
q8=True: MOE_Q8_TYPES rows dot activations rounded to int8 per 32 values (llama.cpp's way; integer kernels in
cpu_moe.c / cpu_iq_q8.c / cpu_iq2_q8.c / cpu_kq_q8.c / cpu_kq23_q8.c with AVX2, else the float ones).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from moetier.quant.formats import dequantize, get_format
from moetier.quant.repack import repack

from .reference import expert_matvec

log = logging.getLogger(__name__)

FAST_TYPES = {"Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ4_XS",
              "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
# 16-bit float rows the C matvec reads too (float32 products): the dense copies of weights that are exactly 16-bit
# floats (runtime.cpu_compile.QUANT_COPY_TYPES); not kept from GGUF files (weights.loader._keep_blocks reads FAST_TYPES)
HALF_TYPES = {"BF16", "F16"}
DEQUANT_TYPES = FAST_TYPES | HALF_TYPES     # moetier_dequant (dequantize_rows)
NUMBA_TYPES = {"Q8_0", "Q4_0", "Q4_K"}     # cpu_numba.py
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib = None
_backend: str | None = None


def _flags_line() -> str | None:
    """/proc/cpuinfo's flags line of the first CPU, None where there is none."""
    try:
        return next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        return None


def _cpu_signature() -> str:
    """Identifies the instruction set the library is built for (-march=native)."""
    return platform.machine() + (_flags_line() or platform.processor())


_flags: frozenset | None = None


def cpu_flags() -> frozenset:
    """/proc/cpuinfo's flags of the first CPU (empty where there is none)."""
    global _flags
    if _flags is None:
        _flags = frozenset((_flags_line() or ":").split(":", 1)[1].split())
    return _flags


def bf16_native() -> bool:
    """The CPU multiplies bf16 in hardware (AMX-BF16 tiles or AVX512-BF16 dot products), so torch's bf16 GEMMs and
    attention run faster than float32 ones (a 512-token prompt's attention, 32 / 4 heads of 128: 16.3 -> 3.7 ms on 2
    AMX cores); elsewhere bf16 is converted element by element and is slower."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def iq_tables_header() -> str:
    """cpu_iq_tables.h: the codebook tables of cpu_iquants.c as C arrays, from moetier.quant's own
    tables (so the C kernels and the torch dequantizers cannot disagree on them)."""
    from moetier.quant.iquants import c_tables
    t = c_tables()

    def array(decl: str, items: list[str], per_line: int) -> str:
        lines = (", ".join(items[i:i + per_line]) for i in range(0, len(items), per_line))
        return f"static const {decl} = {{\n    " + ",\n    ".join(lines) + "\n};\n"

    def brace(vals) -> str:
        return "{" + ", ".join(vals) + "}"

    signs = [brace(f"0x{0x80000000 * (int(k) >> j & 1):08x}u" for j in range(8)) for k in t["iq_ksigns"]]
    sign_bytes = ["0x" + "".join("ff" if int(k) >> j & 1 else "01" for j in reversed(range(8))) + "ull"
                  for k in t["iq_ksigns"]]
    return ("/* generated by moetier/kernels/cpu.py (iq_tables_header) from moetier.quant.iquants.c_tables */\n"
            + array("int8_t mxfp4_values[16] __attribute__((aligned(16)))", [str(v) for v in t["mxfp4_values"]], 16)
            + array("float mxfp4_values_f32[16] __attribute__((aligned(64)))",
                    [f"{float(v)}f" for v in t["mxfp4_values"]], 16)
            + array("uint8_t iq3xxs_grid[256][4] __attribute__((aligned(4)))",
                    [brace(str(v) for v in r) for r in t["iq3xxs_grid"]], 8)
            + "/* IQ2 grids: row i's 8 values (8, 25 or 43) as the bytes of a little-endian u64 */\n"
            + "".join(array(f"uint64_t {g}[{len(t[g])}] __attribute__((aligned(64)))",
                            [f"0x{int.from_bytes(bytes(r.tolist()), 'little'):016x}ull" for r in t[g]], 4)
                      for g in ("iq2xxs_grid", "iq2xs_grid", "iq2s_grid"))
            + array("uint8_t iq3s_grid[512][4] __attribute__((aligned(4)))",
                    [brace(str(v) for v in r) for r in t["iq3s_grid"]], 8)
            + array("int8_t iq1s_grid[2048][8] __attribute__((aligned(8)))",
                    [brace(str(v) for v in r) for r in t["iq1s_grid"]], 4)
            + array("uint8_t iq_ksigns[128]", [str(v) for v in t["iq_ksigns"]], 16)
            + "/* iq_ksigns[i] bit j -> the float sign bit of lane j */\n"
            + array("uint32_t iq_sign_bits[128][8] __attribute__((aligned(32)))", signs, 2)
            + "/* iq_ksigns[i] bit j -> byte j: -1 (0xff) or +1, to multiply int8 activations (_mm256_sign_epi8) */\n"
            + array("uint64_t iq_sign_bytes[128] __attribute__((aligned(64)))", sign_bytes, 4))


def build_library(cache_dir: Path | None = None, march: str = "native", source: Path = _SOURCE) -> Path:
    """Compile cpu_kernels.c (once per source / compiler / flags / CPU); return the .so path.
    `march` other than "native" builds a portable variant (tests use it for the scalar path);
    `source` another file of this directory that #includes cpu_kernels.c (doorbell.c).
    The cache key covers every file the compile unit may #include (cpu_*.c / cpu_*.h here) and the
    generated table header, which is written beside the .so."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    cache_dir = cache_dir or Path.home() / ".cache" / "moetier" / "kernels"
    flags = [*_CFLAGS, f"-march={march}"]
    if os.environ.get("MOETIER_PREFETCH_AHEAD"):       # an A/B of the software prefetch distance (bytes)
        flags.append(f"-DPREFETCH_AHEAD={int(os.environ['MOETIER_PREFETCH_AHEAD'])}")
    if os.environ.get("MOETIER_X8_DENSE_AHEAD"):       # an A/B of the dense interleaved matvec's distance (bytes)
        flags.append(f"-DX8_DENSE_AHEAD={int(os.environ['MOETIER_X8_DENSE_AHEAD'])}")
    for ab in ("MOETIER_TILE16", "MOETIER_UNPACK16"):  # 0: the 32-value formats' prefill on 8 rows in lanes / 16 rows
        if os.environ.get(ab):                          # unpacked per tile of pairs (A/B)
            flags.append(f"-D{ab}={int(os.environ[ab])}")
    for d in os.environ.get("MOETIER_CDEFS", "").split():    # experiments: NAME=VALUE macros for the compile
        flags.append(f"-D{d}")
    if os.environ.get("MOETIER_MISS_CHUNKS"):          # an A/B of the miss server's chunks per thread and phase
        flags.append(f"-DCHUNKS={int(os.environ['MOETIER_MISS_CHUNKS'])}")
    header = iq_tables_header()
    parts = sorted({*_SOURCE.parent.glob("cpu*.[ch]"), source})
    key = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in parts) + header.encode()
                         + " ".join([cc, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:16]
    so = cache_dir / f"{source.stem}_{key}.so"
    if not so.exists():
        include = cache_dir / f"include_{key}"            # the generated header, one folder per key
        include.mkdir(parents=True, exist_ok=True)
        (include / "cpu_iq_tables.h").write_text(header)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        res = subprocess.run([cc, *flags, f"-I{include}", str(source), "-o", tmp], capture_output=True, text=True,
                             check=False)
        if res.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {source.name} failed:\n{res.stderr}")
        os.replace(tmp, so)                   # atomic: concurrent builders agree
    return so


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.moetier_matvec.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.moetier_dequant.argtypes = [c_int, ptr, i64, i64, i64, ptr, c_int]
    lib.moetier_embed_rows.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, ptr, c_int]
    lib.moetier_matvec_batch.argtypes = [c_int, ptr, i64, i64, i64, i64, ptr, ptr, c_int]
    lib.moetier_sum_f32.argtypes = [ptr, i64, c_int]
    lib.moetier_sum_f32.restype = ctypes.c_float
    lib.moetier_matvec_q8.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.moetier_x8_supported.argtypes = [c_int]
    lib.moetier_interleave8.argtypes = [ptr, i64, i64, c_int, c_int, c_int]
    lib.moetier_moe_tokens.argtypes = [c_int, c_int, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64,
                                       ptr, ptr, ptr, ptr, c_int, c_int]
    lib.moetier_moe_grouped.argtypes = lib.moetier_moe_tokens.argtypes
    lib.moetier_grouped_int8_tile.argtypes = [c_int]
    lib.moetier_grouped_lanes.argtypes = []
    lib.moetier_amx.argtypes = [c_int]
    lib.moetier_qgemm.argtypes = [c_int, ptr, i64, i64, i64, i64, ptr, ptr, c_int, c_int]
    f32 = ctypes.c_float
    lib.moetier_decode_attn.argtypes = [ptr, ptr, ptr, f32, ptr, ptr, c_int, i64, ptr, ptr, c_int, c_int, c_int, f32,
                                        ptr, c_int]
    lib.moetier_decode_attn_prep.argtypes = [ptr, ptr, ptr, f32, ptr, ptr, c_int, i64, ptr, ptr, c_int, c_int, c_int,
                                             ptr]
    lib.moetier_decode_attn_prep.restype = None
    lib.moetier_router_add_norm.argtypes = [ptr, ptr, ptr, f32, c_int, ptr, c_int, c_int, c_int, ptr, ptr, ptr, ptr,
                                            c_int]
    lib.moetier_rms_norm.argtypes = [ptr, ptr, f32, i64, c_int, ptr, c_int]
    lib.moetier_qk_norm_rope.argtypes = [ptr, i64, i64, c_int, c_int, c_int, ptr, ptr, f32, ptr, ptr, c_int, ptr,
                                         c_int]
    lib.moetier_qk_norm_rope.restype = None
    lib.moetier_attn_block.argtypes = [ptr, ptr, f32, c_int, *[c_int, ptr, i64, i64] * 3, c_int, ptr, i64, c_int, ptr,
                                       ptr, f32, ptr, ptr, c_int, i64, ptr, ptr, c_int, c_int, c_int, f32, ptr, c_int]
    lib.moetier_moe_block.argtypes = [ptr, ptr, ptr, f32, c_int, ptr, c_int, c_int, c_int, c_int, c_int, ptr, ptr, i64,
                                      i64, ptr, i64, i64, i64, c_int, ptr, c_int]
    lib.moetier_rms_norm.restype = None
    lib.moetier_layers.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, c_int, ptr, ptr, c_int, i64, c_int, ptr]
    return lib


def _load():
    global _lib, _backend
    if _backend is not None:
        return
    try:
        _lib, _backend = open_library(build_library()), "c"
    except (RuntimeError, OSError) as e:
        log.warning("CPU C kernels unavailable (%s); using numba kernels", e)
        try:
            from . import cpu_numba  # noqa: F401
            _backend = "numba"
        except ImportError:
            log.warning("numba not installed either: CPU expert matvec falls back to torch")
            _backend = "torch"


def backend() -> str:
    """"c", "numba" or "torch" (see module doc)."""
    _load()
    return _backend


_nthreads = torch.get_num_threads()     # default thread count, read once


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.detach().to(torch.float32).contiguous()


def _check(fmt, w: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    n, k = w.shape[0], x.shape[-1]
    if w.dim() != 2 or w.dtype != torch.uint8 or w.device.type != "cpu" or w.stride(-1) != 1:
        raise ValueError(f"CPU matvec needs CPU uint8 blocks with contiguous rows; got "
                         f"{w.dtype} on {w.device} with strides {w.stride()}")
    if w.shape[-1] * fmt.block_size != k * fmt.type_size:
        raise ValueError(f"{fmt.name} rows of {w.shape[-1]} bytes hold "
                         f"{w.shape[-1] // fmt.type_size * fmt.block_size} values, but x has {k}")
    return n, k


def _out(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}; got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out


def _raise_on(rc: int, fmt, k: int) -> None:
    if rc:
        why = {-1: f"K={k} is not a multiple of the block size", -2: "out of memory"}.get(rc, rc)
        raise RuntimeError(f"CPU {fmt.name} matvec failed: {why}")


def _kernel(fmt, lib) -> str:
    """Which implementation runs `fmt`: "c", "numba" or "torch"."""
    if fmt.name in HALF_TYPES:
        return "c" if lib is not None or backend() == "c" else "torch"
    if fmt.name not in FAST_TYPES:
        return "torch"
    if lib is not None:
        return "c"
    kind = backend()
    return "torch" if kind == "numba" and fmt.name not in NUMBA_TYPES else kind


def matvec(qtype, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
           threads: int | None = None, lib: ctypes.CDLL | None = None, q8: bool = False) -> torch.Tensor:
    """y[N] = W[N, K] @ x[K]. w: uint8 [N, row_bytes] GGML blocks (rows contiguous, row
    stride free); x: [K] float; out: optional float32 [N] (contiguous). Returns y.
    `lib`: another build of the C kernels (tests), instead of the default backend.
    q8: MOE_Q8_TYPES rows dot x rounded to int8 per 32 values (C backend only; ~0.5% relative error)."""
    fmt = get_format(qtype)
    n, k = _check(fmt, w, x)
    x = _as_f32(x)
    y = _out(out, (n,))
    kind = _kernel(fmt, lib)
    if kind == "c":
        fn = (lib or _lib).moetier_matvec_q8 if q8 else (lib or _lib).moetier_matvec
        rc = fn(fmt.type_id, w.data_ptr(), w.stride(0), n, k, x.data_ptr(), y.data_ptr(), threads or _nthreads)
        _raise_on(rc, fmt, k)
    elif kind == "numba":
        from .cpu_numba import matvec_numba
        matvec_numba(fmt.name, w.numpy(), x.numpy(), y.numpy())
    else:
        y.copy_(expert_matvec(fmt, repack(fmt, w), x))
    return y


def matvec_batch(qtype, ws: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
    """M matvecs of one type and shape in one call: y[m] = ws[m] @ x[m]. ws: M uint8
    [N, row_bytes] tensors with equal row strides; x: [M, K]. Returns y [M, N] float32."""
    fmt = get_format(qtype)
    m = len(ws)
    n, k = _check(fmt, ws[0], x)
    if x.shape[0] != m or any(w.shape != ws[0].shape or w.stride() != ws[0].stride() for w in ws):
        raise ValueError(f"matvec_batch needs {m} weights of one shape/stride and x [{m}, K]; "
                         f"got x {tuple(x.shape)}")
    x = _as_f32(x)
    y = _out(out, (m, n))
    if _kernel(fmt, None) == "c":
        ptrs = (ctypes.c_void_p * m)(*[w.data_ptr() for w in ws])
        rc = _lib.moetier_matvec_batch(fmt.type_id, ptrs, ws[0].stride(0), m, n, k, x.data_ptr(),
                                       y.data_ptr(), threads or _nthreads)
        _raise_on(rc, fmt, k)
    else:
        for i, w in enumerate(ws):
            matvec(fmt, w, x[i], out=y[i], threads=threads)
    return y


def _formats(qtype):
    """qtype, or (gate_up qtype, down qtype) -> (gate_up format, down format)."""
    gu, dn = qtype if isinstance(qtype, (tuple, list)) else (qtype, qtype)
    return get_format(gu), get_format(dn)


def expert_ffn(qtype, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, act,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
    """One expert on rows x [n, D] -> [n, D] float32, straight from its GGML blocks: gate_up uint8
    [2I, row_bytes(D)] (gate rows, then up rows), down uint8 [D, row_bytes(I)]. qtype: one format,
    or (gate_up format, down format). SwiGLU without biases, n > 1: moe_grouped (each row read once for
    the n rows); else n matvecs per projection (the activation in float32)."""
    fmt, dfmt = _formats(qtype)
    if _kernel(fmt, None) == "torch" or _kernel(dfmt, None) == "torch":   # no C / numba kernel: the twin
        return expert_ffn_native((fmt, dfmt), gate_up, down, x, act, gate_up_bias, down_bias)
    x = _as_f32(x)
    n = x.shape[0]
    if n == 0:
        return x.new_empty(0, down.shape[0])
    from moetier.models.layers import swiglu
    if n > 1 and act is swiglu and gate_up_bias is None and down_bias is None and backend() == "c":
        i = gate_up.shape[0] // 2            # one expert of moe_grouped: each row read once for the n rows
        return moe_grouped((fmt, dfmt), gate_up[None, :i], gate_up[None, i:], down[None], x,
                           torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1), threads=threads)
    h = matvec_batch(fmt, [gate_up] * n, x, threads=threads)           # [n, 2I]
    if gate_up_bias is not None:
        h += gate_up_bias.float()
    gate, up = h.chunk(2, dim=-1)
    y = matvec_batch(dfmt, [down] * n, act(gate, up), threads=threads)  # [n, D]
    if down_bias is not None:
        y += down_bias.float()
    return y


def expert_ffn_native(qtype, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, act,
                      gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The pure-torch twin of expert_ffn: dequantize both weights to float32, then matmul."""
    fmt, dfmt = _formats(qtype)
    d, i2 = down.shape[0], gate_up.shape[0]
    wgu = dequantize(gate_up.contiguous(), fmt, (i2, d))                 # [2I, D]
    wd = dequantize(down.contiguous(), dfmt, (d, i2 // 2))               # [D, I]
    h = x.float() @ wgu.T
    if gate_up_bias is not None:
        h = h + gate_up_bias.float()
    gate, up = h.chunk(2, dim=-1)
    y = act(gate, up) @ wd.T
    return y + down_bias.float() if down_bias is not None else y


MOE_Q8_TYPES = {"Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ4_XS",
                "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}   # q8=True: int8 activations for these


def moe_tokens(qtype, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
               ids: torch.Tensor, w: torch.Tensor, q8: bool = False, threads: int | None = None) -> torch.Tensor:
    """One SwiGLU MoE layer for a few tokens in one C call (decode): y[t] = sum_j w[t, j] *
    down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]. gate / up: uint8 [E, I, row_bytes(D)], down
    [E, D, row_bytes(I)] GGML blocks (rows contiguous); x [T, D]; ids / w [T, k]. -> [T, D] float32.
    q8: MOE_Q8_TYPES rows dot an int8 copy of x and of the activation (per-32 scales, as llama.cpp),
    else float activations (moetier_matvec's arithmetic). Twin: moe_tokens_native."""
    fmt, dfmt = _formats(qtype)
    if backend() != "c" or _kernel(fmt, None) != "c" or _kernel(dfmt, None) != "c":
        return moe_tokens_native((fmt, dfmt), gate, up, down, x, ids, w)
    e, i, d = gate.shape[0], gate.shape[1], down.shape[1]
    if gate.stride() != up.stride() or gate.stride(-1) != 1 or down.stride(-1) != 1 or gate.dtype != torch.uint8:
        raise ValueError("moe_tokens needs uint8 gate/up of one stride and rows of contiguous bytes")
    x, ids, w = _as_f32(x), ids.to(torch.int64).contiguous(), _as_f32(w)
    y = torch.empty(x.shape[0], d, dtype=torch.float32)
    rc = _lib.moetier_moe_tokens(fmt.type_id, dfmt.type_id, gate.data_ptr(), up.data_ptr(), gate.stride(0),
                                 gate.stride(1), down.data_ptr(), down.stride(0), down.stride(1), e, d, i,
                                 x.shape[0], ids.shape[1], ids.data_ptr(), w.data_ptr(), x.data_ptr(), y.data_ptr(),
                                 int(q8), threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"CPU MoE kernel failed ({rc}): {fmt.name}/{dfmt.name} with D={d}, I={i} needs "
                           f"multiples of the block sizes and expert ids in [0, {e}); got ids {ids.tolist()}")
    return y


def moe_tokens_native(qtype, gate, up, down, x, ids, w) -> torch.Tensor:
    """The pure-torch twin of moe_tokens (float activations): each pair's expert dequantized."""
    fmt, dfmt = _formats(qtype)
    e, i, d = gate.shape[0], gate.shape[1], down.shape[1]
    y = torch.zeros(x.shape[0], d)
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        ex = int(ids[t, j])
        wg, wu = (dequantize(r[ex].contiguous(), fmt, (i, d)) for r in (gate, up))
        h = torch.nn.functional.silu(wg @ x[t].float()) * (wu @ x[t].float())
        y[t] += w[t, j].float() * (dequantize(down[ex].contiguous(), dfmt, (d, i)) @ h)
    return y


def moe_grouped(qtype, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                ids: torch.Tensor, w: torch.Tensor, q8: bool = False, threads: int | None = None,
                lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_tokens for many tokens (prefill), llama.cpp's way: the (token, expert) pairs bucketed by expert,
    each weight row read once per call and dotted with every pair routed to its expert (cpu_grouped.c).
    Same arguments and result as moe_tokens. Float activations: every format's rows dequantized per tile
    (products as the dequantized model's); q8: x and the activation rounded to int8 per 32 values for the
    types with int8 row kernels (cpu_moe.c moe_q8_type; llama.cpp's way, ~1% relative error), per 256 values
    for the 256-value formats' rows where grouped_int8_tile says so (llama.cpp's Q8_K, ~2%).
    `lib`: another build (tests); out: optional float32 [T, D]. Twin: moe_tokens_native."""
    fmt, dfmt = _formats(qtype)
    if lib is None and (backend() != "c" or _kernel(fmt, None) != "c" or _kernel(dfmt, None) != "c"):
        return moe_tokens_native((fmt, dfmt), gate, up, down, x, ids, w)
    e, i, d = gate.shape[0], gate.shape[1], down.shape[1]
    if gate.stride() != up.stride() or gate.stride(-1) != 1 or down.stride(-1) != 1 or gate.dtype != torch.uint8:
        raise ValueError("moe_grouped needs uint8 gate/up of one stride and rows of contiguous bytes")
    x, ids, w = _as_f32(x), ids.to(torch.int64).contiguous(), _as_f32(w)
    y = _out(out, (x.shape[0], d))
    rc = (lib or _lib).moetier_moe_grouped(
        fmt.type_id, dfmt.type_id, gate.data_ptr(), up.data_ptr(), gate.stride(0), gate.stride(1), down.data_ptr(),
        down.stride(0), down.stride(1), e, d, i, x.shape[0], ids.shape[1], ids.data_ptr(), w.data_ptr(),
        x.data_ptr(), y.data_ptr(), int(q8), threads or torch.get_num_threads())
    if rc:
        why = "out of memory" if rc == -2 else (f"D={d}, I={i} must be multiples of the block sizes and expert ids "
                                                 f"in [0, {e}); got ids in [{int(ids.min())}, {int(ids.max())}]")
        raise RuntimeError(f"CPU grouped MoE kernel failed ({fmt.name}/{dfmt.name}): {why}")
    return y


def grouped_lanes(lib: ctypes.CDLL | None = None) -> int:
    """Rows a step of the 256-value formats' rows-in-lanes prefill tile in this build (16 with AVX-512 VNNI, 8 with
    AVX-VNNI), 0 without one (plain AVX2: those formats' dense prefill stays on MKL, which their tile only matches)."""
    if lib is not None:
        return int(lib.moetier_grouped_lanes())
    return int(_lib.moetier_grouped_lanes()) if backend() == "c" else 0


def amx(want: bool | None = None, lib: ctypes.CDLL | None = None) -> bool:
    """Whether this process computes the 32-value formats' int8 prefill tile (Q4_0, Q8_0, IQ4_NL, IQ4_XS) on AMX
    (TDPBUSD: the same bits as the AVX-512 VNNI tile); `want` False / True turns it off / on where the CPU, the build
    and the OS allow it (MOETIER_AMX=0 in the environment starts it off). `lib`: another build (tests, benches)."""
    lib = lib or (_lib if backend() == "c" else None)
    if lib is None:
        return False
    return bool(lib.moetier_amx(-1 if want is None else int(want)))


def grouped_int8_tile(qtype, lib: ctypes.CDLL | None = None) -> bool:
    """Whether moe_grouped(q8=True) runs `qtype`'s rows through an integer tile in this build (each block's weights
    unpacked once for all pairs of an expert: Q4_0 / Q8_0, IQ4_NL / IQ4_XS with AVX-512 VNNI, and the 256-value
    formats (K-quants, IQ1_S .. IQ3_S) with activations rounded to int8 per 256 values as llama.cpp's Q8_K, with
    AVX2), instead of the q8 row dot per (row, pair).
    `lib`: another build (tests)."""
    if lib is not None:
        return bool(lib.moetier_grouped_int8_tile(get_format(qtype).type_id))
    return backend() == "c" and bool(_lib.moetier_grouped_int8_tile(get_format(qtype).type_id))


# The same kernel as a torch op, so torch.export / AOTInductor keep it as one call in the compiled
# CPU decode step (runtime/cpu_compile.py; the package calls it back through the dispatcher).
_ops = torch.library.Library("moetier", "DEF")
_ops.define("moe_tokens(Tensor x, Tensor ids, Tensor w, Tensor gate, Tensor up, Tensor down, "
            "int gate_type, int down_type, bool q8) -> Tensor")


def moe_tokens_op(x, ids, w, gate, up, down, gate_type: int, down_type: int, q8: bool):
    # the compiled decode step's call (float32, int64 ids, C kernels), and the eager one's (cpu_compile.fused_experts:
    # no dispatcher, ~6 us less): straight to C
    if x.dtype == w.dtype == torch.float32 and ids.dtype == torch.int64 and _backend == "c" \
            and x.is_contiguous() and ids.is_contiguous() and w.is_contiguous():
        y = torch.empty(x.shape[0], down.shape[1])
        gs, ds = gate.stride(), down.stride()
        if _lib.moetier_moe_tokens(gate_type, down_type, gate.data_ptr(), up.data_ptr(), gs[0], gs[1],
                                   down.data_ptr(), ds[0], ds[1], gate.shape[0], down.shape[1], gate.shape[1],
                                   x.shape[0], ids.shape[1], ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                   y.data_ptr(), int(q8), torch.get_num_threads()) == 0:
            return y
    from moetier.quant.formats import BY_ID     # any other call, or a failure explained
    return moe_tokens((BY_ID[gate_type], BY_ID[down_type]), gate, up, down, x, ids, w, q8).to(x.dtype)




@torch.library.register_fake("moetier::moe_tokens")
def _(x, ids, w, gate, up, down, gate_type, down_type, q8):
    return x.new_empty(x.shape[0], down.shape[1])


# Rows interleaved by 8 (interleave_rows): type ids of moetier_matvec_q8 only, not GGML types. GGML id -> its id.
# Q4_0, Q8_0, IQ4_NL, Q5_1, Q4_K, MXFP4, IQ4_XS
INTERLEAVED = {t: 0x100 | t for t in (2, 8, 20, 7, 12, 39, 23)}
# per-row fields before the quants: d (Q5_1: d, m, qh; Q4_K: d, dmin, then its 12 scale bytes as quants; MXFP4: e;
# IQ4_XS: d, scales_h, then its 4 scales_l bytes as quants)
_HEADER = {2: (2,), 8: (2,), 20: (2,), 7: (2, 2, 4), 12: (2, 2), 39: (1,), 23: (2, 2)}


def _interleaved_base(qtype) -> int | None:
    """The GGML type id of an INTERLEAVED id, else None."""
    return next((g for g, i in INTERLEAVED.items() if i == qtype), None) if isinstance(qtype, int) else None


def interleaved_supported(qtype_id: int) -> bool:
    """Whether the C kernels read GGML type `qtype_id`'s rows interleaved (built with int8 activations)."""
    return backend() == "c" and bool(_lib.moetier_x8_supported(qtype_id))


def interleave_rows(blocks: torch.Tensor, qtype_id: int) -> torch.Tensor:
    """Q4_0 / Q8_0 / IQ4_NL / Q5_1 / Q4_K / MXFP4 blocks uint8 [N, row bytes] (N a multiple of 8) -> the same number of
    bytes, shape kept, as moetier_matvec_q8 reads INTERLEAVED[qtype_id]: rows 8g..8g+7, block b: each header field of
    the 8 rows (their fp16 scales; Q5_1: then their mins and 5th bits; Q4_K: d, dmin; MXFP4: its e8m0 byte), then for each 4-byte group j of the
    rest of the block (the quants; Q4_K: its 12 scale bytes first) the 8 rows' bytes (row r at 4r); Q8_0's int8 values
    stored + 128. Undone by deinterleave_rows; interleave_inplace does it in C."""
    n, rb = blocks.shape
    head = _HEADER[qtype_id]
    bb = get_format(qtype_id).type_size
    b = blocks.reshape(n // 8, 8, rb // bb, bb)
    parts, off = [], 0
    for f in head:
        parts.append(b[..., off:off + f].permute(0, 2, 1, 3).reshape(n // 8, rb // bb, 8 * f))
        off += f
    q = b[..., off:] ^ 0x80 if qtype_id == 8 else b[..., off:]
    parts.append(q.reshape(n // 8, 8, rb // bb, (bb - off) // 4, 4).permute(0, 2, 3, 1, 4)
                 .reshape(n // 8, rb // bb, 8 * (bb - off)))
    return torch.cat(parts, -1).reshape(n, rb)


def deinterleave_rows(x8: torch.Tensor, qtype_id: int) -> torch.Tensor:
    n, rb = x8.shape
    head = _HEADER[qtype_id]
    bb = get_format(qtype_id).type_size
    g = x8.reshape(n // 8, rb // bb, 8 * bb)
    parts, off = [], 0
    for f in head:
        parts.append(g[..., 8 * off:8 * (off + f)].reshape(n // 8, rb // bb, 8, f).permute(0, 2, 1, 3))
        off += f
    q = g[..., 8 * off:].reshape(n // 8, rb // bb, (bb - off) // 4, 8, 4).permute(0, 3, 1, 2, 4)
    q = q.reshape(n // 8, 8, rb // bb, bb - off)
    parts.append(q ^ 0x80 if qtype_id == 8 else q)
    return torch.cat(parts, -1).reshape(n, rb)


def interleave_inplace(blocks: torch.Tensor, qtype_id: int, inverse: bool = False, threads: int | None = None) -> None:
    """interleave_rows (inverse: deinterleave_rows) of CPU uint8 [N, row bytes] blocks in place, in C (threads over
    groups of 8 rows): the RAM bank's experts for the miss server, gigabytes at a time. The C kernels only."""
    if backend() != "c":
        raise RuntimeError("interleave_inplace needs the C kernels")
    if blocks.device.type != "cpu" or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("interleave_inplace takes a contiguous CPU uint8 [N, row bytes] tensor")
    rc = _lib.moetier_interleave8(blocks.data_ptr(), blocks.shape[0], blocks.shape[1], qtype_id, int(inverse),
                                  threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"interleave_inplace: type {qtype_id} rows {tuple(blocks.shape)} cannot be interleaved by 8"
                         if rc == -1 else "interleave_inplace: out of memory")


def qlinear(qtype, w: torch.Tensor, x: torch.Tensor, q8: bool = False, threads: int | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W uint8 [N, row_bytes(K)] GGML blocks: the C matvec per row
    of x (float32 result). q8: MOE_Q8_TYPES rows dot x rounded to int8 per 32 values (llama.cpp's
    way, ~0.5% relative error); interleaved rows (INTERLEAVED ids) need it. Twin: qlinear_native."""
    base = _interleaved_base(qtype)
    x8 = base is not None
    fmt = get_format(base if x8 else qtype)
    if x8 and not (q8 and interleaved_supported(base)):
        raise ValueError(f"interleaved {fmt.name} rows are read by the C kernels with int8 activations only")
    x2 = _as_f32(x.reshape(-1, x.shape[-1]))
    n, k = _check(fmt, w, x2)
    threads = threads or torch.get_num_threads()
    if q8 and _kernel(fmt, None) == "c":      # a row of x at a time (decode: one)
        y = torch.empty(x2.shape[0], n)
        for i in range(x2.shape[0]):
            _raise_on(_lib.moetier_matvec_q8(qtype if x8 else fmt.type_id, w.data_ptr(), w.stride(0), n, k,
                                             x2[i].data_ptr(), y[i].data_ptr(), threads), fmt, k)
    elif x2.shape[0] == 1:
        y = matvec(fmt, w, x2[0], threads=threads)[None]
    else:
        y = matvec_batch(fmt, [w] * x2.shape[0], x2, threads=threads)
    return y.view(*x.shape[:-1], n)


def qlinear_native(qtype, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    base = _interleaved_base(qtype)
    if base is not None:
        qtype, w = base, deinterleave_rows(w, base)
    fmt = get_format(qtype)
    return x.float() @ dequantize(w.contiguous(), fmt, (w.shape[0], x.shape[-1])).T


def qgemm(qtype, w: torch.Tensor, x: torch.Tensor, q8: bool = True, threads: int | None = None,
          lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W.T for W uint8 [N, row_bytes(K)] GGML blocks, many rows of x at once (prefill): the
    grouped experts' tile (cpu_grouped.c moetier_qgemm), each weight row read once for all T rows. q8: x rounded to
    int8 per 32 values where the type has an int8 kernel (llama.cpp's way). Interleaved rows (INTERLEAVED ids) are put
    back in the file's order first, in a copy. `lib`: another build (tests, benches). Twin: qlinear_native."""
    base = _interleaved_base(qtype)
    if base is not None:
        w = w.clone()
        interleave_inplace(w, base, inverse=True, threads=threads)
        qtype = base
    fmt = get_format(qtype)
    if x.dim() != 2:
        raise ValueError(f"qgemm takes x [T, K]; got shape {tuple(x.shape)}")
    x = _as_f32(x)
    n, k = _check(fmt, w, x)
    if lib is None and _kernel(fmt, None) != "c":
        return qlinear_native(qtype, w, x)
    y = torch.empty(x.shape[0], n)
    rc = (lib or _lib).moetier_qgemm(fmt.type_id, w.data_ptr(), w.stride(0), n, k, x.shape[0], x.data_ptr(), y.data_ptr(),
                            int(q8), threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"CPU {fmt.name} qgemm failed: "
                           + ("out of memory" if rc == -2 else f"K={k} is not a multiple of 32 and of the block size"))
    return y


_ops.define("qlinear(Tensor x, Tensor w, int qtype, bool q8) -> Tensor")


def qlinear_op(x, w, qtype: int, q8: bool):
    # the compiled decode step's call (one float32 token), and the eager one's (cpu_compile._on_blocks): straight to
    # C, 7 us against qlinear()'s 25 on the dev box
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.is_contiguous() and _backend == "c":
        y = torch.empty(1, w.shape[0])
        rc = (_lib.moetier_matvec_q8 if q8 else _lib.moetier_matvec)(
            qtype, w.data_ptr(), w.stride(0), w.shape[0], x.shape[1], x.data_ptr(), y.data_ptr(),
            torch.get_num_threads())
        if rc == 0:
            return y
    return qlinear(qtype, w, x, q8).to(x.dtype)   # any other call, or a failure explained


# A decode block's two halves as torch ops too, so the compiled CPU step (runtime/cpu_compile.py) calls the C calls the
# eager step makes (attn_block, moe_block) instead of tracing the modules' pieces. Their Python kernels below, the C++
# ones in cpu_ops.cpp. attn_block writes the token's k / v row of the caches (views of the real ones).
_ops.define("attn_block(Tensor h, Tensor norm_w, float eps, Tensor w0, int t0, Tensor? w1, int t1, Tensor? w2, int t2, "
            "Tensor wo, int ot, bool q8, Tensor? qw, Tensor? kw, float qk_eps, Tensor cos, Tensor sin, Tensor pos, "
            "Tensor(a!) k_cache, Tensor(b!) v_cache, int nh, int hkv, float scale) -> Tensor")
_ops.define("moe_block(Tensor h, Tensor a, Tensor norm_w, float eps, Tensor router_w, int k, bool normalize, "
            "Tensor gate, Tensor up, Tensor down, int gate_type, int down_type, bool q8) -> Tensor")


def attn_block_op(h, norm_w, eps, w0, t0, w1, t1, w2, t2, wo, ot, q8, qw, kw, qk_eps, cos, sin, pos, k_cache, v_cache,
                  nh, hkv, scale):
    parts = tuple((t, w) for t, w in ((t0, w0), (t1, w1), (t2, w2)) if w is not None)
    out = attn_block(h, norm_w, eps, (parts, ot, wo, q8), qw, kw, qk_eps, cos.contiguous(), sin.contiguous(),
                     int(pos), k_cache, v_cache, nh, hkv, scale)
    if out is None:
        raise RuntimeError("moetier::attn_block: a GEMV refused its blocks")
    return out


def moe_block_op(h, a, norm_w, eps, router_w, k, normalize, gate, up, down, gate_type, down_type, q8):
    out = moe_block(h, a, norm_w, eps, router_w, k, normalize, (gate_type, down_type, gate, up, down, q8))
    return torch.full_like(h, float("nan")) if out is None else out      # NaN logits: NaN out, as the twin's


@torch.library.register_fake("moetier::attn_block")
def _(h, norm_w, eps, w0, t0, w1, t1, w2, t2, wo, ot, q8, qw, kw, qk_eps, cos, sin, pos, k_cache, v_cache, nh, hkv,
      scale):
    return torch.empty_like(h)


@torch.library.register_fake("moetier::moe_block")
def _(h, a, norm_w, eps, router_w, k, normalize, gate, up, down, gate_type, down_type, q8):
    return torch.empty_like(h)


# The CPU's token embeddings kept in their GGML blocks (models.quant_linear.QuantEmbedding): the rows of `tokens`
# dequantized, as a torch op so the compiled step's trace keeps the table a uint8 buffer (C++ kernel in cpu_ops.cpp).
_ops.define("embed_rows(Tensor tokens, Tensor w, int qtype, int k) -> Tensor")


def embed_rows_op(tokens, w, qtype: int, k: int):
    tokens = tokens.reshape(-1).long().contiguous()
    fmt = get_format(qtype)
    if fmt.name not in DEQUANT_TYPES or backend() != "c":
        from moetier.quant.formats import dequantize
        if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < w.shape[0]):
            raise IndexError(f"moetier::embed_rows: a token id is outside the vocabulary [0, {w.shape[0]})")
        return dequantize(w[tokens].contiguous(), fmt, (tokens.numel(), k))
    out = torch.empty(tokens.numel(), k)
    rc = _lib.moetier_embed_rows(fmt.type_id, w.data_ptr(), w.stride(0), w.shape[0], k, tokens.data_ptr(),
                                 tokens.numel(), out.data_ptr(), torch.get_num_threads())
    if rc == -3:
        raise IndexError(f"moetier::embed_rows: a token id is outside the vocabulary [0, {w.shape[0]})")
    _raise_on(rc, fmt, k)
    return out


@torch.library.register_fake("moetier::embed_rows")
def _(tokens, w, qtype, k):
    return tokens.new_empty(tokens.shape[0], k, dtype=torch.float32)


_py_kernels: torch.library.Library | None = None


def _register_python_kernels() -> None:
    global _py_kernels
    _py_kernels = torch.library.Library("moetier", "IMPL")
    _py_kernels.impl("moe_tokens", moe_tokens_op, "CPU")
    _py_kernels.impl("qlinear", qlinear_op, "CPU")
    _py_kernels.impl("attn_block", attn_block_op, "CPU")
    _py_kernels.impl("moe_block", moe_block_op, "CPU")
    _py_kernels.impl("embed_rows", embed_rows_op, "CPU")


_register_python_kernels()


@torch.library.register_fake("moetier::qlinear")
def _(x, w, qtype, q8):
    return x.new_empty(*x.shape[:-1], w.shape[0])


_native_ops: bool | None = None


def load_native_ops() -> bool:
    """Replace the Python kernels of moetier::qlinear / moe_tokens by cpu_ops.cpp (built once with g++
    against torch's headers, ~6 s, cached beside the C kernels): the compiled decode step then calls
    them without Python. False (Python kernels stay) without the C kernels or a C++ compiler."""
    global _native_ops
    if _native_ops is None:
        _native_ops = False
        if backend() == "c":
            try:
                path = _build_ops_library()
                _py_kernels._destroy()           # one CPU kernel per op: the C++ ones replace them
                try:
                    torch.ops.load_library(str(path))     # registers them (static initializers)
                except OSError:
                    _register_python_kernels()
                    raise
                ctypes.CDLL(str(path)).moetier_ops_bind(*(ctypes.cast(f, ctypes.c_void_p) for f in (
                    _lib.moetier_matvec, _lib.moetier_matvec_q8, _lib.moetier_moe_tokens, _lib.moetier_row_bytes,
                    _lib.moetier_attn_block, _lib.moetier_moe_block, _lib.moetier_embed_rows)))
                _native_ops = True
            except (RuntimeError, OSError) as e:
                log.warning("C++ kernels of the moetier torch ops unavailable (%s); the Python ones stay", e)
    return _native_ops


def _build_ops_library(cache_dir: Path | None = None) -> Path:
    from torch.utils import cpp_extension
    src = _SOURCE.with_name("cpu_ops.cpp")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{d}" for d in cpp_extension.include_paths()), *(f"-L{d}" for d in cpp_extension.library_paths()),
             "-lc10", "-ltorch_cpu"]
    cache_dir = cache_dir or Path.home() / ".cache" / "moetier" / "kernels"
    key = hashlib.sha256(src.read_bytes() + " ".join([cxx, torch.__version__, *flags]).encode()).hexdigest()[:16]
    so = cache_dir / f"cpu_ops_{key}.so"
    if not so.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        res = subprocess.run([cxx, str(src), *flags, "-o", tmp], capture_output=True, text=True, check=False)
        if res.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {src.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, so)
    return so


# ---------------------------------------------------------------- a decode token's small ops (cpu_small.c)
def small_ops_ok(*ts: torch.Tensor) -> bool:
    """cpu_small.c can take these tensors: the C kernels built, plain (not fake or traced) contiguous float32 CPU
    tensors."""
    if _backend != "c" and backend() != "c":
        return False
    for t in ts:          # a loop, not all(<generator>): called ~17 times a token (an eager step's overhead)
        if not (type(t) in _PLAIN and t.dtype == _F32 and t.is_cpu and t.is_contiguous()):
            return False
    return True


_PLAIN, _F32 = (torch.Tensor, torch.nn.Parameter), torch.float32


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# Work (keys x q heads x head dim) up to which cpu_small.c attends itself; beyond, torch's batched GEMMs over its prep's
# q. Session 25's C (a head a thread, a key at a time, libm's expf) lost past ~96 keys of 32 heads of 128; since
# session 37 (a KV group's heads together, four keys a dot, the exponentials 8 at a time) it wins at every size
# measured (dev box, 2-core EPYC, us C / torch, 1 thread | 2 threads): 32 heads of 128 (4 KV) at 128 keys 48 / 80 |
# 29 / 60, 2,048 keys 714 / 781 | 348 / 393, 8,192 keys - | 2,643 / 2,987; 6 heads of 64 (the default model) at 128
# keys 9 / 38, 2,048 keys 84 / 227, 8,192 keys | 165 / 496. Past 8,192 keys of 32 x 128 it is unmeasured.
ATTN_C_MAX_WORK = 8192 * 32 * 128


def decode_attention(qkv, q_w, k_w, eps: float, cos, sin, pos: int, k_cache, v_cache, h: int, hkv: int,
                     scale: float) -> torch.Tensor:
    """One token's qkv [1, (H + 2 Hkv) Dh] -> q / k RMSNorm (q_w / k_w [Dh] or None) and RoPE (cos / sin [1, R]: the
    first R features, halves), k and v into the caches [S, Hkv, Dh] at row `pos`, attention over [0, pos] -> [1, H Dh]
    (cpu_small.c; past ATTN_C_MAX_WORK the attention itself is models.layers.one_token_attention; the twin is
    models.layers.Attention's path for one token)."""
    dh = k_cache.shape[-1]
    if (pos + 1) * h * dh > ATTN_C_MAX_WORK:
        from ..models.layers import one_token_attention
        q = qkv.new_empty((1, h, dh))
        _lib.moetier_decode_attn_prep(qkv.data_ptr(), _ptr(q_w), _ptr(k_w), eps, cos.data_ptr(), sin.data_ptr(),
                                      cos.shape[-1], pos, k_cache.data_ptr(), v_cache.data_ptr(), h, hkv, dh,
                                      q.data_ptr())
        return one_token_attention(q, k_cache[:pos + 1], v_cache[:pos + 1], pos, scale).reshape(1, h * dh)
    out = qkv.new_empty((1, h * dh))
    rc = _lib.moetier_decode_attn(qkv.data_ptr(), _ptr(q_w), _ptr(k_w), eps, cos.data_ptr(), sin.data_ptr(),
                                  cos.shape[-1], pos, k_cache.data_ptr(), v_cache.data_ptr(), h, hkv, dh, scale,
                                  out.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("decode attention: out of memory for the scores")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over x's last dim (rows of a float32 contiguous tensor, weight [N]; cpu_small.c; a prompt's
    rows over torch's threads). The twin is models.layers.RMSNorm.native (F.rms_norm: float32 sums in another order)."""
    y = torch.empty_like(x)
    _lib.moetier_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1], x.shape[-1], y.data_ptr(),
                          torch.get_num_threads())
    return y


def qk_norm_rope(qkv: torch.Tensor, h: int, hkv: int, dh: int, qw: torch.Tensor | None, kw: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A prompt's q and k heads from qkv [T, >= (h + hkv) dh] (rows contiguous, any row stride): each head
    RMSNorm'd by qw / kw [dh] (None: no norm) and rotated by cos / sin [T, rot] (halves, rot <= dh, the rest passed
    through) -> [T, h + hkv, dh] (cpu_small.c; the twin: models.layers' rms_normalize * w and apply_rope)."""
    t = qkv.shape[0]
    y = torch.empty(t, h + hkv, dh)
    _lib.moetier_qk_norm_rope(qkv.data_ptr(), qkv.stride(0), t, h, hkv, dh, _ptr(qw), _ptr(kw), eps, cos.data_ptr(),
                              sin.data_ptr(), cos.shape[-1], y.data_ptr(), torch.get_num_threads())
    return y


def attn_block(h, norm_weight, eps: float, planes: tuple, q_w, k_w, qk_eps: float, cos, sin, pos: int, k_cache,
               v_cache, nh: int, hkv: int, scale: float) -> torch.Tensor | None:
    """O attention(W_qkv RMSNorm(h) * norm_weight) for one token [1, D] in one C call (cpu_small.c: the norm, the qkv
    matvecs, decode_attention, the o matvec). planes = (parts, o type id, o blocks, q8), parts ((type id, blocks
    [rows, bytes]), ...): q/k/v stacked in one, or q, k and v (a K-quant mix's own types), the matvecs' as qlinear_op
    takes them. None where a matvec refuses its blocks (the caller's modules then run; the cache row may be written
    already: they write the same)."""
    parts, ot, wo, q8 = planes
    args = []
    for i in range(3):
        t, w = parts[i] if i < len(parts) else (0, None)
        args += (t, None, 0, 0) if w is None else (t, w.data_ptr(), w.stride(0), w.shape[0])
    dh = k_cache.shape[-1]
    out = torch.empty_like(h)
    rc = _lib.moetier_attn_block(h.data_ptr(), norm_weight.data_ptr(), eps, h.shape[-1], *args, ot, wo.data_ptr(),
                                 wo.stride(0), int(q8), _ptr(q_w), _ptr(k_w), qk_eps, cos.data_ptr(), sin.data_ptr(),
                                 cos.shape[-1], pos, k_cache.data_ptr(), v_cache.data_ptr(), nh, hkv, dh, scale,
                                 out.data_ptr(), torch.get_num_threads())
    if rc == -3:
        raise MemoryError("decode attention block: out of memory")
    return None if rc else out


def moe_block(h, a, norm_weight, eps: float, weight, k: int, normalize: bool, planes: tuple):
    """s + experts(x, router_topk(x)) with s = h + a, x = RMSNorm(s) * norm_weight, for one token [1, D] in one C call
    (cpu_small.c: router_topk_add_norm, then moe_tokens, then the add). planes = (gate type id, down type id, gate, up,
    down, q8) as moe_tokens_op takes them (the experts' cpu_token_planes). None where the logits hold a NaN."""
    gq, dq, gate, up, down, q8 = planes
    out = torch.empty_like(h)
    gs, ds = gate.stride(), down.stride()
    rc = _lib.moetier_moe_block(h.data_ptr(), a.data_ptr(), norm_weight.data_ptr(), eps, h.shape[-1], weight.data_ptr(),
                                weight.shape[0], k, int(normalize), gq, dq, gate.data_ptr(), up.data_ptr(), gs[0],
                                gs[1], down.data_ptr(), ds[0], ds[1], gate.shape[1], int(q8), out.data_ptr(),
                                torch.get_num_threads())
    if rc == -2:
        return None
    if rc:
        raise RuntimeError(f"CPU MoE block failed ({rc}): k={k} of {weight.shape[0]} experts, types {gq}/{dq}, "
                           f"D={h.shape[-1]}, I={gate.shape[1]}" + (" (out of memory)" if rc == -3 else ""))
    return out


def router_topk_add_norm(h, a, norm_weight, eps: float, weight, k: int, normalize: bool):
    """(s, x, ids, w) = (h + a, RMSNorm(s) * norm_weight, the softmax router's top k of x) for one token [1, D]
    (cpu_small.c), or None where the logits hold a NaN (the caller's twin then decides)."""
    s, x = torch.empty_like(h), torch.empty_like(h)
    ids = torch.empty((1, k), dtype=torch.long)
    w = torch.empty((1, k), dtype=torch.float32)
    rc = _lib.moetier_router_add_norm(h.data_ptr(), a.data_ptr(), norm_weight.data_ptr(), eps, h.shape[-1],
                                      weight.data_ptr(), weight.shape[0], k, int(normalize), s.data_ptr(),
                                      x.data_ptr(), ids.data_ptr(), w.data_ptr(), torch.get_num_threads())
    if rc == -2:
        return None
    if rc:
        raise ValueError(f"router: k={k} outside [1, {weight.shape[0]}] experts, or out of memory")
    return s, x, ids, w


def dequantize_rows(qtype, raw: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """uint8 [..., N, row_bytes] GGML rows -> float32 [..., N, K], bit-exact with quant.dequantize:
    the C kernel for DEQUANT_TYPES (measured: the torch dequantizer took 29% of the default model's
    Q4_0 prefill), else torch."""
    fmt = get_format(qtype)
    k = raw.shape[-1] // fmt.type_size * fmt.block_size
    if fmt.name not in DEQUANT_TYPES or backend() != "c" or raw.device.type != "cpu":
        from moetier.quant.formats import dequantize
        return dequantize(raw, fmt, (*raw.shape[:-1], k))
    rows = raw.reshape(-1, raw.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*raw.shape[:-1], k, dtype=torch.float32)
    rc = _lib.moetier_dequant(fmt.type_id, rows.data_ptr(), rows.stride(0), rows.shape[0], k, out.data_ptr(),
                              threads or torch.get_num_threads())
    _raise_on(rc, fmt, k)
    return out


def stream_sum(a: torch.Tensor, threads: int | None = None) -> float:
    """Sum of a contiguous float32 CPU tensor by a plain streaming read (numel a multiple of
    64): the yardstick for RAM read bandwidth in bench/bench_cpu_kernels.py."""
    if backend() != "c":
        return float(a.sum())
    return _lib.moetier_sum_f32(a.data_ptr(), a.numel(), threads or _nthreads)
