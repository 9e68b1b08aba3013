"""Registers, spills and occupancy of the v5 decode kernels at their shipped tiles, without a GPU: Triton compiles
them for sm_90 here and ptxas (bundled with Triton) reports what each thread uses. From that: how many programs fit
on one SM at a time, how many waves the T=1 grid takes on an H200 (132 SMs), and what is left on an SM for the next
launch's programs (down's programs load their weights while gate_up runs only where they fit beside it).

    python bench/kernel_regs.py [--fmt Q4_0,Q4_K] [--model qwen3-30b-a3b] [--sass] [--tiles 32.0.8] > regs.json

JSON: one entry per (format, kernel, tile): registers, local stack bytes (spills), shared bytes, programs per SM
and what limits them, grid, waves.

Its integer arguments are typed i64 without divisibility; a launch types them i32 and marks multiples of 16 (branch
q4-addr): Q4_0's v5qx gate_up here counts 1,408 SASS instructions with 64 scalar weight loads, the JIT's build 1,360
with 16 LDG.128. For instruction counts as the launch compiles them use bench/sass_phases.py.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from compile_check import source  # noqa: E402  (the compile test's argument typing)

from moetier.kernels import triton_decode_q8 as q8  # noqa: E402
from moetier.kernels import triton_moe  # noqa: E402
from moetier.kernels.triton_decode import STEP_BLOCK, v3_pieces  # noqa: E402
from moetier.kernels.triton_weights import FMT_CODES, Weights  # noqa: E402

MODELS = {"qwen3-30b-a3b": (2048, 768, 8), "gpt-oss-120b": (2880, 2880, 4)}     # D, I, k
# sm_90 (H100 / H200): per SM
SM = {"sms": 132, "regs": 65536, "warps": 64, "programs": 32, "shared": 227 << 10}
TRITON_TYPES = {torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8", torch.int8: "*i8",
                torch.int32: "*i32"}
PLANE_ARGS = ("q_ptr", "d_ptr", "m_ptr", "sc_ptr", "mn_ptr", "h_ptr")     # triton_decode_q8._planes' order


def plane_types(fmt: str) -> dict:
    """The weight planes' pointer types as a launch passes them (a small arena of `fmt` made here), and the h
    quantizer's outputs."""
    from moetier.quant.pack import quantize
    from moetier.quant.repack import repack
    w = Weights(repack(fmt, quantize(torch.randn(1, 32, 256) / 16, fmt)), fmt)
    return {"hq_ptr": "*i8", "cnt_ptr": "*i32",
            **{n: TRITON_TYPES[t.dtype] for n, t in zip(PLANE_ARGS, q8._planes(w)[:6])}}


def ptxas() -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    found = str(bundled) if bundled.exists() else shutil.which("ptxas")
    if not found:
        sys.exit("kernel_regs: no ptxas (neither Triton's bundled one nor one on PATH)")
    return found


def compiled(fn, const: dict, types: dict, warps: int, maxnreg: int | None = None) -> tuple[str, int]:
    """(PTX, shared bytes) of fn compiled for sm_90 with these constexprs, argument types and num_warps (maxnreg: a
    register cap, as the launch option). Every pointer is taken as 16-byte aligned, as the JIT specializes a launch
    on torch's allocations: without that, v5qx's Q4_0 gate_up compiled to 255 registers here against 128 with it
    (session 35; the x words' alignment decides it)."""
    src = source(fn, const, types)
    aligned = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    k = triton.compile(ASTSource(fn, src.signature, constexprs=src.constants, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    return k.asm["ptx"], int(k.metadata.shared)


def ptxas_usage(ptx: str, tool: str, sass: bool = False) -> tuple[int, int, dict]:
    """(registers a thread, local stack bytes) as ptxas -v reports them, and with `sass` the static SASS instruction
    count by opcode (cuobjdump, bundled with Triton beside ptxas): what a change to the math costs a thread (session 36:
    -6% of Q4_0's gate_up instructions timed the same, -20% with the cross-warp reduction gone 0.6 us less)."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.ptx"
        f.write_text(ptx)
        r = subprocess.run([tool, "-arch=sm_90a", "-v", str(f), "-o", str(Path(d) / "k.o")], capture_output=True,
                           text=True)
        if r.returncode:
            raise RuntimeError(f"ptxas failed: {r.stderr[-400:]}")
        ops: dict = {}
        if sass:
            dump = subprocess.run([str(Path(tool).parent / "cuobjdump"), "-sass", str(Path(d) / "k.o")],
                                  capture_output=True, text=True, check=True).stdout
            for op in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", dump):
                ops[op] = ops.get(op, 0) + 1
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    stack = re.findall(r"(\d+) bytes cumulative stack size", r.stderr)
    return int(regs[-1]), int(stack[-1]) if stack else 0, ops


def occupancy(regs: int, warps: int, shared: int) -> tuple[int, str]:
    """Programs of this kernel one SM holds at once, and the resource that limits them (sm_90: registers are given
    per warp in units of 256, i.e. a thread's count rounded up to 8)."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    limits = {"registers": SM["regs"] // (per_warp * warps), "warps": SM["warps"] // warps,
              "programs": SM["programs"], "shared": SM["shared"] // max(1, shared + 1024)}
    name = min(limits, key=limits.get)
    return limits[name], name


def entry(fmt, kernel, tile, grid, fn, const, tool, maxnreg=None, sass=False) -> dict:
    types = dict(plane_types(fmt), x_ptr="*bf16", xq8_ptr="*i8")
    ptx, shared = compiled(fn, const, types, tile.warps, maxnreg)
    regs, stack, ops = ptxas_usage(ptx, tool, sass)
    per_sm, limit = occupancy(regs, tile.warps, shared)
    return {"fmt": fmt, "kernel": kernel, "tile": list(tile), "grid": grid, "registers": regs, "stack_bytes": stack,
            "shared_bytes": shared, "programs_per_sm": per_sm, "limited_by": limit,
            "waves": round(grid / (per_sm * SM["sms"]), 2),
            "sm_registers_used": round(min(per_sm, math.ceil(grid / SM["sms"])) * tile.warps
                                       * math.ceil(regs * 32 / 256) * 256 / SM["regs"], 2),
            **({"sass_instructions": sum(ops.values()),
                "sass_top": dict(sorted(ops.items(), key=lambda o: -o[1])[:12])} if sass else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default=",".join(q8.FORMATS))
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--maxnreg", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="gate_up again at these register caps (e.g. 128: two 8-warp programs an SM)")
    ap.add_argument("--sass", action="store_true", help="count each kernel's SASS instructions (static, by opcode)")
    ap.add_argument("--tiles", type=lambda v: [tuple(int(x) for x in t.split(".")) for t in v.split(",")], default=[],
                    help="gate_up (v5q and v5qx) at these tiles too, each rows.0.warps (e.g. 32.0.8,16.0.4)")
    a = ap.parse_args()
    d, i, k = MODELS[a.model]
    tool, out = ptxas(), []
    for fmt in a.fmt.split(","):
        if fmt not in q8.FORMATS:
            sys.exit(f"kernel_regs: {fmt!r} has no v5 kernels (they serve {', '.join(q8.FORMATS)})")
        common = dict(FMT=FMT_CODES[fmt], HAS_BIAS=False, BS=STEP_BLOCK[fmt], PDL=True, EMU=False)
        default = triton_moe.DEFAULT_VARIANT.get(fmt, "v5pdl")
        tiles = [("v5pdl", q8.GATE_UP5[fmt])]
        if fmt in q8.GATE_UP5Q or default in ("v5q", "v5qx"):   # (without a tile of their own: v5pdl's, as gate_up_v5)
            tiles += [(v, q8.GATE_UP5Q.get(fmt, q8.GATE_UP5[fmt])) for v in ("v5q", "v5qx")]
        tiles += [(v, q8.Tile(*t)) for t in a.tiles for v in ("v5q", "v5qx")]
        for variant, t in tiles:
            qh = q8.h_quantizer(t.bn) if variant in ("v5q", "v5qx") else 0
            nb1, nb2 = q8.gate_up_pieces(d, fmt)
            gu = dict(common, I=i, D=d, KTOP=k, ACT=0, NB1=nb1, NB2=nb2, ROUND=1, BN=t.bn, QH=qh,
                      XQ=variant == "v5qx", NBP=triton.next_power_of_2(d // 32), TRACE=False)
            for cap in (None, *a.maxnreg):
                e = entry(fmt, f"gate_up ({variant}{', default' if variant == default else ''})", t,
                          k * math.ceil(i / t.bn), q8._gate_up_kernel, gu, tool, cap, a.sass)
                e["maxnreg"] = cap
                out.append(e)
                print(e, file=sys.stderr)
        t = q8.DOWN5[fmt]
        dn = dict(common, D=d, I=i, KTOP=k, KP=triton.next_power_of_2(k), BN=t.bn, TRIGGER=True,
                  NB1=v3_pieces(i, fmt)[0], NB2=v3_pieces(i, fmt)[1], TRACE=False)
        e = entry(fmt, "down", t, math.ceil(d / t.bn), q8._down_kernel, dn, tool, sass=a.sass)
        out.append(e)
        print(e, file=sys.stderr)
    json.dump({"model": a.model, "sm": SM, "kernels": out}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
