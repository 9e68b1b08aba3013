"""Memory tiers: experts placed over the fast tier (GPU), the RAM bank and the SSD.

    placement = plan_for_load(path, config, device, dtype, default_ctx)   # budgets -> placement (headers only)
    model = load_model(path, ..., skip=EXPERT_PARAM)                       # dense weights only
    tiers = install(model, placement, config)                              # TieredExperts in every MoE block

plan.py (budgets -> placement), cache.py (fast-tier slots and policies), store.py (RAM bank, SSD
reads), fast.py (fast-tier arena), experts.py (TieredExperts), profile.py, prefetch.py, stats.py.
"""
from __future__ import annotations

from pathlib import Path

from ..config import EngineConfig
from ..errors import UserError
from .layout import EXPERT_PARAM


def wants_tiers(config: EngineConfig) -> bool:
    """Tiers are on when any budget, placement rule, policy or profile was asked for."""
    return bool(getattr(config, "tiers", False) or config.gpu_mem is not None or config.ram_mem is not None
                or config.cpu_moe or config.n_cpu_moe or config.override_tensor or config.cache_policy
                or config.expert_profile or config.save_profile or config.prefill_copy_tokens is not None)


TIERED_PREFILL_CHUNK = 8192   # CUDA: prompt tokens per layer pass when experts stream through the GPU


def plan_for_load(path: Path, config: EngineConfig, device: str, dtype, default_ctx: int,
                  prefill_chunk: int | None = None):
    """The placement Engine.load will use; raises UserError (before any weight is read) when the
    budgets cannot hold the dense weights and KV cache. The prefill chunk is 8192 on CUDA (each
    chunk copies the experts it uses once: 8K chunks cut expert copies 3.3x against 2K in LESSONS §5),
    2048 on the CPU (the workspace is RAM the bank could use) or when 8K would take over a tenth of
    the GPU budget (the expert cache matters more to decode)."""
    chunks = [prefill_chunk] if prefill_chunk else None
    from .bandwidth import bandwidths
    from .plan import inspect
    inspected = inspect(Path(path))
    args = inspected[0]
    ctx = config.max_context or min(args.max_position_embeddings, default_ctx)
    bw = None
    if device.startswith("cuda") and config.prefill_copy_tokens is None:
        bw = bandwidths(device, None, gpu_budget=config.gpu_mem)
    pl = placement_with_chunk(Path(path), config, device, dtype, ctx, bw, inspected, chunks)
    if pl.problems:
        raise UserError("the memory budgets do not fit this model: " + "; ".join(pl.problems)
                        + f". See `moetier plan {path}` with the same flags")
    return pl


def placement_with_chunk(path: Path, config, device: str, dtype, ctx: int, bw, inspected, chunks=None):
    """make_placement with the largest prefill chunk of `chunks` whose workspace stays under a tenth
    of the GPU budget (default: 8192 then 2048 on CUDA, 2048 on the CPU)."""
    from .plan import make_placement
    chunks = chunks or ([TIERED_PREFILL_CHUNK, 2048] if device.startswith("cuda") else [2048])
    for chunk in chunks:
        pl = make_placement(path, config, device, dtype, ctx, chunk, bw, inspected)
        if not pl.gpu_budget or pl.workspace_bytes <= pl.gpu_budget / 10:
            break
    return pl


def install(model, placement, config):
    from .experts import install as _install
    return _install(model, placement, config)


__all__ = ["EXPERT_PARAM", "wants_tiers", "plan_for_load", "install"]
