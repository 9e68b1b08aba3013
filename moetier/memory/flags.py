"""Command-line flags of the memory tiers (added to every command that loads a model) and their
translation to EngineConfig fields."""
from __future__ import annotations

import argparse

from .cache import POLICIES


def add_memory_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory tiers (any of these turns them on; see `moetier plan`)")
    g.add_argument("--cpu-moe", action="store_true", help="keep every layer's experts off the GPU (RAM/SSD)")
    g.add_argument("--n-cpu-moe", type=int, default=0, metavar="N",
                   help="keep the experts of layers 0..N-1 off the GPU (llama.cpp's knob)")
    g.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="REGEX=TIER",
                   help="place the expert tensors whose names match REGEX on gpu, cpu (RAM) or disk (SSD); "
                        "repeatable, the first matching rule wins; llama.cpp names (blk.N.ffn_up_exps) match too")
    g.add_argument("--cache-policy", choices=POLICIES, default=None,
                   help="fast-tier expert cache: lru (default), lfu (aged counts), static (profile pins), "
                        "mix (profile pins + LRU; default with --expert-profile)")
    g.add_argument("--expert-profile", default=None, metavar="FILE",
                   help="expert profile (moetier profile): pin/preload the hottest experts")
    g.add_argument("--save-profile", default=None, metavar="FILE", help="write the expert counts seen to FILE at exit")
    g.add_argument("--prefetch", choices=("on", "off", "auto"), default="auto",
                   help="guess the next layer's experts from this layer's input: in the graphed CUDA decode "
                        "the CPU loads the guessed misses' rows while the GPU runs attention (on unless off); "
                        "SSD reads and GPU copies started early (auto: only with the mix policy, where it was "
                        "measured to help)")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N", help="threads for CPU expert work")
    g.add_argument("--pcie-share", type=_share, default=None, metavar="F",
                   help="CUDA decode: share of each layer's cache misses the GPU reads straight from pinned RAM "
                        "over PCIe while the CPU computes the rest (0: CPU only; default: the measured share)")
    g.add_argument("--direct-io", action="store_true", help="read streamed experts with O_DIRECT (no page cache)")
    g.add_argument("--prefill-copy-tokens", type=int, default=None, metavar="N",
                   help="in prefill, copy a missed expert to the fast tier when a chunk routes >= N tokens to it "
                        "(default: the measured rule; 0: never)")


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share between 0 and 1 (e.g. 0.5)")
    return v


def memory_fields(args) -> dict:
    """EngineConfig fields from parsed flags (flags absent from a command's parser keep defaults)."""
    from .plan import parse_override
    g = (lambda name, default=None: getattr(args, name, default))
    given = any(g(n) is not None for n in ("gpu_mem", "ram_mem", "gpu_reserve"))
    return {
        "tiers": bool(given), "cpu_moe": bool(g("cpu_moe", False)), "n_cpu_moe": int(g("n_cpu_moe", 0) or 0),
        "override_tensor": tuple(parse_override(o) for o in (g("override_tensor", []) or [])),
        "cache_policy": g("cache_policy"), "expert_profile": g("expert_profile"), "save_profile": g("save_profile"),
        "prefetch": g("prefetch", "auto") or "auto", "cpu_threads": g("cpu_threads"),
        "direct_io": bool(g("direct_io", False)), "pcie_share": g("pcie_share"),
        "prefill_copy_tokens": g("prefill_copy_tokens"),
    }
