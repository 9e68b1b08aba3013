"""Compile Triton kernels for an sm_90 target on a machine without a GPU (the frontend and the TTIR/TTGIR
passes; ptxas where Triton bundles it or a CUDA toolkit is installed: a PTX error, e.g. of inline asm, fails),
so CUDA-only compile errors (the interpreter accepts more: a `return` inside a branch, globals that are not
constexpr) show up before a device call.

    python bench/compile_check.py    # v5 decode kernels (with gate_up's fused h quantizer) and the dense GEMV (every
                                     # v5 format), the embedding gather, the decode step's small kernels with PDL
                                     # (the router with and without the add + norm), the doorbell's ring, route+ring
                                     # (with and without the add + norm; with x's int8 copy), hint and wait_add
                                     # (with the next layer's norm) kernels; the PDL ones again for sm_80 with PDL
                                     # off (Ampere / Ada have no griddepcontrol)
    python bench/compile_check.py --sampler   # kernels.triton_sample (MOETIER_SAMPLER=triton)
"""
from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier.kernels import triton_decode_q8 as q8  # noqa: E402
from moetier.kernels import triton_qlinear  # noqa: E402
from moetier.kernels.triton_decode import STEP_BLOCK, v3_pieces  # noqa: E402
from moetier.kernels.triton_weights import FMT_CODES  # noqa: E402

XQ_FORMATS = ("Q4_0", "Q4_K")       # v5qx's gate_up builds
INT_PTRS = {"xw_ptr", "hw_ptr", "q_ptr", "h_ptr", "ids_ptr"}
FLOAT_PTRS = {"xd_ptr", "xs_ptr", "hd_ptr", "hs_ptr", "out_ptr", "b_ptr", "w_ptr"}


def source(fn, const: dict, types: dict | None = None) -> ASTSource:
    """fn with these constexprs, its other arguments typed by name (pointers, the activation's fp32 scalars, i64
    else) unless `types` gives them."""
    names = fn.arg_names
    sig = {}
    for n in names:
        if types and n in types:
            sig[n] = types[n]
        elif n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in INT_PTRS else "*fp32" if n in FLOAT_PTRS else "*u8"
        elif n in ("alpha", "limit"):
            sig[n] = "fp32"
        else:
            sig[n] = "i64"
    return ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})


def compile_for_sm90(fn, const: dict, types: dict | None = None, arch: int = 90) -> str | None:
    """None when it compiles to the end the local toolchain reaches, else the innermost error. types: argument
    types that the naming rule in `source` would get wrong. arch: another compute capability (80: Ampere)."""
    src = source(fn, const, types)
    try:
        triton.compile(src, target=GPUTarget("cuda", arch, 32))
    except Exception as e:  # noqa: BLE001 (report the innermost cause)
        chain = [e]
        while (chain[-1].__cause__ or chain[-1].__context__) is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if any(type(c).__name__ == "PTXASError" for c in chain):   # ptxas ran and refused the PTX (inline asm)
            return "ptxas: " + " | ".join(line for line in str(e).splitlines() if "error" in line)[:600]
        e = chain[-1]
        msg = f"{type(e).__name__}: {e}"
        if "ptxas" in msg or "PTX" in msg or "cuda" in msg.lower() and "not found" in msg.lower():
            return None        # past the frontend: no CUDA toolchain here
        return msg[-600:]
    return None


def main() -> int:
    bad = 0
    ampere = []     # (name, kernel, constexprs, types) compiled again for sm_80 without PDL
    for fmt in q8.FORMATS:
        d, i = 2048, 768
        common = dict(FMT=FMT_CODES[fmt], HAS_BIAS=False, BS=STEP_BLOCK[fmt], PDL=True, EMU=False)
        nb1, nb2 = q8.gate_up_pieces(d, fmt)
        gu = dict(common, I=i, D=d, KTOP=8, ACT=0, NB1=nb1, NB2=nb2, ROUND=1, NBP=d // 32, TRACE=False)
        dn = dict(common, D=d, I=i, KTOP=8, KP=8, BN=4, TRIGGER=True, NB1=v3_pieces(i, fmt)[0],
                  NB2=v3_pieces(i, fmt)[1], TRACE=False)
        cases = {
            "gate_up": (q8._gate_up_kernel, dict(gu, BN=4, QH=0, XQ=False)),
            "gate_up+qh": (q8._gate_up_kernel, dict(gu, BN=4, QH=1, XQ=False)),
            "gate_up+qh2": (q8._gate_up_kernel, dict(gu, BN=32, QH=2, XQ=False)),
            # v5qx (x's copy made by gate_up: the same code in every format; CI time: two formats)
            **({"gate_up+qh2+xq": (q8._gate_up_kernel, dict(gu, BN=32, QH=2, XQ=True)),
                "gate_up+qh+xq": (q8._gate_up_kernel, dict(gu, BN=16, QH=1, XQ=True))} if fmt in XQ_FORMATS else {}),
            "down": (q8._down_kernel, dn),
            "gemv": (triton_qlinear._gemv_kernel, dict(common, K=d, BN=4, NB1=v3_pieces(d, fmt)[0],
                                                       NB2=v3_pieces(d, fmt)[1])),
        }
        for kind, (fn, const) in cases.items():
            types = {"hq_ptr": "*i8", "cnt_ptr": "*i32", "x_ptr": "*bf16", "xq8_ptr": "*i8",
                     **({"m_ptr": "*i32"} if fmt in ("IQ3_XXS", "IQ2_XXS") else {}),
                     **({"d_ptr": "*i32", "sc_ptr": "*i32"} if fmt in ("Q4_K", "Q5_K", "Q2_K") else {}),  # words
                     **({"d_ptr": "*fp16", "sc_ptr": "*i8"} if fmt == "Q3_K" else {})}
            err = compile_for_sm90(fn, const, types)
            bad += err is not None
            print(f"{fmt:5} {kind:8} {'ok' if err is None else err}")
            # without PDL for Ampere / Ada (pdl.supported keeps it off there)
            off = dict(const, PDL=False, **({"TRIGGER": False} if "TRIGGER" in const else {}))
            ampere.append((f"{fmt} {kind}", fn, off, types))
    from moetier.kernels import triton_embed
    err = compile_for_sm90(triton_embed._gather_rows_kernel, dict(D=2048, BLOCK=triton_embed.BLOCK),
                           {"w_ptr": "*bf16", "tok_ptr": "*i64", "out_ptr": "*bf16", "V": "i32"})
    bad += err is not None
    print(f"bf16  embed    {'ok' if err is None else err}")
    from moetier.kernels import triton_attention, triton_small
    bf = {n: "*bf16" for n in ("x_ptr", "w_ptr", "out_ptr", "h_ptr", "y_ptr", "s_ptr", "qkv_ptr", "qw_ptr", "kw_ptr",
                               "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr", "wt_ptr")}
    f32 = {n: "*fp32" for n in ("pm_ptr", "pl_ptr", "pacc_ptr", "dx_ptr", "xs_ptr", "logit_ptr")}
    for name, fn, const, types in (     # the decode step's small kernels, launched as programmatic dependents
            ("combine+q8", triton_attention._attn_combine_kernel,
             dict(REP=8, DH=128, NSPLIT=16, BR=16, BD=128, Q8=True, PDL=True), {**bf, **f32, "q_ptr": "*i8"}),
            ("attn_split", triton_attention._attn_split_kernel,
             dict(HKV=4, REP=8, DH=128, NSPLIT=16, BR=16, BS=32, BD=128, PREC="tf32", PDL=True),
             {**bf, **f32, "pos_ptr": "*i64", "scale": "fp32"}),
            ("qkv_prep", triton_attention._qkv_prep_kernel,
             dict(H=32, HKV=4, DH=128, R=128, QK_NORM=True, BD=128, PDL=True),
             {**bf, "pos_ptr": "*i64", "eps": "fp32"}),
            ("norm+q8", triton_small._rms_norm_q8_kernel, dict(BN=2048, PDL=True),
             {**bf, **f32, "q_ptr": "*i8", "N": "i32", "eps": "fp32"}),
            ("add_norm", triton_small._add_rms_norm_kernel, dict(BN=2048, PDL=True), {**bf, "N": "i32", "eps": "fp32"}),
            ("add+norm+q8", triton_small._add_norm_q8_kernel, dict(BN=2048, PDL=True),
             {**bf, **f32, "q_ptr": "*i8", "N": "i32", "eps": "fp32"}),
            ("router", triton_small._router_topk_kernel,
             dict(E=128, D=2048, K=8, NORM=True, ROWS=2, BD=2048, BE=128, BK=8, PDL=True),
             {**bf, **f32, "cnt_ptr": "*i32", "ids_ptr": "*i64"}),
            ("router+norm", triton_small._router_add_norm_kernel,
             dict(E=128, D=2048, K=8, NORM=True, ROWS=2, BD=2048, BE=128, BK=8, PDL=True),
             {**bf, **f32, "cnt_ptr": "*i32", "ids_ptr": "*i64", "a_ptr": "*bf16", "nw_ptr": "*bf16", "N": "i32",
              "eps": "fp32"})):
        err = compile_for_sm90(fn, const, types)
        bad += err is not None
        print(f"bf16  {name:10} {'ok' if err is None else err}")
        ampere.append((name, fn, dict(const, PDL=False), types))
    from moetier.kernels import doorbell
    ring_q8 = {"qx_ptr": "*i8", "dx_ptr": "*fp32", "sx_ptr": "*fp32"}     # x's int8 copy for the miss server
    for name, fn, const, types in (
            ("ring+pcie", doorbell._ring_kernel,
             dict(D=2048, K=8, BUMP=True, SYS=True, BD=2048, BK=8, NP=2, BNP=2, STAMP=True, Q8=True),
             {**ring_q8, "x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "table_ptr": "*i32",
              "seq_ptr": "*i64", "slots_ptr": "*i64", "hx_ptr": "*fp32", "hids_ptr": "*i32", "hw_ptr": "*fp32",
              "hslots_ptr": "*i32", "bell_ptr": "*i64", "poff_ptr": "*i64", "soff_ptr": "*i64", "share": "fp32",
              "stage0": "i32", "stamp_ptr": "*i64"}),
            ("hint+pcie", doorbell._hint_kernel, dict(K=8, SYS=True, BK=8, NP=2),
             {"ids_ptr": "*i64", "table_ptr": "*i32", "seq_ptr": "*i64", "hint_ptr": "*i32", "flag_ptr": "*i64",
              "poff_ptr": "*i64", "share": "fp32"}),
            ("route+ring", doorbell._route_ring_kernel,
             dict(E=128, D=2048, K=8, NORM=True, ROWS=2, BD=2048, BE=128, BK=8, PDL=True, BUMP=False, SYS=True,
                  BXD=2048, STAMP=False, Q8=True),
             {**ring_q8, "x_ptr": "*bf16", "wt_ptr": "*bf16", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
              "ids_ptr": "*i64", "w_ptr": "*bf16", "table_ptr": "*i32", "seq_ptr": "*i64", "slots_ptr": "*i64",
              "hx_ptr": "*fp32", "hids_ptr": "*i32", "hw_ptr": "*fp32", "hslots_ptr": "*i32", "bell_ptr": "*i64",
              "stamp_ptr": "*i64"}),
            ("route+ring+norm", doorbell._route_ring_add_norm_kernel,
             dict(E=128, D=2048, K=8, NORM=True, ROWS=2, BD=2048, BE=128, BK=8, PDL=True, BUMP=False, SYS=True,
                  STAMP=False, Q8=True),
             {**ring_q8, "x_ptr": "*bf16", "wt_ptr": "*bf16", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
              "ids_ptr": "*i64", "w_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16", "nw_ptr": "*bf16",
              "s_ptr": "*bf16", "N": "i32", "eps": "fp32", "table_ptr": "*i32", "seq_ptr": "*i64",
              "slots_ptr": "*i64", "hx_ptr": "*fp32", "hids_ptr": "*i32", "hw_ptr": "*fp32", "hslots_ptr": "*i32",
              "bell_ptr": "*i64", "stamp_ptr": "*i64"}),
            ("wait_add+res", doorbell._wait_add_kernel,
             dict(SYS=True, BD=1024, BK=8, HAS_RES=True, TRIGGER=True, STAMP=True),
             {"hits_ptr": "*bf16", "slots_ptr": "*i64", "seq_ptr": "*i64", "done_ptr": "*i64", "hy_ptr": "*fp32",
              "out_ptr": "*bf16", "err_ptr": "*i64", "res_ptr": "*bf16", "D": "i32", "K": "i32",
              "stamp_ptr": "*i64"}),
            ("wait_add+norm", doorbell._wait_add_norm_kernel,
             dict(SYS=True, BD=2048, BK=8, TRIGGER=True, STAMP=True),
             {"hits_ptr": "*bf16", "slots_ptr": "*i64", "seq_ptr": "*i64", "done_ptr": "*i64", "hy_ptr": "*fp32",
              "out_ptr": "*bf16", "err_ptr": "*i64", "res_ptr": "*bf16", "D": "i32", "K": "i32",
              "stamp_ptr": "*i64", "nw_ptr": "*bf16", "x_ptr": "*bf16", "q_ptr": "*i8", "dx_ptr": "*fp32",
              "xs_ptr": "*fp32", "eps": "fp32"})):
        err = compile_for_sm90(fn, const, types)
        bad += err is not None
        print(f"      {name:9} {'ok' if err is None else err}")
        ampere.append((name, fn, dict(const, **({"PDL": False} if "PDL" in const else
                                                {"TRIGGER": False} if "TRIGGER" in const else {})), types))
    for name, fn, const, types in ampere:     # griddepcontrol is sm_90+: with PDL off every kernel builds for sm_80
        err = compile_for_sm90(fn, const, types, arch=80)
        bad += err is not None
        print(f"sm80  {name:12} {'ok' if err is None else err}")
    return 1 if bad else 0


def sampler() -> int:
    """kernels.triton_sample's two kernels (MOETIER_SAMPLER=triton) at the shapes a 151,936-token vocabulary gives
    them (the largest sort: 8,192 int64 keys in one program), each filter combination; `--sampler`."""
    from moetier.kernels import triton_sample as ts
    prep = {"x_ptr": "*fp32", "seen_ptr": "*i1", "cnt_ptr": "*fp32", "out_ptr": "*fp32", "pmax_ptr": "*fp32",
            "psum_ptr": "*fp64", "V": "i32", "t": "fp32", "rep": "fp32", "freq": "fp32", "pres": "fp32"}
    draw = {"val_ptr": "*fp32", "col_ptr": "*i64", "pmax_ptr": "*fp32", "psum_ptr": "*fp64", "seed_ptr": "*i64",
            "out_ptr": "*i64", "R": "i32", "M": "i32", "V": "i32", "top_k": "i32", "top_p": "fp32",
            "log_min_p": "fp32", "KC": "i32"}
    runs = [(f"sample prep {cols}", ts._prep, {"HAS_REP": True, "HAS_FP": True, "COLS": cols}, prep)
            for cols in (ts.COLS_TOPK, ts.COLS_TOPP)]
    for topk, topp, minp, block, rb in ((True, True, False, 2048, 128), (False, True, False, 8192, 32),
                                        (True, False, True, 4096, 128)):
        runs.append((f"sample draw k{topk:d} p{topp:d} m{minp:d}", ts._draw,
                     {"COLS": ts.COLS_TOPK if topk else ts.COLS_TOPP, "HAS_TOPK": topk, "HAS_TOPP": topp,
                      "HAS_MINP": minp, "BLOCK": block, "RB": rb, "num_warps": 8}, draw))
    bad = 0
    for name, fn, const, types in runs:
        err = compile_for_sm90(fn, {k: v for k, v in const.items() if k != "num_warps"}, types)
        print(name, "ok" if err is None else err)
        bad += err is not None
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--sampler"]:
        sys.exit(sampler())
    sys.exit(main())
