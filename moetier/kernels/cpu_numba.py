"""numba versions of the CPU block matvecs (fallback when no C compiler is available).

Same loops as cpu_kernels.c, without SIMD intrinsics: several times slower (measured in
docs/perf-log.md), but GIL-free (nogil) and multi-threaded (prange over rows).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

_F16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)  # bits -> value


@njit(inline="always")
def _d(w, n, o, f16):
    return f16[np.int32(w[n, o]) | (np.int32(w[n, o + 1]) << 8)]


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _q8_0(w, x, y, f16):
    wi = w.view(np.int8)
    for n in prange(w.shape[0]):
        acc = np.float32(0.0)
        for b in range(x.shape[0] // 32):
            s = np.float32(0.0)
            for j in range(32):
                s += np.float32(wi[n, 34 * b + 2 + j]) * x[32 * b + j]
            acc += _d(w, n, 34 * b, f16) * s
        y[n] = acc


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _q4_0(w, x, y, f16):
    for n in prange(w.shape[0]):
        acc = np.float32(0.0)
        for b in range(x.shape[0] // 32):
            s = np.float32(0.0)
            for j in range(16):
                q = w[n, 18 * b + 2 + j]
                s += np.float32((q & 15) - 8) * x[32 * b + j] + np.float32((q >> 4) - 8) * x[32 * b + 16 + j]
            acc += _d(w, n, 18 * b, f16) * s
        y[n] = acc


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _q4_k(w, x, y, f16):
    for n in prange(w.shape[0]):
        acc = np.float32(0.0)
        for b in range(x.shape[0] // 256):
            o, xo = 144 * b, 256 * b
            d, dmin = _d(w, n, o, f16), _d(w, n, o + 2, f16)
            for j in range(8):                       # 6-bit scale / min of sub-block j
                if j < 4:
                    sc, mn = w[n, o + 4 + j] & 63, w[n, o + 8 + j] & 63
                else:
                    sc = (w[n, o + 12 + j - 4] & 15) | ((w[n, o + j] >> 2) & 48)
                    mn = (w[n, o + 12 + j - 4] >> 4) | ((w[n, o + 4 + j] >> 2) & 48)
                c, shift = j // 2, 4 * (j % 2)
                s, xs = np.float32(0.0), np.float32(0.0)
                for i in range(32):
                    xv = x[xo + 32 * j + i]
                    s += np.float32((w[n, o + 16 + 32 * c + i] >> shift) & 15) * xv
                    xs += xv
                acc += d * np.float32(sc) * s - dmin * np.float32(mn) * xs
        y[n] = acc


_KERNELS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k}


def matvec_numba(qtype: str, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """y[N] = W[N, K] @ x[K]; w uint8 [N, row_bytes], x float32 [K], y float32 [N]."""
    _KERNELS[qtype](w, x, y, _F16)
