"""Static SASS of the T=1 v5 pair as the JIT builds it, split into phases, without a GPU: the real launch functions
(triton_decode_q8.launch_gate_up / launch_down) run on CPU tensors of the model's shapes with the kernels swapped for
`warmup` under a stub sm_90 driver, so every argument gets the launch's own specialization (pointers 16-byte aligned,
integers typed i32 and marked divisible by 16 where they are, 1 a constant). bench/kernel_regs.py types the strides
i64 without divisibility: its Q4_0 gate_up came out at 1,408 instructions with 64 scalar weight loads, against the
JIT's 1,360 with 16 LDG.128. Environment variables the launchers read at each launch (MOETIER_V5_ADDR,
MOETIER_V5_SPLIT) apply.

    python bench/sass_phases.py [--fmt Q4_0] [--variant v5pdl] [--model qwen3-30b-a3b] [--dump DIR] > phases.json
    MOETIER_V5_ADDR=1 python bench/sass_phases.py

Phases (by markers in the listing): setup (to the first weight load, LDG.E.EF*), weight loads (first to last), x copy
(to the last BAR before the first IDP: v5qx's own int8 copy of x; down has none), dot math (to the last IDP), after the
last IDP (the block scale steps' tail, reductions, activation, stores, h's int8 copy), out-of-line (after the last
EXIT: the IEEE division's slow path, never run for finite inputs). Counts are static (one thread's instruction stream;
the kernels have no loops at these tiles).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.runtime import driver

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_gpu_kernels import MODELS, Hopper, make_weights  # noqa: E402

from moetier.kernels import triton_decode_q8 as q8  # noqa: E402
from moetier.kernels import triton_moe  # noqa: E402
from moetier.kernels.triton_weights import Weights  # noqa: E402

KEYS = ("IMAD", "LEA", "IADD3", "SHF", "LOP3", "MOV", "LDG", "IDP", "FADD", "FFMA", "FMUL", "SHFL", "MUFU")


class _Capture:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` compiles (warmup) and keeps the compiled kernel."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.compiled = self.fn.warmup(*args, grid=grid, **kw)
        return launch


def compile_pair(fmt: str, model: str, variant: str | None = None) -> dict:
    """{"gate_up": compiled, "down": compiled} of the format's T=1 v5 pair, its default (variant None) or v5 / v5pdl /
    v5q / v5qx (moe_decode's launches; the tiles GATE_UP5Q where v5q / v5qx, else GATE_UP5, and DOWN5), compiled
    through the launch functions."""
    d, i, k = MODELS[model][:3]
    variant = variant or triton_moe.DEFAULT_VARIANT.get(fmt, "v5pdl")
    pdl = variant != "v5"
    gw = Weights(make_weights(fmt, 2, 2 * i, d, None, device="cpu"), fmt)
    dw = Weights(make_weights(fmt, 2, d, i, None, device="cpu"), fmt)
    x = torch.randn(1, d).to(torch.bfloat16)
    ids, wt = torch.zeros(k, dtype=torch.int32), torch.ones(k, dtype=torch.bfloat16)
    h = torch.empty(k, i)
    tile = q8.Tile(*(q8.GATE_UP5Q.get(fmt, q8.GATE_UP5[fmt]) if variant in ("v5q", "v5qx") else q8.GATE_UP5[fmt])[:4])
    qh = q8.h_quantizer(tile.bn) if variant in ("v5q", "v5qx") else 0
    hx = q8.h_int8(h)
    xq = None if variant == "v5qx" else (torch.empty(1, d, dtype=torch.int8), torch.empty(1, d // 32),
                                         torch.empty(1, d // 32))
    gu, dn = _Capture(q8._gate_up_kernel), _Capture(q8._down_kernel)
    q8._gate_up_kernel, q8._down_kernel = gu, dn
    try:
        q8.launch_gate_up(xq, ids, gw, 0, 1.0, 7.0, None, h, hx, tile, qh, pdl, 1, x if variant == "v5qx" else None)
        q8.launch_down(hx, ids, wt, dw, None, torch.empty_like(x), q8.Tile(*q8.DOWN5[fmt][:4]), pdl)
    finally:
        q8._gate_up_kernel, q8._down_kernel = gu.fn, dn.fn
    return {"gate_up": gu.compiled, "down": dn.compiled, "variant": variant, "tiles": [list(tile), list(q8.DOWN5[fmt])]}


def compile_v2_pair(fmt: str, model: str) -> dict:
    """As compile_pair, for a format whose default pair is v2 (float activations: the formats read as stored,
    triton_rawq), through triton_decode.gate_up / down."""
    from moetier.kernels import triton_decode as v2
    d, i, k = MODELS[model][:3]
    gw = Weights(make_weights(fmt, 2, 2 * i, d, None, device="cpu"), fmt)
    dw = Weights(make_weights(fmt, 2, d, i, None, device="cpu"), fmt)
    x = torch.randn(1, d).to(torch.bfloat16)
    ids, wt = torch.zeros(k, dtype=torch.int32), torch.ones(k, dtype=torch.bfloat16)
    gu, dn = _Capture(v2._gate_up_kernel), _Capture(v2._down_kernel)
    v2._gate_up_kernel, v2._down_kernel = gu, dn
    try:
        v2.gate_up(x, ids, gw, 0, 1.0, 7.0, None, torch.empty(k, i))
        v2.down(torch.empty(k, i), ids, wt, dw, None, torch.empty_like(x))
    finally:
        v2._gate_up_kernel, v2._down_kernel = gu.fn, dn.fn
    return {"gate_up": gu.compiled, "down": dn.compiled, "variant": "v2",
            "tiles": [list(v2.GATE_UP[fmt]), list(v2.DOWN[fmt])]}


def sass_of(kernel, dump: Path | None, name: str) -> tuple[str, dict]:
    """The kernel's SASS listing (cuobjdump, bundled with Triton) and its resource usage."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with __import__("tempfile").TemporaryDirectory() as tmp:
        f = Path(tmp) / f"{name}.cubin"
        f.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(f)], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([str(tool), "--dump-resource-usage", str(f)], capture_output=True, text=True,
                             check=True).stdout
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.sass").write_text(sass)
        (dump / f"{name}.ptx").write_text(kernel.asm["ptx"])
        (dump / f"{name}.ttgir").write_text(kernel.asm["ttgir"])
    regs, stack = (int(re.search(p + r":(\d+)", use).group(1)) for p in ("REG", "STACK"))
    return sass, {"registers": regs, "stack_bytes": stack}


def instructions(sass: str) -> list[str]:
    return [m.group(1) for line in sass.splitlines() if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line))]


def opcode(text: str) -> str:
    return re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text).group(1)


def phases(ins: list[str]) -> dict:
    """[start, end) of each phase (module docstring)."""
    ops = [opcode(t) for t in ins]
    weights = [j for j, t in enumerate(ins) if re.search(r"\bLDG\.E\.EF", t)]
    idp = [j for j, o in enumerate(ops) if o == "IDP"]
    bars = [j for j, o in enumerate(ops) if o == "BAR" and weights[-1] < j < idp[0]]
    x_end = (bars[-1] if bars else weights[-1]) + 1
    end = max(j for j, o in enumerate(ops) if o == "EXIT") + 1
    return {"setup": (0, weights[0]), "weight_loads": (weights[0], weights[-1] + 1), "x_copy": (weights[-1] + 1, x_end),
            "dot_math": (x_end, idp[-1] + 1), "after_last_idp": (idp[-1] + 1, end), "out_of_line": (end, len(ins))}


def count(sass: str) -> dict:
    ins = instructions(sass)
    ops = [opcode(t) for t in ins]
    loads = Counter(m.group(0) for t in ins if (m := re.search(r"\bLDG\S*", t)))
    out = {"total": len(ins), "ops": {k: ops.count(k) for k in KEYS}, "loads": dict(loads), "phases": {}}
    if "IDP" not in ops:                     # v2 (float math): no dp4a phases
        return out
    for name, (a, b) in phases(ins).items():
        c = Counter(ops[a:b])
        out["phases"][name] = {"n": b - a, **{k: c[k] for k in KEYS if c[k]}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="Q4_0")
    ap.add_argument("--variant", choices=("v2", "v5", "v5pdl", "v5q", "v5qx"),
                    help="the pair to compile (default: the format's default variant)")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=[m for m in MODELS if m != "tiny"])
    ap.add_argument("--dump", type=Path, help="write each kernel's .sass, .ptx and .ttgir here")
    a = ap.parse_args()
    driver.set_active(Hopper())
    variant = triton_moe.variant_of(a.fmt, a.variant)
    pair = compile_v2_pair(a.fmt, a.model) if variant == "v2" else compile_pair(a.fmt, a.model, variant)
    out = {"fmt": a.fmt, "model": a.model, "variant": pair["variant"], "tiles": pair["tiles"], "kernels": {}}
    for name in ("gate_up", "down"):
        sass, use = sass_of(pair[name], a.dump, f"{a.fmt}_{name}")
        out["kernels"][name] = {**use, **count(sass)}
        c = out["kernels"][name]
        print(f"{a.fmt} {name}: {c['total']} instructions, {c['registers']} registers, loads {c['loads']}",
              file=sys.stderr)
        for ph, v in c["phases"].items():
            print(f"  {ph:15} {v['n']:5}  " + " ".join(f"{k} {n}" for k, n in v.items() if k != "n"), file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
