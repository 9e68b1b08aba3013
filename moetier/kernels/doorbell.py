"""Doorbells between a CUDA-graph decode step and CPU threads (the design of LESSONS.md section 1).

Per MoE layer, inside the graph:
  ring(...)      one kernel: slots = table[ids] (-1 = not on the GPU), the request (x as float32,
                 ids, w, slots; with Requests.q8 also x's int8 copy as the C server's prep makes it) written to
                 pinned host memory, then bell[li] = seq (release, system scope)
  <hits>         ops.moe_decode over the GPU slots; slot -1 adds nothing
  wait_add(...)  if any slot is -1: spin until done[li] == seq, then out = hits + y[li]
                 (wait_add_norm: with the residual, then the next layer's input norm of out and its int8 copy)
On the host, `MissServer.serve(seq)` (C, doorbell.c, GIL released) answers every layer of the step.
The sequence number lives on the device (`seq`, bumped by layer 0's ring), so the graph's kernel
arguments never change; the host keeps its own count in step.

Host buffers are pinned, so with unified addressing the kernels read and write them directly.
Under TRITON_INTERPRET (CPU tests) the same kernels run on CPU tensors with plain loads and stores.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

BELL_STRIDE = 16            # int64 per layer (doorbell.c)
TIMED_THREADS = 64          # miss threads with timings of their own (doorbell.c)
GGML_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_lib = None

try:
    import triton
    import triton.language as tl
except ImportError:     # pragma: no cover - the graph path needs triton; MissServer does not
    triton = None


if triton is not None:
    from .triton_small import _norm_q8, _router_part, _router_part_add_norm, _router_pick, pdl

    @triton.jit
    def _store_release(ptr, val, SYS: tl.constexpr):
        if SYS:
            tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tst.volatile.global.u64 [$1], $2;\n\tmov.u32 $0, 0;",
                                      "=r,l,l", [ptr, val], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.store(ptr, val)

    @triton.jit
    def _load_acquire(ptr, SYS: tl.constexpr):
        if SYS:
            v = tl.inline_asm_elementwise("ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [ptr],
                                          dtype=tl.int64, is_pure=False, pack=1)
        else:
            v = tl.load(ptr, volatile=True)
        return v

    @triton.jit
    def _now_ns(SYS: tl.constexpr):
        if SYS:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        else:
            t = tl.zeros((), dtype=tl.int64)
        return t

    @triton.jit
    def _pcie_pick(e, miss, cand, share, NP: tl.constexpr, BK: tl.constexpr):
        """The misses the GPU reads over PCIe: the round(share * misses) (at most NP) candidates of lowest expert id
        (an order the guess of the next layer's misses reproduces from the set alone). -> (taken, rank by id)."""
        n_miss = tl.sum(miss.to(tl.int32), axis=0)
        m = tl.minimum((n_miss.to(tl.float32) * share + 0.5).to(tl.int32), NP)
        ej = tl.reshape(e, (BK, 1))
        ci = tl.reshape(cand, (1, BK))
        ei = tl.reshape(e, (1, BK))
        rank = tl.sum((ci & (ei < ej)).to(tl.int32), axis=1)
        return cand & (rank < m), rank

    @triton.jit
    def _rint(y, ASM: tl.constexpr):
        """float32 y -> the nearest integer (ties to even, as the C prep's _mm256_cvtps_epi32), int32. On a GPU one
        cvt.rni: the magic-number add of the interpreter's branch could be fused with the product before it."""
        if ASM:         # (y's bits in a b32 register: PTX takes it as the f32 operand)
            r = tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [y.to(tl.int32, bitcast=True)],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = ((y + 12582912.0) - 12582912.0).to(tl.int32)
        return r

    @triton.jit
    def _ring_q8(x, b0, qx_ptr, dx_ptr, sx_ptr, D: tl.constexpr, BD: tl.constexpr, ASM: tl.constexpr):
        """x float32 [BD] (elements 32 b0 ...; 0 past D) -> its int8 copy, scales and sums for blocks b0 .. as the
        C server's prep writes them (cpu_moe.c moe_quantize_q8) bit for bit: d = amax / 127, q = rint(x * (1 / d))
        with 1 / d rounded once (0 where d == 0), s = d * sum(q)."""
        xb = tl.reshape(x, [BD // 32, 32])
        d = tl.math.div_rn(tl.max(tl.abs(xb), axis=1), 127.0)
        inv = tl.where(d > 0, tl.math.div_rn(1.0, tl.where(d > 0, d, 1.0)), 0.0)
        q = _rint(xb * inv[:, None], ASM)
        b = b0 + tl.arange(0, BD // 32)
        bm = b < D // 32
        tl.store(qx_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], q.to(tl.int8), mask=bm[:, None])
        tl.store(dx_ptr + b, d, mask=bm)
        tl.store(sx_ptr + b, d * tl.sum(q, axis=1).to(tl.float32), mask=bm)

    @triton.jit
    def _ring_kernel(x_ptr, ids_ptr, w_ptr, table_ptr, seq_ptr, slots_ptr,
                     hx_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr, poff_ptr, soff_ptr, share, stage0, stamp_ptr,
                     qx_ptr, dx_ptr, sx_ptr, D: tl.constexpr, K: tl.constexpr, BUMP: tl.constexpr, SYS: tl.constexpr,
                     BD: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, BNP: tl.constexpr, STAMP: tl.constexpr,
                     Q8: tl.constexpr):
        _ring(x_ptr, ids_ptr, w_ptr, table_ptr, seq_ptr, slots_ptr, hx_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr,
              poff_ptr, soff_ptr, share, stage0, D, K, BUMP, SYS, BD, BK, NP, BNP, stamp_ptr, STAMP,
              qx_ptr, dx_ptr, sx_ptr, Q8)

    @triton.jit
    def _route_ring_kernel(x_ptr, wt_ptr, logit_ptr, cnt_ptr, ids_ptr, w_ptr, table_ptr, seq_ptr, slots_ptr,
                           hx_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr, stamp_ptr, qx_ptr, dx_ptr, sx_ptr,
                           E: tl.constexpr, D: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
                           BD: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, BUMP: tl.constexpr,
                           SYS: tl.constexpr, BXD: tl.constexpr, STAMP: tl.constexpr, Q8: tl.constexpr):
        """The router (triton_small._router_topk_kernel) and, in its last program, the ring: one launch."""
        tab = _table_row(table_ptr, E, BE)
        if _router_part(x_ptr, wt_ptr, logit_ptr, cnt_ptr, E, D, ROWS, BD, PDL):
            seq = tl.load(seq_ptr)
            e, w, at = _router_pick(logit_ptr, ids_ptr, w_ptr, E, K, NORM, BE, BK)
            _copy_x(x_ptr, hx_ptr, qx_ptr, dx_ptr, sx_ptr, D, BXD, SYS, Q8)
            _ring_picked(e, w, _picked(tab, at), seq, seq_ptr, slots_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr,
                         K, BUMP, SYS, BK, stamp_ptr, STAMP)

    @triton.jit
    def _route_ring_add_norm_kernel(x_ptr, wt_ptr, logit_ptr, cnt_ptr, ids_ptr, w_ptr, h_ptr, a_ptr, nw_ptr, s_ptr,
                                    N, eps, table_ptr, seq_ptr, slots_ptr, hx_ptr, hids_ptr, hw_ptr, hslots_ptr,
                                    bell_ptr, stamp_ptr, qx_ptr, dx_ptr, sx_ptr, E: tl.constexpr, D: tl.constexpr,
                                    K: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr,
                                    BE: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, BUMP: tl.constexpr,
                                    SYS: tl.constexpr, STAMP: tl.constexpr, Q8: tl.constexpr):
        """_route_ring_kernel on x = RMSNorm(h + a) * nw made in the launch (triton_small._router_add_norm_kernel):
        the last program writes the request's x (and its int8 copy) from its own registers (every program holds x: no
        read-back of program 0's store to x_ptr, which would lean on the counter's ordering and on loads that bypass
        L1)."""
        tab = _table_row(table_ptr, E, BE)
        last, x = _router_part_add_norm(x_ptr, wt_ptr, logit_ptr, cnt_ptr, h_ptr, a_ptr, nw_ptr, s_ptr, N, eps, E, D,
                                        ROWS, BD, PDL)
        if last:
            seq = tl.load(seq_ptr)
            d = tl.arange(0, BD)
            tl.store(hx_ptr + d, x.to(tl.float32), mask=d < D)      # before _ring_picked's barrier and bell
            if Q8:
                _ring_q8(x.to(tl.float32), 0, qx_ptr, dx_ptr, sx_ptr, D, BD, SYS)
            e, w, at = _router_pick(logit_ptr, ids_ptr, w_ptr, E, K, NORM, BE, BK)
            _ring_picked(e, w, _picked(tab, at), seq, seq_ptr, slots_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr,
                         K, BUMP, SYS, BK, stamp_ptr, STAMP)

    @triton.jit
    def _table_row(table_ptr, E: tl.constexpr, BE: tl.constexpr):
        """The layer's slot table, every expert (loaded by every router program at its start, before the PDL wait:
        the last one then needs no load that depends on its picks; the table only gains slots while a step runs,
        so an early read is as valid as a late one: a -1 is answered by the CPU)."""
        ee = tl.arange(0, BE)
        return tl.load(table_ptr + ee, mask=ee < E, other=0)

    @triton.jit
    def _picked(tab, at):
        """The table entries of _topk_picks' picks (at [BE, BK]: one lane each: exact)."""
        return tl.sum(tl.where(at, tab[:, None], 0), axis=0)

    @triton.jit
    def _copy_x(x_ptr, hx_ptr, qx_ptr, dx_ptr, sx_ptr, D: tl.constexpr, BD: tl.constexpr, SYS: tl.constexpr,
                Q8: tl.constexpr):
        """x [D] from x_ptr to the host row hx_ptr, with Q8 its int8 copy (_ring_q8)."""
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            xf = tl.load(x_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
            tl.store(hx_ptr + dd, xf, mask=dd < D)
            if Q8:
                _ring_q8(xf, d0 // 32, qx_ptr, dx_ptr, sx_ptr, D, BD, SYS)

    @triton.jit
    def _ring(x_ptr, ids_ptr, w_ptr, table_ptr, seq_ptr, slots_ptr,
              hx_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr, poff_ptr, soff_ptr, share, stage0,
              D: tl.constexpr, K: tl.constexpr, BUMP: tl.constexpr, SYS: tl.constexpr,
              BD: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, BNP: tl.constexpr,
              stamp_ptr, STAMP: tl.constexpr, qx_ptr, dx_ptr, sx_ptr, Q8: tl.constexpr):
        """The request of one layer (module docstring) from the routed ids / w in memory: x [D] from x_ptr to hx_ptr,
        with Q8 its int8 copy to qx_ptr, dx_ptr, sx_ptr (_ring_q8), then _ring_picked."""
        seq = tl.load(seq_ptr)
        kk = tl.arange(0, BK)
        km = kk < K
        e = tl.load(ids_ptr + kk, mask=km, other=0)
        s = tl.load(table_ptr + e, mask=km, other=0)
        if NP > 0:      # round(share * misses) misses (at most NP), lowest expert ids first, go to stage slots over PCIe
            miss = km & (s < 0)
            off = tl.load(poff_ptr + e, mask=miss, other=-1)
            cand = miss & (off >= 0)
            take, rank = _pcie_pick(e, miss, cand, share, NP, BK)
            s = tl.where(take, stage0 + rank, s)
            jj = tl.arange(0, BNP)
            tl.store(soff_ptr + jj, tl.full([BNP], -1, tl.int64), mask=jj < NP)
            tl.debug_barrier()
            tl.store(soff_ptr + rank, off.to(tl.int64), mask=take)
        w = tl.load(w_ptr + kk, mask=km, other=0.0)
        _copy_x(x_ptr, hx_ptr, qx_ptr, dx_ptr, sx_ptr, D, BD, SYS, Q8)
        _ring_picked(e, w, s, seq, seq_ptr, slots_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr, K, BUMP, SYS, BK,
                     stamp_ptr, STAMP)

    @triton.jit
    def _ring_picked(e, w, s, seq, seq_ptr, slots_ptr, hids_ptr, hw_ptr, hslots_ptr, bell_ptr, K: tl.constexpr,
                     BUMP: tl.constexpr, SYS: tl.constexpr, BK: tl.constexpr, stamp_ptr, STAMP: tl.constexpr):
        """The request's ids e, weights w and slots s [BK] (first K) to their rows (slots on the device too); seq
        (seq_ptr's value, bumped and stored where BUMP: layer 0 starts a new step); then the bell after every
        thread's stores (the caller's of x too)."""
        if BUMP:
            seq = seq + 1
            tl.store(seq_ptr, seq)
        kk = tl.arange(0, BK)
        km = kk < K
        tl.store(slots_ptr + kk, s.to(tl.int64), mask=km)
        tl.store(hids_ptr + kk, e.to(tl.int32), mask=km)
        tl.store(hw_ptr + kk, w.to(tl.float32), mask=km)
        tl.store(hslots_ptr + kk, s.to(tl.int32), mask=km)
        tl.debug_barrier()
        if STAMP:       # diagnosis (MOETIER_STAMP=1): the GPU's clock as it rings, stamp[2]
            tl.store(stamp_ptr + 2, _now_ns(SYS))
        _store_release(bell_ptr, seq, SYS)

    @triton.jit
    def _wait_add_kernel(hits_ptr, slots_ptr, seq_ptr, done_ptr, hy_ptr, out_ptr, err_ptr, res_ptr, D, K, max_spin,
                         timeout_ns, stamp_ptr, SYS: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                         HAS_RES: tl.constexpr, TRIGGER: tl.constexpr, STAMP: tl.constexpr):
        if TRIGGER:     # the next kernel (the next layer's norm) may be scheduled while this one spins
            tl.extra.cuda.gdc_launch_dependents()
        _wait_add(hits_ptr, slots_ptr, seq_ptr, done_ptr, hy_ptr, out_ptr, err_ptr, res_ptr, D, K, max_spin,
                  timeout_ns, stamp_ptr, SYS, BD, BK, HAS_RES, STAMP)
        if STAMP & (tl.program_id(0) == 0):     # and as it has added it, stamp[1]
            tl.store(stamp_ptr + 1, _now_ns(SYS))

    @triton.jit
    def _wait_add_norm_kernel(hits_ptr, slots_ptr, seq_ptr, done_ptr, hy_ptr, out_ptr, err_ptr, res_ptr, D, K,
                              max_spin, timeout_ns, stamp_ptr, nw_ptr, x_ptr, q_ptr, dx_ptr, xs_ptr, eps,
                              SYS: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, TRIGGER: tl.constexpr,
                              STAMP: tl.constexpr):
        """_wait_add_kernel with the residual in one program (BD >= D), then the next decoder layer's input norm
        of out and its int8 copy to x_ptr, q_ptr, dx_ptr, xs_ptr (triton_small._norm_q8 on out loaded back as
        _rms_norm_q8_kernel loads its x: the same layout, the same sums); stamp[1] after all of it."""
        if TRIGGER:     # the next kernel (the next layer's qkv GEMV) may be scheduled while this one spins
            tl.extra.cuda.gdc_launch_dependents()
        n = tl.arange(0, BD)
        m = n < D
        w = tl.load(nw_ptr + n, mask=m, other=0.0)      # before the spin: off the path after the CPU's answer
        _wait_add(hits_ptr, slots_ptr, seq_ptr, done_ptr, hy_ptr, out_ptr, err_ptr, res_ptr, D, K, max_spin,
                  timeout_ns, stamp_ptr, SYS, BD, BK, True, STAMP)
        tl.debug_barrier()      # every thread's stores of out, visible to the program's loads below
        x = tl.load(out_ptr + n, mask=m, other=0.0)
        _norm_q8(x, w, D, eps, x_ptr, q_ptr, dx_ptr, xs_ptr, BD)
        if STAMP:
            tl.store(stamp_ptr + 1, _now_ns(SYS))

    @triton.jit
    def _wait_add(hits_ptr, slots_ptr, seq_ptr, done_ptr, hy_ptr, out_ptr, err_ptr, res_ptr, D, K, max_spin,
                  timeout_ns, stamp_ptr, SYS: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                  HAS_RES: tl.constexpr, STAMP: tl.constexpr):
        """out[this program's BD] = hits (+ y once done == seq, when a slot is -1) (+ res), rounded as wait_add says;
        stamp[0] as the answer is seen."""
        kk = tl.arange(0, BK)
        s = tl.load(slots_ptr + kk, mask=kk < K, other=0)
        n_miss = tl.sum((s < 0).to(tl.int32), axis=0)
        dd = tl.program_id(0) * BD + tl.arange(0, BD)
        dm = dd < D
        acc = tl.load(hits_ptr + dd, mask=dm, other=0.0).to(tl.float32)
        if HAS_RES:     # loaded before the spin (its acquire loads keep later loads after them)
            res = tl.load(res_ptr + dd, mask=dm, other=0.0).to(tl.float32)
        failed = tl.load(err_ptr, volatile=True)    # an earlier layer timed out: do not wait again
        if (n_miss > 0) & (failed == 0):
            seq = tl.load(seq_ptr)
            flag = _load_acquire(done_ptr, SYS)
            n = 0
            t0 = _now_ns(SYS)
            late = 0
            while (flag != seq) & (n < max_spin) & (late == 0):
                flag = _load_acquire(done_ptr, SYS)
                n += 1
                if (n % 256) == 0:
                    late = ((_now_ns(SYS) - t0) > timeout_ns).to(tl.int32)
            if flag != seq:             # the host never answered: report, add nothing
                tl.store(err_ptr, seq)
            else:
                if STAMP & (tl.program_id(0) == 0):     # diagnosis: the GPU's clock as it sees the answer, stamp[0]
                    tl.store(stamp_ptr, _now_ns(SYS))
                acc += tl.load(hy_ptr + dd, mask=dm, other=0.0, volatile=True)
        o = acc.to(out_ptr.dtype.element_ty)
        if HAS_RES:     # the block's residual add, rounded as `res + moe(x)` is: one launch fewer
            o = (res + o.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + dd, o, mask=dm)


    @triton.jit
    def _hint_kernel(ids_ptr, table_ptr, seq_ptr, hint_ptr, flag_ptr, poff_ptr, share, K: tl.constexpr,
                     SYS: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr):
        """hint[j] = ids[j] where the CPU would compute it: not on the GPU (table < 0) and not among the PCIe share's
        picks (NP > 0: _pcie_pick as the ring makes it); else -1. Then flag = seq (release)."""
        kk = tl.arange(0, BK)
        km = kk < K
        e = tl.load(ids_ptr + kk, mask=km, other=0)
        s = tl.load(table_ptr + e, mask=km, other=0)
        cpu = km & (s < 0)
        if NP > 0:
            off = tl.load(poff_ptr + e, mask=cpu, other=-1)
            take, rank = _pcie_pick(e, cpu, cpu & (off >= 0), share, NP, BK)
            cpu = cpu & ~take
        tl.store(hint_ptr + kk, tl.where(cpu, e, -1).to(tl.int32), mask=km)
        tl.debug_barrier()
        _store_release(flag_ptr, tl.load(seq_ptr), SYS)

    @triton.jit
    def _gather_kernel(base_ptr, soff_ptr, dst_ptr, N_EL: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr):
        """Stage j: N_EL int32 from base + soff[j] bytes (pinned host memory, read over PCIe) to dst[j];
        soff[j] < 0: nothing. Offsets are multiples of 16 bytes, so the loads are 16 bytes wide (4-byte
        loads from host memory ran at 12.7 GB/s on the H200 box, 16-byte ones at 49: bench_pcie_read.py)."""
        j = tl.program_id(1)
        off = tl.load(soff_ptr + j)
        if off >= 0:
            src = base_ptr + tl.multiple_of(off // 4, 4)
            b = tl.program_id(0) * CHUNK
            for c in range(0, CHUNK, VEC):
                o = b + c + tl.arange(0, VEC)
                m = o < N_EL
                tl.store(dst_ptr + j * N_EL + o, tl.load(src + o, mask=m), mask=m)


GATHER_CHUNK = 16384        # bytes per program of the PCIe gather (bench_pcie_read.py: 16 KiB, 4 warps)


def gather(base: torch.Tensor, stage_off: torch.Tensor, staging: torch.Tensor) -> None:
    """staging[j] (device uint8 [NP, B]) = B bytes at base + stage_off[j] (pinned host memory; byte
    offsets, multiples of 16; -1: row j untouched). One launch, no host sync."""
    n_el = staging.shape[1] // 4
    _gather_kernel[(triton.cdiv(n_el, GATHER_CHUNK // 4), staging.shape[0])](
        base.view(torch.int32), stage_off, staging.view(torch.int32), N_EL=n_el, CHUNK=GATHER_CHUNK // 4,
        VEC=1024, num_warps=4)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def ring(x, ids, w, table_row, seq, slots, req: "Requests", li: int, bump: bool, pcie=None) -> None:
    """x [1, D], ids / w [1, k] (device) -> slots [k] int64 (device) and the request of layer li.
    pcie: None, or (offsets [E] int64: byte offset of each expert in the pinned bank from its base,
    -1 where it is not there; stage_off [NP] int64 out; share; first stage slot): then the
    round(share * misses) misses (at most NP) of lowest expert id get stage slots (stage0 + j, their bank offsets in
    stage_off[j], -1 in unused rows), which the CPU skips as it skips hits."""
    d, k = x.shape[-1], ids.numel()
    poff, soff, share, stage0 = pcie if pcie is not None else (ids, ids, 0.0, 0)
    n_p = soff.numel() if pcie is not None else 0
    _ring_kernel[(1,)](x, ids, w, table_row, seq, slots, req.x[li], req.ids[li], req.w[li], req.slots[li],
                       req.bell[li * BELL_STRIDE:], poff, soff, float(share), int(stage0), req.stamp[li],
                       *req.q8_rows(li), d, k, BUMP=bump, SYS=not _interpret(),
                       BD=min(4096, triton.next_power_of_2(d)), BK=triton.next_power_of_2(k), NP=n_p,
                       BNP=triton.next_power_of_2(max(1, n_p)), STAMP=req.stamping, Q8=req.q8, num_warps=4)


def route_ring(x, weight, k: int, normalize: bool, table_row, seq, slots, req: "Requests", li: int, bump: bool,
               out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router and the ring in one launch (small_ops.router_kernel_ok must hold; no PCIe share): x [1, D],
    weight [E, D] -> (ids [1, k], w [1, k]) as small_ops.router_topk returns them, and ring(x, ids, w, ...) done."""
    from .triton_small import router_launch
    grid, args, const, res = router_launch(x, weight, k, normalize, out=out)
    _route_ring_kernel[grid](*args, table_row, seq, slots, req.x[li], req.ids[li], req.w[li], req.slots[li],
                             req.bell[li * BELL_STRIDE:], req.stamp[li], *req.q8_rows(li), **const, BUMP=bump,
                             SYS=not _interpret(), BXD=min(4096, triton.next_power_of_2(x.shape[-1])),
                             STAMP=req.stamping, Q8=req.q8, num_warps=4)
    return res


def route_ring_add_norm(h, a, norm_w, eps: float, weight, k: int, normalize: bool, table_row, seq, slots,
                        req: "Requests", li: int, bump: bool, out=None) -> tuple[torch.Tensor, ...]:
    """route_ring on x = add_rms_norm(h, a, norm_w, eps)[1], made in the same launch (triton_small.
    router_add_norm_fits must hold): h, a [1, D] -> (s = h + a, x, ids, w) as add_rms_norm then route_ring return
    them, bit for bit, and the ring done with that x."""
    from .triton_small import ROUTER_WARPS, router_add_norm_launch
    grid, args, const, res = router_add_norm_launch(h, a, norm_w, eps, weight, k, normalize, out=out)
    _route_ring_add_norm_kernel[grid](*args, table_row, seq, slots, req.x[li], req.ids[li], req.w[li], req.slots[li],
                                      req.bell[li * BELL_STRIDE:], req.stamp[li], *req.q8_rows(li), **const,
                                      BUMP=bump, SYS=not _interpret(), STAMP=req.stamping, Q8=req.q8,
                                      num_warps=ROUTER_WARPS)
    return res


def hint(ids, table_row, seq, req: "Requests", li: int, pcie=None) -> None:
    """ids [1, k] (device): a guess of layer li's experts -> req.hint[li] (those the CPU would compute: not in the GPU
    table, not the PCIe share's picks, -1 for the rest) and hint_flag[li] = seq, for the miss server's prefetch
    (doorbell.c prefetch_guess). pcie: None, or (layer li's bank offsets [E], share, rows) as the ring has them."""
    k = ids.numel()
    poff, share, n_p = pcie if pcie is not None else (ids, 0.0, 0)
    _hint_kernel[(1,)](ids, table_row, seq, req.hint[li], req.hint_flag[li * BELL_STRIDE:], poff, float(share), K=k,
                       SYS=not _interpret(), BK=triton.next_power_of_2(k), NP=n_p, num_warps=1)


def wait_add(hits, slots, seq, req: "Requests", li: int, out, max_spin: int = 1 << 40,
             timeout_s: float = 5.0, residual=None) -> None:
    """out [1, D] = hits + (y[li] once done[li] == seq, when any slot is -1), rounded to out's dtype; with a
    residual [1, D] (out's dtype): residual + that, rounded again (the decoder block's add)."""
    d, k = hits.shape[-1], slots.numel()
    bd = min(1024, triton.next_power_of_2(d))
    _wait_add_kernel[(triton.cdiv(d, bd),)](hits, slots, seq, req.done[li * BELL_STRIDE:], req.y[li], out,
                                             req.err, residual if residual is not None else out, d, k, max_spin,
                                             int(timeout_s * 1e9), req.stamp[li], SYS=not _interpret(), BD=bd,
                                             BK=triton.next_power_of_2(k), HAS_RES=residual is not None,
                                             TRIGGER=pdl(hits), STAMP=req.stamping, num_warps=4)


def wait_add_norm(hits, slots, seq, req: "Requests", li: int, out, residual, norm_w, eps: float,
                  max_spin: int = 1 << 40, timeout_s: float = 5.0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """wait_add(..., residual) in one program, then the next decoder layer's input norm of out and its int8 copy in
    the same launch: -> (x, (q, dx, xs)) as triton_small.rms_norm_q8(out, norm_w, eps) returns them, bit for bit (the
    same code on out loaded back, its warps). One launch fewer between the CPU's answer and the next bell. out's
    dtype: residual's; D a multiple of 32."""
    from .triton_small import _norm_warps, norm_q8_buffers
    d, k = hits.shape[-1], slots.numel()
    x, pre = norm_q8_buffers(out)
    _wait_add_norm_kernel[(1,)](hits, slots, seq, req.done[li * BELL_STRIDE:], req.y[li], out, req.err, residual, d,
                                k, max_spin, int(timeout_s * 1e9), req.stamp[li], norm_w, x, *pre, eps,
                                SYS=not _interpret(), BD=triton.next_power_of_2(d), BK=triton.next_power_of_2(k),
                                TRIGGER=pdl(hits), STAMP=req.stamping, num_warps=_norm_warps(d))
    return x, pre


class Requests:
    """The host-mapped request/answer buffers of all L layers (pinned when CUDA is present). q8: the ring writes x's
    int8 copy too (qx [L, D] int8, scales dx and sums sx [L, D / 32]: the C prep's, bit for bit), and the server
    reads it instead of quantizing x (dim a multiple of 32)."""

    def __init__(self, n_layers: int, dim: int, k: int, pin: bool, q8: bool = False):
        def buf(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        self.bell = buf(n_layers * BELL_STRIDE, dtype=torch.int64)
        self.done = buf(n_layers * BELL_STRIDE, dtype=torch.int64)
        self.x, self.y = buf(n_layers, dim, dtype=torch.float32), buf(n_layers, dim, dtype=torch.float32)
        self.ids, self.slots = buf(n_layers, k, dtype=torch.int32), buf(n_layers, k, dtype=torch.int32)
        self.w = buf(n_layers, k, dtype=torch.float32)
        self.err = buf(1, dtype=torch.int64)
        # the GPU's guess of layer li's misses (hint), written during layer li - 1; hint_flag[li] = its step
        self.hint = buf(n_layers, k, dtype=torch.int32)
        self.hint_flag = buf(n_layers * BELL_STRIDE, dtype=torch.int64)
        # diagnosis, MOETIER_STAMP=1: the GPU's clock (ns) per layer as wait_add sees the answer [0] and has added it
        # [1], and as the ring rings [2] (GraphTiers.report: the GPU's part of the round trip, the PCIe crossings)
        self.stamping = os.environ.get("MOETIER_STAMP", "0") == "1"
        self.stamp = buf(n_layers, 4, dtype=torch.int64)
        if q8 and dim % 32:
            raise ValueError(f"x's int8 copy is made per 32 values: dim {dim} is not a multiple of 32")
        self.q8 = q8
        self.qx = buf(n_layers, dim, dtype=torch.int8) if q8 else None
        self.dx = buf(n_layers, dim // 32, dtype=torch.float32) if q8 else None
        self.sx = buf(n_layers, dim // 32, dtype=torch.float32) if q8 else None

    def q8_rows(self, li: int) -> tuple[torch.Tensor, ...]:
        """Layer li's rows of qx, dx, sx for the ring kernels (x's row in their place when q8 is off: unused)."""
        return (self.qx[li], self.dx[li], self.sx[li]) if self.q8 else (self.x[li],) * 3


# ------------------------------------------------------------------ the C server
class _Ctx(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("L", "E", "D", "I", "k", "qtype", "act", "nthreads")] + [
        ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
        ("gu_row_bytes", ctypes.c_int64), ("dn_row_bytes", ctypes.c_int64), ("timeout_ns", ctypes.c_int64),
        ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("bell", ctypes.c_void_p), ("done", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("w", ctypes.c_void_p),
        ("y", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("timing", ctypes.c_void_p), ("q8_act", ctypes.c_int32),
        ("dn_qtype", ctypes.c_int32), ("layer_types", ctypes.c_void_p), ("layer_row_bytes", ctypes.c_void_p),
        ("gu_bias", ctypes.c_void_p), ("dn_bias", ctypes.c_void_p),
        ("variant", ctypes.c_int32),       # VARIANT; 0: the phases with barriers; 1: the old per-row loops; 2: down
                                           # over the experts' rows (A/B);
                                           # 3: variant 0's reads without the math (a ceiling: y is not the product);
                                           # 4: variant 0 with guided chunks (halving parts of each home);
                                           # 5: phase 3's rows prefetched in phase 1; 6: no barriers (dataflow);
                                           # 8: variant 6 with every thread starting a layer at its bell (no
                                           # barrier there; the ring's int8 x only; A/B)
        ("hint", ctypes.c_void_p), ("hint_flag", ctypes.c_void_p),   # the GPU's guess of the next layer's misses
        ("log_ids", ctypes.c_void_p), ("log_slots", ctypes.c_void_p), ("log_w", ctypes.c_void_p),   # rows as served
        ("ring_qx", ctypes.c_void_p), ("ring_dx", ctypes.c_void_p), ("ring_sx", ctypes.c_void_p),  # Requests.q8
        ("trace", ctypes.c_void_p)]        # MOETIER_MISS_TRACE=1: the step's timeline (MissServer.trace)


# The miss server's default variant (serve_ctx.variant): 6, the phases without barriers (doorbell.c layer_flow; each
# expert's h ready as its rows end). H200 box, 8 GiB, one process each (session 17): 101.8-113.2 tok/s in four runs
# against 78.1 and 94.2 for variant 0 (the barrier version) in the same two calls; y bit-identical.
VARIANT = 6


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        from .cpu import build_library
        lib = ctypes.CDLL(str(build_library(source=Path(__file__).with_name("doorbell.c"))))
        lib.moetier_serve_step.argtypes = [ctypes.POINTER(_Ctx), ctypes.c_int64]
        lib.moetier_serve_supported.argtypes = [ctypes.c_int]
        lib.moetier_serve_scratch_floats.argtypes = [ctypes.c_int64] * 3
        lib.moetier_serve_scratch_floats.restype = ctypes.c_int64
        lib.moetier_serve_q8.argtypes = [ctypes.c_int]
        lib.moetier_quantize_q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_void_p]
        _lib = lib
    return _lib


def serve_supported(qtype_id: int) -> bool:
    return bool(library().moetier_serve_supported(qtype_id))


def ring_q8_useful(qtype_id, q8_act: bool = True) -> bool:
    """Whether the server reads x's int8 copy (Requests.q8) in some layer: q8_act and gate_up rows with an int8
    kernel. qtype_id as MissServer takes it."""
    pairs = qtype_id if isinstance(qtype_id, list) else [qtype_id if isinstance(qtype_id, tuple) else (qtype_id,)]
    return q8_act and any(library().moetier_serve_q8(p[0]) for p in pairs)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x float32 [K] (CPU, K a multiple of 32) -> (qx int8 [K], dx, sx float32 [K / 32]) as the server's prep makes
    them (doorbell.c moetier_quantize_q8: the ring's twin); None in a build without int8 activations."""
    x = x.contiguous()
    qx = torch.empty(x.numel(), dtype=torch.int8)
    dx, sx = torch.empty(x.numel() // 32), torch.empty(x.numel() // 32)
    if library().moetier_quantize_q8(x.data_ptr(), x.numel(), qx.data_ptr(), dx.data_ptr(), sx.data_ptr()):
        return None
    return qx, dx, sx


class MissServer:
    """Answers the doorbells of one decode step from expert weights in RAM.

    gate_up / down: [L][E] CPU tensors (rows contiguous) or None where an expert is not in RAM;
    qtype_id: GGML type id of the weights (0 f32, 1 f16, 30 bf16, 8 Q8_0, 2 Q4_0, 12 Q4_K, 13 Q5_K,
    14 Q6_K, 39 MXFP4, 18 IQ3_XXS), or (gate_up id, down id) when they differ (Q4_K_M: (12, 14)), or
    a list of L such pairs when they vary by layer (Q4_K_M's down: Q6_K in some layers); act: ops.Act.
    q8_act: Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 / IQ3_XXS weights meet int8 activations (one scale
    per 32 values, as llama.cpp does) in integer dot products; otherwise float32 activations.
    hints: after answering layer li, each thread prefetches the rows it would compute in layer li + 1 for the
    guess the GPU wrote (`hint`), while the GPU runs up to that layer's bell."""

    def __init__(self, req: Requests, gate_up, down, qtype_id: int, dim: int, hidden: int, act,
                 threads: int, timeout_s: float = 10.0, q8_act: bool = True, biases=None, hints: bool = False):
        n_layers, n_exp = len(gate_up), len(gate_up[0])
        k = req.ids.shape[1]
        self.req, self.lib = req, library()
        per_layer = isinstance(qtype_id, list)
        pairs = qtype_id if per_layer else [qtype_id if isinstance(qtype_id, tuple) else (qtype_id, qtype_id)]
        for tid in {t for pair in pairs for t in pair}:
            if not self.lib.moetier_serve_supported(tid):
                raise ValueError(f"no CPU kernel for GGML type {tid}")
        gu_id, dn_id = pairs[0]
        self._types = self._row_bytes = None
        if per_layer:           # [L, 2] types and row bytes of each layer (from its first expert in RAM)
            def row_bytes(row):
                t = next((t for t in row if t is not None), None)
                return 0 if t is None else t.stride(0) * t.element_size()
            self._types = torch.tensor(pairs, dtype=torch.int32)
            self._row_bytes = torch.tensor([[row_bytes(g), row_bytes(d)] for g, d in zip(gate_up, down)],
                                           dtype=torch.int64)
        self._gu = (ctypes.c_void_p * (n_layers * n_exp))(
            *[0 if t is None else t.data_ptr() for row in gate_up for t in row])
        self._dn = (ctypes.c_void_p * (n_layers * n_exp))(
            *[0 if t is None else t.data_ptr() for row in down for t in row])
        # biases (gpt-oss): None, or ([L][E] gate_up bias [2I], [L][E] down bias [D]) float32 CPU tensors
        # (None where the expert is not in RAM); either list may be None
        self._bias = [None, None]
        for i, table in enumerate(biases or (None, None)):
            if table is not None:
                for t in (t for row in table for t in row if t is not None):
                    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != (2 * hidden, dim)[i]:
                        raise ValueError(f"expert biases must be contiguous float32 [{(2 * hidden, dim)[i]}]")
                self._bias[i] = (ctypes.c_void_p * (n_layers * n_exp))(
                    *[0 if t is None else t.data_ptr() for row in table for t in row])
        some = next(t for t in (t for row in gate_up for t in row) if t is not None)
        some_dn = next(t for t in (t for row in down for t in row) if t is not None)
        # two of: float h [k, 3I]; per-32 sums / scales / int sums of x and h; int8 x and h; the missed experts'
        # down rows [k, D] (doorbell.c scratch_of: one per layer parity)
        self.scratch = torch.zeros(self.lib.moetier_serve_scratch_floats(k, dim, hidden), dtype=torch.float32)
        self.timing = torch.zeros(16 + 3 * TIMED_THREADS, dtype=torch.float64)   # doorbell.c moetier_serve_step
        # each layer's request row as the server read it (the bookkeeping's copy, independent of when the next
        # replay rewrites req's rows)
        self.log_ids, self.log_slots = torch.zeros_like(req.ids), torch.zeros_like(req.slots)
        self.log_w = torch.zeros_like(req.w)
        self.detail = (0.0, 0, 0.0)
        self.guesses = (0, 0, 0)
        self.prefetched, self.first_bell, self.phases = 0.0, 0.0, (0.0,) * 5     # serve's, below
        self.per_thread = torch.zeros(3, TIMED_THREADS, dtype=torch.float64)
        # MOETIER_MISS_TRACE=1 (diagnosis): the last step's timeline, s from its start, a row a layer: tid 0 saw the
        # bell, the layer began, its last thread finished; then per thread its start, the end of its gate_up claims,
        # its finish (doorbell.c serve_ctx.trace; late_thread_split reads it)
        self.trace = (torch.zeros(n_layers, self.lib.moetier_serve_trace_cols(), dtype=torch.float64)
                      if os.environ.get("MOETIER_MISS_TRACE") == "1" else None)
        self.ctx = _Ctx(n_layers, n_exp, dim, hidden, k, gu_id, 0 if act.kind == "swiglu" else 1, threads,
                        act.alpha, act.limit, some.stride(0) * some.element_size(),
                        some_dn.stride(0) * some_dn.element_size(), int(timeout_s * 1e9),
                        ctypes.cast(self._gu, ctypes.c_void_p), ctypes.cast(self._dn, ctypes.c_void_p),
                        req.bell.data_ptr(), req.done.data_ptr(), req.x.data_ptr(), req.ids.data_ptr(),
                        req.slots.data_ptr(), req.w.data_ptr(), req.y.data_ptr(), self.scratch.data_ptr(),
                        self.timing.data_ptr(), int(q8_act), dn_id,
                        None if self._types is None else self._types.data_ptr(),
                        None if self._row_bytes is None else self._row_bytes.data_ptr(),
                        *(None if b is None else ctypes.cast(b, ctypes.c_void_p) for b in self._bias), VARIANT,
                        req.hint.data_ptr() if hints else None, req.hint_flag.data_ptr() if hints else None,
                        self.log_ids.data_ptr(), self.log_slots.data_ptr(), self.log_w.data_ptr(),
                        *((t.data_ptr() for t in (req.qx, req.dx, req.sx)) if req.q8 else (None,) * 3),
                        None if self.trace is None else self.trace.data_ptr())

    def serve(self, seq: int, timeout_s: float | None = None) -> tuple[float, float, int]:
        """Answer step `seq`; -> (compute s, s waiting for bells, misses computed). timeout_s: this step's wait
        for all its bells instead of the server's (an eager warm-up step compiles kernels between bells)."""
        ns = self.ctx.timeout_ns
        if timeout_s is not None:
            self.ctx.timeout_ns = int(timeout_s * 1e9)
        try:
            rc = self.lib.moetier_serve_step(ctypes.byref(self.ctx), seq)
        finally:
            timeout, self.ctx.timeout_ns = self.ctx.timeout_ns / 1e9, ns
        if rc:
            raise RuntimeError(_why(rc, timeout))
        t = self.timing.tolist()
        # (s from a layer's last answer to the next layer's bell, such layer pairs, s of tid 0's bell work)
        self.detail = (t[3], int(t[4]), t[5])
        # (experts guessed, right guesses, misses) over the layers that had a fresh guess
        self.guesses = (int(t[6]), int(t[7]), int(t[8]))
        self.prefetched = t[9]          # bytes of guessed rows whose prefetches were issued before their bells
        self.first_bell = t[10]         # s from the call to layer 0's bell (the step's start on the GPU)
        # s summed over threads and layers: phase 1's work, its barrier wait, phase 2 with its barrier, phase 3's
        # work, a thread's finish to the layer's last (layer_runs)
        self.phases = tuple(t[11:16])
        # per thread (the first TIMED_THREADS): work s (its start of a layer to its finish), layers it finished last,
        # the CPU it ended the step on (-1: none seen)
        self.per_thread = self.timing[16:].view(3, TIMED_THREADS).clone()
        return t[0], t[1], int(t[2])


def late_thread_split(trace, threads: int) -> tuple[int, dict]:
    """A step's trace (MissServer.trace) -> (layers with misses, sums over them in s). Per layer, of the thread that
    finished last against the median of the threads: how much later it started (`start`), how much longer its
    gate_up claims took (`gate_up`: its start to their end) and the rest of its layer (`down`), and `tail`, the sum
    of the three (about its finish after the median thread's): whether the layer's straggler woke late, streamed its
    gate_up rows slowly, or waited / worked longer in down. Whole-array numpy: a loop over the layers cost ~2.7 ms a
    step on the H200 box (48 layers), which then sat between the serve and the next step (docs/perf-log.md, session
    30)."""
    import numpy as np
    t = np.asarray(trace, dtype=np.float64)
    nt = min(threads, TIMED_THREADS)
    per = t[:, 3:3 + 3 * nt].reshape(t.shape[0], nt, 3)
    ran = per[:, :, 2] > 0
    use = (ran.sum(1) >= 2) & ~(ran & (per[:, :, 1] <= 0)).any(1)
    sums = {"tail": 0.0, "start": 0.0, "gate_up": 0.0, "down": 0.0}
    if not use.any():
        return 0, sums
    per, ran = per[use], ran[use]
    last = np.argmax(np.where(ran, per[:, :, 2], -np.inf), axis=1)
    rows = np.arange(len(per))
    total = 0.0
    for key, v in (("start", per[:, :, 0]), ("gate_up", per[:, :, 1] - per[:, :, 0]),
                   ("down", per[:, :, 2] - per[:, :, 1])):
        part = float((v[rows, last] - np.nanmedian(np.where(ran, v, np.nan), axis=1)).sum())
        sums[key] = part
        total += part
    sums["tail"] = total
    return int(use.sum()), sums


def _why(rc: int, timeout: float) -> str:
    if -100 < rc < 0:
        return f"MoE layer {-rc - 1} never rang its doorbell within {timeout:.0f} s (the GPU step stalled)"
    if rc <= -100 and rc > -200:
        return f"MoE layer {-rc - 100} missed an expert that is not in the RAM bank"
    return f"bad doorbell arguments (code {rc})"
