"""`moetier plan MODEL [budgets]`: what goes where, before loading anything.

Reads config.json and the safetensors headers only. Prints each tensor group's tier and bytes,
the KV cache at the context, expert slots per tier, the predicted decode ceiling (bytes per token
over each tier's bandwidth) and the prefill rule (when copying an expert over PCIe beats the CPU).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import EngineConfig
from ..errors import UserError
from ..memory.bandwidth import bandwidths
from ..memory.budget import fmt_bytes
from ..memory import placement_with_chunk
from ..memory.plan import HOST_GROUP, decode_ceiling, inspect, prefill_copy_rule
from ..runtime.engine import DEFAULT_CONTEXT, resolve_model_path
from .common import add_model_args, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="show where a model's weights would go under the given budgets",
                       description="Plan the placement of MODEL's weights over GPU / RAM / SSD under the budgets, "
                                   "from config.json and the safetensors headers only (no weight is read).")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g = p.add_argument_group("bandwidths (GB/s; default: measured once, cached in ~/.cache/moetier/bandwidth.json)")
    for name, what in (("hbm", "GPU memory"), ("ram", "CPU memory"), ("ssd", "SSD reads"), ("pcie", "host -> GPU")):
        g.add_argument(f"--{name}-bw", type=float, default=None, metavar="GBS", help=f"{what} bandwidth")
    p.set_defaults(func=main)


def _device(args) -> tuple[str, torch.dtype, list[str]]:
    """The device to plan for: a CUDA plan may be made on a machine without CUDA given --gpu-mem."""
    notes = []
    want = args.device
    if want.startswith("cuda") and not torch.cuda.is_available():
        if args.gpu_mem is None or str(args.gpu_mem).lower() == "auto":
            raise UserError("planning for --device cuda on a machine without CUDA needs an explicit --gpu-mem SIZE")
        notes.append("planned for a CUDA device that this machine does not have")
        device = want
    else:
        device = EngineConfig(device=want).resolved_device()
    dtype = EngineConfig(dtype=args.dtype).resolved_dtype(device)
    return device, dtype, notes


def main(args) -> int:
    config: EngineConfig = engine_config(args)
    path = resolve_model_path(args.model)
    device, dtype, notes = _device(args)
    inspected = inspect(Path(path))
    margs, _, ckpt, layout = inspected
    ctx = config.max_context or min(margs.max_position_embeddings, DEFAULT_CONTEXT)
    flags = {"hbm_gbs": args.hbm_bw, "ram_gbs": args.ram_bw, "ssd_gbs": args.ssd_bw, "pcie_gbs": args.pcie_bw}
    first_file = Path(layout.parts(0, 0)[0].path)     # a checkpoint file (safetensors or GGUF) to time reads on
    bw = bandwidths(device, first_file, flags)
    pl = placement_with_chunk(Path(path), config, device, dtype, ctx, bw, inspected)    # as Engine.load plans it
    ceiling = decode_ceiling(pl, bw)
    rule = prefill_copy_rule(layout, bw, "bfloat16")
    summary = pl.summary()
    summary.update({"decode_ceiling": ceiling, "prefill_rule": rule, "bandwidth": bw, "notes": notes})
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print(render(pl, ceiling, rule, bw, notes))
    return 1 if pl.problems else 0


def _layer_ranges(idx: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def render(pl, ceiling: dict, rule: dict, bw: dict, notes: list[str]) -> str:
    s = pl.summary()
    ex = s["experts"]
    lines = [f"{pl.model} ({pl.model_type}): {ex['layers']} MoE layers x {ex['per_layer']} experts, "
             f"top-{ex['top_k']}; device {pl.device}, compute {s['dtype']}, experts stored as {s['storage_dtype']}; "
             f"context {pl.ctx} tokens"]
    lines += [f"note: {n}" for n in notes]
    b = s["budgets"]
    lines.append(f"budgets: gpu {fmt_bytes(b['gpu'])} ({b['gpu_source']}); ram {fmt_bytes(b['ram'])} ({b['ram_source']})")
    dev = "gpu" if pl.fast_device == "cuda" else "ram"
    rows = [(g["group"], "ram" if g["group"] == HOST_GROUP else dev, str(g["tensors"]), fmt_bytes(g["bytes"]))
            for g in pl.groups]
    rows.append((f"KV cache ({pl.ctx} tokens)", "ram" if pl.kv_tier == "ram" else dev, "-", fmt_bytes(pl.kv_bytes)))
    if pl.state_bytes:
        rows.append(("recurrent state (linear-attention layers; any context)", dev, "-", fmt_bytes(pl.state_bytes)))
    rows.append((f"prefill workspace (chunk {min(pl.prefill_chunk, pl.ctx)}, estimate)", dev, "-",
                 fmt_bytes(pl.workspace_bytes)))
    rows.append((f"experts ({ex['layers']} x {ex['per_layer']} x {fmt_bytes(ex['bytes_per_expert'])}; "
                 f"{fmt_bytes(ex['bytes_per_layer'])} per layer)", "tiered",
                 str(ex["layers"] * ex["per_layer"] * len(pl.layout.params)), fmt_bytes(ex["total_bytes"])))
    lines += ["", _table(("group", "tier", "tensors", "bytes"), rows)]
    t = s["tiers"]
    sizes = pl.fast_slots
    fast_name = "gpu" if pl.fast_device == "cuda" else "gpu (CPU stand-in)"
    policy = f"{pl.policy} slots" + (f", {t['gpu']['pinned']} pinned" if t["gpu"]["pinned"] else "") + \
        (f", +{pl.stage_slots} prefill stage" if pl.stage_slots else "")
    bank = "every expert" if pl.bank_all else "LRU cache over the SSD"
    rows = [(fast_name, str(t["gpu"]["slots"]), f"{min(sizes)}-{max(sizes)}" if sizes else "0", policy,
             fmt_bytes(t["gpu"]["bytes"]), f"{t['gpu']['expected_share']:.0%}"),
            ("ram", str(pl.bank_slots), "-", f"bank: {bank} (+{pl.scratch} read buffers)",
             fmt_bytes(t["ram"]["bytes"]), f"{t['ram']['expected_share']:.0%}"),
            ("ssd", str(t["ssd"]["experts"]), "-", "checkpoint file, read on demand", "-",
             f"{t['ssd']['expected_share']:.0%}")]
    lines += ["", _table(("tier", "experts", "per layer", "role", "bytes", "routes (est.)"), rows)]
    forced = {k: [pl.layout.layers[i] for i, x in enumerate(pl.layer_tiers) if x == k] for k in ("gpu", "cpu", "disk")}
    for k, v in forced.items():
        if v:
            lines.append(f"layers whose experts are forced to {k}: {_layer_ranges(v)}")
    src = bw["source"]
    fast_bw = ("hbm_gbs" if pl.fast_device == "cuda" else "ram_gbs")
    cpu_key = f"cpu_gbs_{ceiling['cpu_dtype']}"
    rows = [("gpu" if pl.fast_device == "cuda" else "fast (RAM)", fmt_bytes(ceiling["bytes"]["gpu"]),
             f"{bw[fast_bw]:g} GB/s ({src[fast_bw]})", f"{ceiling['ms']['gpu']:.2f} ms"),
            ("ram (CPU experts" + (f"; {pl.pcie_share:.0%} of misses read by the GPU over PCIe)"
                                   if pl.pcie_share else ")"),
             fmt_bytes(ceiling["bytes"]["ram"]),
             f"{bw['ram_gbs']:g} GB/s ({src['ram_gbs']})" + (f" + PCIe {bw['pcie_gbs']:g} GB/s" if pl.pcie_share
                                                                  and pl.fast_device == "cuda" else ""),
             f"{ceiling['ms']['ram']:.2f} ms"),
            ("ssd", fmt_bytes(ceiling["bytes"]["ssd"]), f"{bw['ssd_gbs']:g} GB/s ({src['ssd_gbs']})",
             f"{ceiling['ms']['ssd']:.2f} ms")]
    lines += ["", "decode ceiling per token (dense + KV at full context on the device; experts by the routes "
                  "each tier is expected to serve, uniform routing unless a profile is given):",
              _table(("tier", "reads/token", "bandwidth", "time"), rows),
              f"  bound: {ceiling['bound_ms']:.2f} ms/token = {ceiling['bound_tok_s']:.1f} tok/s (tiers overlapped); "
              f"serial {ceiling['serial_ms']:.2f} ms",
              f"  with torch's CPU expert math ({bw.get(cpu_key, 0):g} GB/s {ceiling['cpu_dtype']}, {src.get(cpu_key)}): "
              f"{ceiling['torch_cpu_ms']:.2f} ms/token = {ceiling['torch_cpu_tok_s']:.1f} tok/s"]
    lines.append(f"prefill rule: copying an expert over PCIe ({fmt_bytes(pl.layout.raw_bytes)} at "
                 f"{bw['pcie_gbs']:g} GB/s = {rule['copy_ms']:.2f} ms) beats computing it on the CPU "
                 f"({rule['cpu_ms_per_token']:.3f} ms per token at {bw['cpu_gflops_bfloat16']:g} GFLOP/s bf16, "
                 f"{rule['cpu_gemv_ms']:.2f} ms for one token) once a chunk routes >= {rule['tokens']} tokens "
                 "to it" + ("" if pl.fast_device == "cuda" else " (no GPU here: every miss runs on the CPU)"))
    if pl.fast_device == "cuda" and ceiling["bytes"]["ram"]:
        lines.append("decode misses: " + ("the CPU loads the next layer's guessed misses while the GPU runs attention "
                                          "(--prefetch off: not)" if pl.miss_prefetch else
                                          "no prefetch of guessed misses (--prefetch off)"))
    if pl.problems:
        lines += [""] + [f"DOES NOT FIT: {p}" for p in pl.problems]
    return "\n".join(lines)


def _table(header: tuple, rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*map(str, r)) for r in rows])
