"""Triton kernels of the gated delta rule (GPU; CPU under TRITON_INTERPRET). Twins: models/deltanet.py.

The rule is separable along Dv: column j of the state S [Dk, Dv] only ever meets v[:, j], so each
program owns one (head, BV-column block) tile of S, keeps it in registers for the whole call and
writes it back once. Programs never share data: the state may be updated in place (out_state is
state), and a decode step is one launch with no host sync (CUDA-graph capturable).

recurrent (decode, any T, token by token):  grid (H, Dv/BV)
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
chunk_scan (prefill): the sequential part of models/deltanet.chunk_gated_delta_rule, one step per
chunk of C tokens with three tensor-core dots (fp32 in, IEEE fp32 accumulation: no TF32 rounding
into a state that accumulates over the whole prompt):
    V' = U - W S;  O = Q S + A V';  S = span S + K^T V'
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_in_ptr, s_out_ptr, o_ptr, T, H, DK, DV,
                      BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_in_ptr + tile, mask=mask, other=0.0).to(tl.float32)            # [BK, BV]
    t = 0
    while t < T:   # a while loop: the interpreter cannot range() over a runtime int (numpy >= 2)
        row = t * H + h
        kt = tl.load(k_ptr + row * DK + rk, mask=mk, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + row * DK + rk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + row * DV + rv, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + row).to(tl.float32)
        bt = tl.load(b_ptr + row).to(tl.float32)
        s = s * tl.exp(gt)
        pred = tl.sum(kt[:, None] * s, axis=0)                                    # S^T k  [BV]
        s = s + kt[:, None] * ((vt - pred) * bt)[None, :]
        tl.store(o_ptr + row * DV + rv, tl.sum(qt[:, None] * s, axis=0), mask=mv)
        t += 1
    tl.store(s_out_ptr + tile, s, mask=mask)


@triton.jit
def _chunk_scan_kernel(u_ptr, w_ptr, q_ptr, a_ptr, k_ptr, span_ptr, s_in_ptr, s_out_ptr, o_ptr, N, DK, DV,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
    s = tl.load(s_in_ptr + tile, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)   # [BK, BV]
    ck = rc[:, None] * DK + rk[None, :]                                           # [C, BK] offsets
    cv = rc[:, None] * DV + rv[None, :]                                           # [C, BV]
    cc = rc[:, None] * C + rc[None, :]                                            # [C, C]
    mck, mcv = mk[None, :] & (rc[:, None] < C), mv[None, :] & (rc[:, None] < C)
    n = 0
    while n < N:
        hn = h * N + n
        w = tl.load(w_ptr + hn * C * DK + ck, mask=mck, other=0.0)
        u = tl.load(u_ptr + hn * C * DV + cv, mask=mcv, other=0.0)
        v_new = u - tl.dot(w, s, input_precision="ieee")                           # [C, BV]
        qc = tl.load(q_ptr + hn * C * DK + ck, mask=mck, other=0.0)
        a = tl.load(a_ptr + hn * C * C + cc)
        o = tl.dot(qc, s, input_precision="ieee") + tl.dot(a, v_new, input_precision="ieee")
        tl.store(o_ptr + hn * C * DV + cv, o, mask=mcv)
        kc = tl.load(k_ptr + hn * C * DK + ck, mask=mck, other=0.0)
        s = s * tl.load(span_ptr + hn) + tl.dot(tl.trans(kc), v_new, input_precision="ieee")
        n += 1
    tl.store(s_out_ptr + tile, s, mask=mk[:, None] & mv[None, :])


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    # 32 value columns per program: 128 programs for 32 heads of Dv 128, about one per SM of an H100/H200
    return triton.next_power_of_2(max(dk, 16)), min(32, triton.next_power_of_2(max(dv, 16)))


def _state_out(state: torch.Tensor, out_state: torch.Tensor | None) -> torch.Tensor:
    if out_state is None:
        return torch.empty_like(state, dtype=torch.float32)
    if out_state.dtype != torch.float32 or out_state.shape != state.shape or not out_state.is_contiguous():
        raise ValueError(f"out_state must be a contiguous float32 {tuple(state.shape)} tensor; got "
                         f"{out_state.dtype} {tuple(out_state.shape)}")
    return out_state


def recurrent(q, k, v, g, beta, state, out_state=None):
    """models/deltanet.recurrent_gated_delta_rule in one launch. q, k [T, H, Dk]; v [T, H, Dv]; g, beta
    [T, H]; state [H, Dk, Dv] float32. -> (out [T, H, Dv] float32, final state: out_state if given,
    which may be `state` itself)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s_in = state.contiguous().float()
    s_out = _state_out(state, out_state)
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    bk, bv = _blocks(dk, dv)
    _recurrent_kernel[(h, triton.cdiv(dv, bv))](q, k, v, g, beta, s_in, s_out, out, t, h, dk, dv, BK=bk, BV=bv,
                                                num_warps=4)
    return out, s_out


def chunk_scan(u, w, q_in, intra, k_out, span, state, out_state=None):
    """models/deltanet.chunk_scan: u [H, N, C, Dv], w, q_in, k_out [H, N, C, Dk], intra [H, N, C, C],
    span [H, N, 1, 1], state [H, Dk, Dv] -> (out [H, N, C, Dv], final state). C >= 16, a power of 2."""
    h, n, c, dv = u.shape
    dk = w.shape[-1]
    u, w, q_in, intra, k_out = (x.float().contiguous() for x in (u, w, q_in, intra, k_out))
    span = span.float().reshape(h, n).contiguous()
    s_in = state.contiguous().float()
    s_out = _state_out(state, out_state)
    out = torch.empty(h, n, c, dv, dtype=torch.float32, device=u.device)
    bk, bv = _blocks(dk, dv)
    _chunk_scan_kernel[(h, triton.cdiv(dv, bv))](u, w, q_in, intra, k_out, span, s_in, s_out, out, n, dk, dv,
                                                 C=c, BK=bk, BV=bv, num_warps=4)
    return out, s_out
