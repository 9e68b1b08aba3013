"""CPU expert kernels for cache misses: y[N] = W_q[N, K] @ x[K] read straight from GGML blocks.

Backend, chosen once at first use:
  "c"     cpu_kernels.c built with the system compiler (-O3 -march=native -fopenmp) into
          ~/.cache/moetier/kernels and called through ctypes (the GIL is released for the
          whole call; OpenMP splits rows over threads). Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
  "numba" the same loops in numba (parallel, nogil) when no compiler is found (Q8_0, Q4_0, Q4_K).
  "torch" any other type, or neither of the above: the reference (dequantize, then matmul).
The pure-torch twin is kernels.reference.expert_matvec; tests/test_quant_cpu_kernels.py
compares the two on random inputs. `expert_ffn` runs one whole expert (gate_up matvecs, the
activation in float32, down matvecs; gate_up and down may differ in format, as llama.cpp's
Q4_K_M stores some layers' down in Q6_K) for the memory tiers' CPU misses; its twin is
`expert_ffn_native` (tests/test_memory_gguf.py).
Decode ops (tests/test_cpu_moe_fused.py): `moe_tokens` (a SwiGLU MoE layer's k experts for a few tokens
in one C call; twin moe_tokens_native) and `qlinear` (twin qlinear_native), also the torch ops
moetier::moe_tokens / moetier::qlinear so torch.export keeps them whole in the compiled CPU decode step;
their CPU kernels are Python until `load_native_ops()` swaps in cpu_ops.cpp (no Python per call).
q8=True: Q4_0 / Q8_0 rows dot activations rounded to int8 per 32 values (llama.cpp's way).
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

FAST_TYPES = {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"}
NUMBA_TYPES = {"Q8_0", "Q4_0", "Q4_K"}     # cpu_numba.py
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib = None
_backend: str | None = None


def _cpu_signature() -> str:
    """Identifies the instruction set the library is built for (-march=native)."""
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def build_library(cache_dir: Path | None = None, march: str = "native", source: Path = _SOURCE) -> Path:
    """Compile cpu_kernels.c (once per source / compiler / flags / CPU); return the .so path.
    `march` other than "native" builds a portable variant (tests use it for the scalar path);
    `source` another file of this directory that #includes cpu_kernels.c (doorbell.c)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    cache_dir = cache_dir or Path.home() / ".cache" / "moetier" / "kernels"
    flags = [*_CFLAGS, f"-march={march}"]
    key = hashlib.sha256(_SOURCE.read_bytes() + source.read_bytes() + " ".join([cc, *flags]).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    so = cache_dir / f"{source.stem}_{key}.so"
    if not so.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        res = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True, check=False)
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
    lib.moetier_matvec_batch.argtypes = [c_int, ptr, i64, i64, i64, i64, ptr, ptr, c_int]
    lib.moetier_sum_f32.argtypes = [ptr, i64, c_int]
    lib.moetier_sum_f32.restype = ctypes.c_float
    lib.moetier_matvec_q8.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.moetier_moe_tokens.argtypes = [c_int, c_int, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64,
                                       ptr, ptr, ptr, ptr, c_int, c_int]
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
    if fmt.name not in FAST_TYPES:
        return "torch"
    if lib is not None:
        return "c"
    kind = backend()
    return "torch" if kind == "numba" and fmt.name not in NUMBA_TYPES else kind


def matvec(qtype, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
           threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y[N] = W[N, K] @ x[K]. w: uint8 [N, row_bytes] GGML blocks (rows contiguous, row
    stride free); x: [K] float; out: optional float32 [N] (contiguous). Returns y.
    `lib`: another build of the C kernels (tests), instead of the default backend."""
    fmt = get_format(qtype)
    n, k = _check(fmt, w, x)
    x = _as_f32(x)
    y = _out(out, (n,))
    kind = _kernel(fmt, lib)
    if kind == "c":
        rc = (lib or _lib).moetier_matvec(fmt.type_id, w.data_ptr(), w.stride(0), n, k,
                                          x.data_ptr(), y.data_ptr(), threads or _nthreads)
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
    or (gate_up format, down format). The weights are never dequantized (n matvecs per projection;
    the activation runs in float32)."""
    fmt, dfmt = _formats(qtype)
    if _kernel(fmt, None) == "torch" or _kernel(dfmt, None) == "torch":   # no C / numba kernel: the twin
        return expert_ffn_native((fmt, dfmt), gate_up, down, x, act, gate_up_bias, down_bias)
    x = _as_f32(x)
    n = x.shape[0]
    if n == 0:
        return x.new_empty(0, down.shape[0])
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


MOE_Q8_TYPES = {"Q8_0", "Q4_0"}     # moe_tokens(q8=True) quantizes activations to int8 for these


def moe_tokens(qtype, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
               ids: torch.Tensor, w: torch.Tensor, q8: bool = False, threads: int | None = None) -> torch.Tensor:
    """One SwiGLU MoE layer for a few tokens in one C call (decode): y[t] = sum_j w[t, j] *
    down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]. gate / up: uint8 [E, I, row_bytes(D)], down
    [E, D, row_bytes(I)] GGML blocks (rows contiguous); x [T, D]; ids / w [T, k]. -> [T, D] float32.
    q8: Q4_0 / Q8_0 rows dot an int8 copy of x and of the activation (per-32 scales, as llama.cpp),
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


# The same kernel as a torch op, so torch.export / AOTInductor keep it as one call in the compiled
# CPU decode step (runtime/cpu_compile.py; the package calls it back through the dispatcher).
_ops = torch.library.Library("moetier", "DEF")
_ops.define("moe_tokens(Tensor x, Tensor ids, Tensor w, Tensor gate, Tensor up, Tensor down, "
            "int gate_type, int down_type, bool q8) -> Tensor")


def _moe_tokens_op(x, ids, w, gate, up, down, gate_type: int, down_type: int, q8: bool):
    # the compiled decode step's call (float32, int64 ids, C kernels): straight to C
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


def qlinear(qtype, w: torch.Tensor, x: torch.Tensor, q8: bool = False, threads: int | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W uint8 [N, row_bytes(K)] GGML blocks: the C matvec per row
    of x (float32 result). q8: Q4_0 / Q8_0 rows dot x rounded to int8 per 32 values (llama.cpp's
    way, ~0.5% relative error). Twin: qlinear_native."""
    fmt = get_format(qtype)
    x2 = _as_f32(x.reshape(-1, x.shape[-1]))
    n, k = _check(fmt, w, x2)
    threads = threads or torch.get_num_threads()
    if q8 and _kernel(fmt, None) == "c":      # a row of x at a time (decode: one)
        y = torch.empty(x2.shape[0], n)
        for i in range(x2.shape[0]):
            _raise_on(_lib.moetier_matvec_q8(fmt.type_id, w.data_ptr(), w.stride(0), n, k, x2[i].data_ptr(),
                                             y[i].data_ptr(), threads), fmt, k)
    elif x2.shape[0] == 1:
        y = matvec(fmt, w, x2[0], threads=threads)[None]
    else:
        y = matvec_batch(fmt, [w] * x2.shape[0], x2, threads=threads)
    return y.view(*x.shape[:-1], n)


def qlinear_native(qtype, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    fmt = get_format(qtype)
    return x.float() @ dequantize(w.contiguous(), fmt, (w.shape[0], x.shape[-1])).T


_ops.define("qlinear(Tensor x, Tensor w, int qtype, bool q8) -> Tensor")


def _qlinear_op(x, w, qtype: int, q8: bool):
    # the compiled decode step's call (one float32 token): straight to C, ~7 us less than qlinear()
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.is_contiguous() and _backend == "c":
        y = torch.empty(1, w.shape[0])
        rc = (_lib.moetier_matvec_q8 if q8 else _lib.moetier_matvec)(
            qtype, w.data_ptr(), w.stride(0), w.shape[0], x.shape[1], x.data_ptr(), y.data_ptr(),
            torch.get_num_threads())
        if rc == 0:
            return y
    return qlinear(qtype, w, x, q8).to(x.dtype)   # any other call, or a failure explained


_py_kernels: torch.library.Library | None = None


def _register_python_kernels() -> None:
    global _py_kernels
    _py_kernels = torch.library.Library("moetier", "IMPL")
    _py_kernels.impl("moe_tokens", _moe_tokens_op, "CPU")
    _py_kernels.impl("qlinear", _qlinear_op, "CPU")


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
                    _lib.moetier_matvec, _lib.moetier_matvec_q8, _lib.moetier_moe_tokens)))
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


def dequantize_rows(qtype, raw: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """uint8 [..., N, row_bytes] GGML rows -> float32 [..., N, K], bit-exact with quant.dequantize:
    the C kernel for Q8_0 / Q4_0 (measured: the torch dequantizer took 29% of the default model's
    Q4_0 prefill), else torch."""
    fmt = get_format(qtype)
    k = raw.shape[-1] // fmt.type_size * fmt.block_size
    if fmt.name not in ("Q8_0", "Q4_0") or backend() != "c" or raw.device.type != "cpu":
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
