"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention layer whose state is a fixed-size
matrix per head instead of a KV cache, plus a short causal convolution over its inputs.

Per head, with state S [Dk, Dv], decay g_t <= 0 (log space) and learning rate beta_t in (0, 1):
    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T      o_t = S_t^T q_t
`recurrent_gated_delta_rule` runs that token by token (decode, and the test twin);
`chunk_gated_delta_rule` computes the same for a whole prompt with matmuls inside chunks of C
tokens (the WY / UT-transform form) and one sequential step per chunk (`chunk_scan`).
Both are the pure-torch twins of kernels/triton_deltanet.py; models call them through
kernels/deltanet_ops.py. With `out_state` the final state is also copied there (the kernels write it
in place). Shapes: q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H]; state [H, Dk, Dv] (float32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64   # chunk length of the prefill form (the reference torch implementation's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _final(s: torch.Tensor, out_state: torch.Tensor | None) -> torch.Tensor:
    return s if out_state is None else out_state.copy_(s)


def recurrent_gated_delta_rule(q, k, v, g, beta, state, out_state=None):
    """Token by token. -> (out [T, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], s)                        # what S already recalls for k_t
        s = s + k[t][:, :, None] * ((v[t] - pred) * beta[t][:, None])[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(out), _final(s, out_state)


def _chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """[T, H, ...] -> [H, N, C, ...], zero-padded to N*C steps. Padded steps have k = v = beta = g = 0:
    decay 1 and no write, so they leave the state exactly as it was."""
    pad = (-x.shape[0]) % c
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.reshape(-1, c, *x.shape[1:]).movedim(2, 0)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK, out_state=None, scan=None):
    """Same result as `recurrent_gated_delta_rule`, in chunks of `chunk` tokens; `scan` runs the
    sequential part (default `chunk_scan`; the Triton kernel has its signature).
    Inside a chunk (positions i, j; G_i = cumulative log decay from the chunk start):
      D[i, j] = exp(G_i - G_j) for j <= i, else 0
      (I + tril(beta_i k_i.k_j D[i, j], -1)) [U | W] = [beta v | beta exp(G) k]    (one triangular solve)
      V' = U - W S;  O = (q exp(G)) S + ((q k^T) * D) V';  S <- exp(G_C) S + (k exp(G_C - G))^T V'
    -> (out [T, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    t, dv = q.shape[0], v.shape[-1]
    out, s = (scan or chunk_scan)(*chunk_prepare(q, k, v, g, beta, chunk), state, out_state)
    return out.movedim(0, 2).reshape(-1, out.shape[0], dv)[:t], s


def chunk_prepare(q, k, v, g, beta, chunk: int):
    """The parallel part of the chunk form, batched over every chunk -> u [H, N, C, Dv],
    w [H, N, C, Dk], q_in [H, N, C, Dk], intra [H, N, C, C], k_out [H, N, C, Dk], span [H, N, 1, 1]."""
    dv = v.shape[-1]
    q, k, v = (_chunks(x.float(), chunk) for x in (q, k, v))             # [H, N, C, D]
    g, beta = (_chunks(x.float(), chunk) for x in (g, beta))             # [H, N, C]
    cum = g.cumsum(-1)                                                    # G
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # D [H, N, C, C]
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    rhs = torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]                                     # [H, N, C, Dv], [H, N, C, Dk]
    intra = q @ k.transpose(-1, -2) * decay                               # [H, N, C, C]
    q_in = q * cum.exp()[..., None]                                       # reads the state at the chunk start
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]                    # writes decayed to the chunk end
    span = cum[..., -1].exp()[..., None, None]                            # [H, N, 1, 1]
    return u, w, q_in, intra, k_out, span


def chunk_scan(u, w, q_in, intra, k_out, span, state, out_state=None):
    """One step per chunk: V' = U - W S;  O = Q S + A V';  S = span S + K^T V' -> (out [H, N, C, Dv], S)."""
    s = state.float()
    out = torch.empty_like(u)
    for n in range(u.shape[1]):
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = q_in[:, n] @ s + intra[:, n] @ v_new
        s = s * span[:, n] + k_out[:, n].transpose(-1, -2) @ v_new
    return out, _final(s, out_state)


def causal_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU. x [T, C]; prev [K-1, C] the inputs before x (zeros at the
    start); weight [C, 1, K]. -> (y [T, C], the new prev [K-1, C])."""
    xs = torch.cat([prev.to(x.dtype), x])                                 # [K-1+T, C]
    y = F.conv1d(xs.T[None].to(weight.dtype), weight, groups=weight.shape[0])[0].T
    return F.silu(y).to(x.dtype), xs[xs.shape[0] - prev.shape[0]:]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, times silu(gate) (DeltaNet's output norm; plain weight)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(dtype) * F.silu(gate.float())).to(dtype)
