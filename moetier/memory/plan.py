"""Budgets -> placement: what goes where, how many experts each tier holds, and what decode can reach.

`make_placement` reads only config.json and the safetensors headers, or a GGUF file's metadata and
tensor infos (the model is built on the meta device for shapes; no weight byte is read). GGUF
experts keep their storage format in every tier, so the budgets count their quantized sizes. Engine.load uses the same placement it prints,
so `moetier plan` and a real load never disagree.

Tiers: "gpu" is the fast tier (the CUDA device; without CUDA a CPU arena stands in for it so the
policy, accounting and streaming run the same code), "ram" the RAM bank (storage dtype), "ssd"
the checkpoint file. Dense weights (attention, norms, routers, dense MLPs, shared experts),
embeddings, the KV cache and a prefill workspace live on the model's device.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig, ModelArgs
from ..errors import UserError
from .budget import default_gpu_reserve, default_ram_reserve, fmt_bytes, gpu_info, ram_info
from .cache import POLICIES
from .fast import DEQUANT_EXPERTS, REPACK_EXPERTS
from .layout import EXPERT_PARAM, ExpertLayout, build_layout
from .profile import ExpertProfile

TIER_NAMES = {"gpu": "gpu", "cuda": "gpu", "vram": "gpu", "cpu": "cpu", "ram": "cpu", "host": "cpu",
              "disk": "disk", "ssd": "disk"}
MIX_PIN_FRACTION = 0.75     # mix: share of the fast slots pinned from the profile; the rest is LRU
SCRATCH_BUFFERS = 4         # RAM buffers for streamed reads (= read-ahead depth)
PCIE_MAX = 8                # stage slots (and device staging rows) the graphed decode's PCIe share may use per layer
PCIE_SHARE = 0.25           # share of a decode layer's misses the GPU reads over PCIe without measured bandwidths
                            # (docs/perf-log.md, H200 box, 48-layer Q4_0, session 6: --cpu-moe 0.25 -> 54-57 tok/s,
                            # 0.355 -> 48-53); with them, pcie_share_default
STAGE_SLOTS = (32, 2)       # fast-tier buffers for prefill copies: two batches of 16 (double buffering) when the budget allows, else 2
DECODE_MAX = 8              # a call with at most this many tokens is decode (admits misses)
MAX_ADMIT = 8                # decode misses admitted into the GPU cache per step (memory.doorbell.MAX_ADMIT_PER_STEP)
# cuBLAS workspaces (32 MiB per thread and stream on sm_90: 4 of them were live at the peak of an H200 run,
# bench/vram_peak.py), allocator rounding and small transients on the GPU: with 160 MiB a `bench` run at
# --gpu-mem 8GiB still peaked 22 MB over (8.61 of 8.59 GB; bench/vram_peak.py's lighter run: 8.58), hence 64 MiB more
CUDA_WORKSPACE = 224 << 20


def parse_override(text: str) -> tuple[str, str]:
    """'REGEX=gpu|cpu|disk' (llama.cpp's CUDA0/CPU spellings too) -> (regex, tier)."""
    rx, sep, tier = str(text).rpartition("=")
    t = TIER_NAMES.get(tier.strip().lower()) or ("gpu" if re.fullmatch(r"(?i)cuda\d*", tier.strip()) else None)
    if not sep or not rx or t is None:
        raise UserError(f"--override-tensor {text!r}: write it as REGEX=gpu|cpu|disk, "
                        r"e.g. 'blk\.[0-9]\.ffn_.*_exps=cpu' or 'layers\.1[0-9]\.mlp\.experts=disk'")
    try:
        re.compile(rx)
    except re.error as e:
        raise UserError(f"--override-tensor {text!r}: bad regular expression ({e})") from None
    return rx, t


def gguf_names(layer: int, name: str) -> list[str]:
    """llama.cpp's tensor names for one of our stacked expert params (so -ot rules written for
    llama.cpp match): gate_up_proj -> blk.N.ffn_gate_exps.weight + blk.N.ffn_up_exps.weight."""
    base = {"gate_up_proj": ["ffn_gate_exps.weight", "ffn_up_exps.weight"], "down_proj": ["ffn_down_exps.weight"],
            "gate_up_bias": ["ffn_gate_exps.bias", "ffn_up_exps.bias"], "down_bias": ["ffn_down_exps.bias"]}
    return [f"blk.{layer}.{n}" for n in base.get(name, [])]


def layer_tiers(layout: ExpertLayout, config: EngineConfig) -> list[str]:
    """Per MoE layer: 'auto' (the cache decides), or 'gpu' / 'cpu' / 'disk' forced. --override-tensor
    rules are tried in order and the first match wins (as in llama.cpp), then --cpu-moe / --n-cpu-moe.
    A layer whose params match different tiers goes to the slowest of them."""
    rules = [(re.compile(rx), t) for rx, t in (parse_override(o) if isinstance(o, str) else o
                                                for o in config.override_tensor)]
    order = ["gpu", "cpu", "disk"]
    out = []
    for layer, prefix in zip(layout.layers, layout.prefixes):
        found = []
        for p in layout.params:
            names = [f"{prefix}.experts.{p.name}"] + gguf_names(layer, p.name)
            t = next((t for rx, t in rules if any(rx.search(n) for n in names)), None)
            if t is None and (config.cpu_moe or layer < (config.n_cpu_moe or 0)):
                t = "cpu"
            found.append(t)
        forced = [t for t in found if t]
        out.append(max(forced, key=order.index) if forced else "auto")
    return out


def check_dense_overrides(names: list[str], config: EngineConfig, device: str) -> None:
    rules = [(re.compile(rx), t) for rx, t in (parse_override(o) if isinstance(o, str) else o
                                                for o in config.override_tensor)]
    for n in names:
        t = next((t for rx, t in rules if rx.search(n)), None)
        if t == "disk" or (t == "cpu" and device.startswith("cuda")):
            raise UserError(f"--override-tensor puts the dense tensor {n} on {t}; moetier places only expert "
                            "tensors by rule (dense weights stay on the model's device). Narrow the regex "
                            r"to expert tensors, e.g. 'experts' or 'ffn_.*_exps'")


def _formats(layout) -> str:
    """The experts' GGML formats over params and layers: "Q4_K", or "Q4_K/Q6_K" (Q4_K_M)."""
    return "/".join(dict.fromkeys(v.qtype for p in layout.params for v in layout.param_variants(p.name)))


@dataclass
class Placement:
    model: str
    model_type: str
    device: str                    # dense weights, KV cache, fast tier
    dtype: torch.dtype             # compute dtype
    ctx: int
    prefill_chunk: int
    layout: ExpertLayout
    top_k: int
    storage_dtype: torch.dtype
    expert_bytes: int              # one expert in RAM / on disk (packed, aligned)
    expert_fast_bytes: int         # one expert in the fast tier (compute dtype)
    groups: list[dict]             # [{"group", "tier", "tensors", "bytes"}]
    dense_bytes: int
    embed_bytes: int
    kv_bytes: int
    workspace_bytes: int
    layer_tiers: list[str]
    fast_slots: list[int]
    pinned: list[list[int]]
    fast_preload: list[list[int]]
    stage_slots: int
    staging_bytes: int
    pcie_share: float               # share of each decode layer's RAM misses the GPU reads over PCIe (0: none)
    bank_slots: int
    bank_candidates: int
    bank_order: list[tuple[int, int]]
    scratch: int
    gpu_budget: int
    ram_budget: int
    budget_notes: dict
    policy: str
    prefetch: bool                  # the eager path's guesses: SSD reads and fast-tier copies started early
    prefill_copy_tokens: int | None
    share: np.ndarray              # expected route share per (li, e)
    kv_tier: str = "device"        # "ram" with --kv-offload on CUDA
    state_bytes: int = 0           # recurrent states (DeltaNet conv + ssm): on the device, never offloaded
    problems: list[str] = field(default_factory=list)
    embed_host_bytes: int = 0       # token embeddings in pinned RAM (plan.host_embedding), not on the device
    lm_head_bytes: int = 0          # read whole by every token (in its GGUF blocks where QuantLinear keeps them)
    miss_prefetch: bool = True      # graphed CUDA decode: the CPU loads its guessed next-layer misses early (doorbell.c)

    @property
    def fast_device(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def bank_all(self) -> bool:
        return self.bank_slots >= self.bank_candidates and "disk" not in self.layer_tiers

    def disk_layers(self) -> set[int]:
        return {li for li, t in enumerate(self.layer_tiers) if t == "disk"}

    def expected_coverage(self) -> dict:
        """Expected share of routes served by each tier: fast tier (the experts it starts with, or
        uniform slots/E), RAM (the bank's preload among the rest), SSD (the remainder)."""
        fast = np.zeros_like(self.share, dtype=bool)
        for li, es in enumerate(self.fast_preload):
            fast[li, es] = True
        f_share = float((self.share * fast).sum() / max(self.num_layers, 1))
        # dynamic slots that start empty: count them as holding an average expert
        f_extra = sum(max(0, n - len(self.fast_preload[li])) / self.num_experts
                      for li, n in enumerate(self.fast_slots)) / max(self.num_layers, 1)
        f = min(1.0, f_share + f_extra)
        if self.bank_all:
            r = 1.0 - f
        else:
            bank = np.zeros_like(fast)
            for li, e in self.bank_order[:self.bank_slots]:
                bank[li, e] = True
            r = float((self.share * (bank & ~fast)).sum() / max(self.num_layers, 1))
            r = min(r, 1.0 - f)
        return {"gpu": f, "ram": r, "ssd": max(0.0, 1.0 - f - r)}

    def summary(self) -> dict:
        cov = self.expected_coverage()
        return {
            "model": self.model, "model_type": self.model_type, "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "storage_dtype": _formats(self.layout) if self.layout.qtype else str(self.storage_dtype).removeprefix("torch."),
            "ctx": self.ctx, "groups": self.groups, "kv_bytes": self.kv_bytes, "state_bytes": self.state_bytes,
            "kv_tier": self.kv_tier, "workspace_bytes": self.workspace_bytes, "prefill_chunk": self.prefill_chunk,
            "experts": {"layers": self.num_layers, "per_layer": self.num_experts, "top_k": self.top_k,
                        "bytes_per_expert": self.expert_bytes, "fast_bytes_per_expert": self.expert_fast_bytes,
                        "bytes_per_layer": self.expert_bytes * self.num_experts,
                        "total_bytes": self.expert_bytes * self.num_experts * self.num_layers},
            "budgets": {"gpu": self.gpu_budget, "ram": self.ram_budget, **self.budget_notes},
            "tiers": {
                "gpu": {"slots": sum(self.fast_slots), "per_layer": self.fast_slots,
                        "pinned": sum(len(p) for p in self.pinned), "stage_slots": self.stage_slots,
                        "staging_bytes": self.staging_bytes, "pcie_share": self.pcie_share,
                        "bytes": sum(self.fast_slots) * self.expert_fast_bytes, "expected_share": cov["gpu"]},
                "ram": {"slots": self.bank_slots, "all_experts": self.bank_all, "scratch": self.scratch,
                        "bytes": (self.bank_slots + self.scratch) * self.expert_bytes, "expected_share": cov["ram"]},
                "ssd": {"experts": self.num_layers * self.num_experts - self.bank_slots - sum(self.fast_slots)
                        if not self.bank_all else 0, "expected_share": cov["ssd"]},
            },
            "layer_tiers": self.layer_tiers, "policy": self.policy, "prefetch": self.prefetch, "miss_prefetch": self.miss_prefetch,
            "prefill_copy_tokens": self.prefill_copy_tokens, "problems": self.problems,
        }


def inspect(path: Path):
    """-> (args, meta model, NamedCheckpoint or GGUFCheckpoint, layout) from config.json + headers,
    or a GGUF file's metadata and tensor infos, only."""
    from ..models import model_class
    from ..weights.gguf import is_gguf, open_checkpoint
    from ..weights.loader import NamedCheckpoint, read_config
    from ..weights.safetensors import Checkpoint
    if is_gguf(path):
        ckpt = open_checkpoint(path)
        args = ckpt.args
        cls = model_class(args.model_type)
    elif path.is_file():
        raise UserError(f"{path}: memory tiers read a safetensors model directory or a .gguf file")
    else:
        args = read_config(path)
        cls = model_class(args.model_type)
        ckpt = NamedCheckpoint(Checkpoint(path), cls.CHECKPOINT)
    with torch.device("meta"):
        model = cls(args)
    return args, model, ckpt, build_layout(model, ckpt)


def make_placement(path: Path, config: EngineConfig, device: str, dtype: torch.dtype, ctx: int,
                   prefill_chunk: int = 2048, bw: dict | None = None, inspected=None) -> Placement:
    args, model, ckpt, layout = inspected or inspect(Path(path))
    L, E = layout.num_layers, layout.num_experts
    cuda = device.startswith("cuda")
    from ..models.quant_linear import cpu_bytes, gpu_bytes
    quant = {} if getattr(config, "dequantize_dense", False) else \
        gpu_bytes(ckpt, [n for n, _ in model.named_parameters()], device)
    if device == "cpu":         # a CPU run's GGUF linears and embeddings stay in their blocks (no float copy)
        quant = cpu_bytes(ckpt, model, dtype)
    host_embed = host_embedding(config, device)
    groups, dense, embed, embed_host = _groups(model, dtype, quant, host_embed)
    head = dict(model.named_parameters()).get("lm_head.weight")
    lm_head = quant.get("lm_head.weight", 0 if head is None else head.numel() * dtype.itemsize)
    check_dense_overrides([n for n, _ in model.named_parameters() if not EXPERT_PARAM.search(n)], config, device)
    kv, state = cache_bytes(model, ctx, dtype, getattr(config, "kv_dtype", "auto"))
    kv_on_host = cuda and getattr(config, "kv_offload", False)     # --kv-offload keeps the KV cache in RAM
    chunk = min(prefill_chunk, ctx)
    inter = layout.params[0].shape[0] // 2 if layout.params else 0
    heads = args.num_attention_heads
    # attention: CUDA SDPA runs a memory-efficient kernel (the bool mask is materialised, not the
    # scores); on the CPU count the fp32 scores
    scores = chunk * ctx if cuda else heads * chunk * min(chunk, ctx) * 4
    workspace = chunk * (args.num_experts_per_tok * 4 * inter + 12 * args.hidden_size) * dtype.itemsize \
        + scores + (CUDA_WORKSPACE if cuda else 0)
    eb, fb = layout.expert_bytes, layout.fast_bytes(dtype)
    float_expert = sum(math.prod(p.shape) for p in layout.params) * dtype.itemsize
    if cuda and layout.qtype:       # CUDA prefill dequantizes GGML experts, DEQUANT_EXPERTS at a time
        workspace += DEQUANT_EXPERTS * float_expert
    tiers = layer_tiers(layout, config)
    policy = config.cache_policy or ("mix" if config.expert_profile else "lru")
    if policy not in POLICIES:
        raise UserError(f"--cache-policy {policy!r}: use one of {', '.join(POLICIES)}")
    profile = ExpertProfile.load(config.expert_profile, layout.layers, E) if config.expert_profile else None
    if policy in ("static", "mix") and profile is None:
        raise UserError(f"--cache-policy {policy} pins experts from a profile: give --expert-profile FILE "
                        "(make one with `moetier profile MODEL --prompts FILE --out profile.json`)")
    share = profile.share() if profile is not None else np.full((L, E), 1.0 / E)
    notes, problems = {}, []

    # ---- budgets
    gpu_free, gpu_total = gpu_info(device)
    ram_free, ram_total = ram_info()
    if cuda:
        if config.gpu_mem is not None:
            gpu_budget = config.gpu_mem
            notes["gpu_source"] = "--gpu-mem"
        else:
            reserve = config.gpu_reserve if config.gpu_reserve is not None else default_gpu_reserve(gpu_total)
            gpu_budget = max(0, gpu_free - reserve)
            notes["gpu_source"] = f"auto: {fmt_bytes(gpu_free)} free - {fmt_bytes(reserve)} reserve"
    else:
        gpu_budget = config.gpu_mem or 0
        notes["gpu_source"] = "--gpu-mem (a CPU arena stands in for the GPU)" if config.gpu_mem else \
            "no GPU: no fast tier (--gpu-mem SIZE gives a CPU stand-in)"
    if config.ram_mem is not None:
        ram_budget = config.ram_mem
        notes["ram_source"] = "--ram-mem"
    else:
        reserve = default_ram_reserve(ram_total)
        ram_budget = max(0, ram_free - reserve)
        notes["ram_source"] = f"auto: {fmt_bytes(ram_free)} available - {fmt_bytes(reserve)} reserve"

    kv_dev = state + (0 if kv_on_host else kv)                     # what the cache keeps on the device
    fixed = dense + embed + kv_dev + workspace
    forced_fast = sum(E for t in tiers if t == "gpu")
    if cuda:
        gpu_left = gpu_budget - fixed
        if gpu_left < 0:
            problems.append(f"dense weights ({fmt_bytes(dense + embed)}) + KV cache at {ctx} tokens ({fmt_bytes(kv_dev)}) "
                            f"+ prefill workspace ({fmt_bytes(workspace)}) need {fmt_bytes(fixed)}, but the GPU "
                            f"budget is {fmt_bytes(gpu_budget)}: lower --ctx, raise --gpu-mem, or use a larger GPU")
        ram_left = ram_budget - (kv if kv_on_host else 0) - pinned_bytes(embed_host)
    else:
        gpu_left = gpu_budget
        ram_left = ram_budget - fixed
        if ram_left < 0:
            problems.append(f"dense weights ({fmt_bytes(dense + embed)}) + KV cache at {ctx} tokens ({fmt_bytes(kv_dev)}) "
                            f"+ prefill workspace ({fmt_bytes(workspace)}) need {fmt_bytes(fixed)} of RAM, but the "
                            f"RAM budget is {fmt_bytes(ram_budget)}: lower --ctx or raise --ram-mem")
    gpu_left -= forced_fast * fb
    if forced_fast and gpu_left < 0 and not problems:
        problems.append(f"--override-tensor keeps {forced_fast // E} layers' experts ({fmt_bytes(forced_fast * fb)}) "
                        f"in the fast tier, {fmt_bytes(-gpu_left)} more than its budget leaves: raise --gpu-mem "
                        "or send fewer layers to gpu")
    copy_tokens = config.prefill_copy_tokens
    if copy_tokens is None and cuda:
        copy_tokens = prefill_copy_rule(layout, bw or {}, "bfloat16")["tokens"]
    big, small = STAGE_SLOTS      # the batch only where it leaves most of the budget to the cache
    stage = (big if gpu_left >= 4 * big * fb else small if gpu_left >= small * fb else 0) if copy_tokens else 0
    # two layers' worth of stage slots where the cache cannot use the room anyway (--cpu-moe, few auto
    # layers): prefill copies the next layer's experts while this layer computes (FastTier.prefetch_layer)
    cacheable = sum(E for t in tiers if t == "auto")
    # GGML experts: raw staging rows for a layer, and the layer dequantized at once (Tiers._forward_staged_layer)
    layer_extra = E * eb + E * float_expert if layout.qtype else 0
    layer_stage = cuda and copy_tokens and gpu_left - 2 * E * fb - layer_extra >= cacheable * fb + 4 * big * fb
    if layer_stage:
        stage = 2 * E
    gpu_left -= stage * fb
    # fast.FastTier's device staging rows (a stage half, or a step's admissions) + repack temporaries
    rows = max(MAX_ADMIT, stage // 2)
    staging = rows * eb + min(rows, REPACK_EXPERTS) * fb if cuda and layout.qtype else 0
    if layer_stage:
        staging += E * float_expert if layout.qtype else 0
    share_cfg = pcie_share_default(bw) if config.pcie_share is None else config.pcie_share
    pcie_share = share_cfg if cuda and stage else 0.0
    staging += pcie_rows(pcie_share, args.num_experts_per_tok, stage) * eb   # the PCIe share's (memory.doorbell)
    gpu_left -= staging
    n_fast = max(0, gpu_left // fb) if fb else 0
    # CPU conversion buffer (float experts in another dtype; block formats are read as stored)
    conv = layout.fast_bytes(dtype) if not cuda and layout.params[0].dtype != dtype and not layout.qtype else 0
    if not cuda:    # the CPU stand-in's arena lives in RAM too: it may not take what streaming needs
        n_fast = max(0, min(n_fast, (ram_left - SCRATCH_BUFFERS * eb - conv - (stage + forced_fast) * fb) // fb))

    # ---- fast slots per layer
    sizes, pinned, preload = _fast_slots(tiers, n_fast, E, policy, profile)
    if not cuda:    # the CPU stand-in's arena lives in RAM too
        ram_left -= (sum(sizes) + stage) * fb

    # ---- RAM bank
    pinned_set = {(li, e) for li, es in enumerate(pinned) for e in es}
    candidates = [(li, e) for li in range(L) for e in range(E) if tiers[li] != "disk" and (li, e) not in pinned_set]
    scratch = SCRATCH_BUFFERS
    ram_left -= scratch * eb + conv
    if ram_left < 0 and not problems:
        used = "" if cuda else (f" after dense weights + KV cache + workspace ({fmt_bytes(fixed)}) and the fast-tier "
                                f"stand-in ({fmt_bytes((sum(sizes) + stage) * fb)})")
        problems.append(f"the RAM budget {fmt_bytes(ram_budget)}{used} leaves no room for {scratch} expert buffers "
                        f"({fmt_bytes(scratch * eb + conv)}) to stream experts from the SSD: raise --ram-mem")
    bank = int(min(len(candidates), max(0, ram_left) // eb))
    # experts the fast tier starts with go last: a partial bank first holds what the fast tier lacks
    in_fast = {(li, e) for li, es in enumerate(preload) for e in es}
    if profile is not None:
        rank = {p: i for i, p in enumerate(profile.ranking())}
        candidates.sort(key=lambda p: (p in in_fast, rank[p]))
    elif bank >= len(candidates):   # all fit: layer by layer, so a layer's experts are adjacent in RAM
        candidates.sort(key=lambda p: (p in in_fast, p[0], p[1]))     # (one copy for many: FastTier.load_many)
    else:   # round robin over layers, so each layer gets an even share of a partial bank
        candidates.sort(key=lambda p: (p in in_fast, p[1], p[0]))
    prefetch = {"on": True, "off": False}.get(config.prefetch, cuda and policy == "mix")
    pl = Placement(
        model=Path(path).name, model_type=args.model_type, device=device, dtype=dtype, ctx=ctx,
        prefill_chunk=prefill_chunk, layout=layout, top_k=args.num_experts_per_tok,
        storage_dtype=layout.params[0].dtype, expert_bytes=eb, expert_fast_bytes=fb, groups=groups,
        dense_bytes=dense, embed_bytes=embed, kv_bytes=kv, workspace_bytes=workspace, layer_tiers=tiers,
        fast_slots=sizes, pinned=pinned, fast_preload=preload, stage_slots=stage, staging_bytes=staging,
        pcie_share=pcie_share, bank_slots=bank,
        bank_candidates=len(candidates), bank_order=candidates, scratch=scratch, gpu_budget=gpu_budget,
        ram_budget=ram_budget, budget_notes=notes, policy=policy, prefetch=prefetch,
        prefill_copy_tokens=copy_tokens if stage else None, share=share, kv_tier="ram" if kv_on_host else "device",
        state_bytes=state, problems=problems, embed_host_bytes=embed_host, lm_head_bytes=lm_head,
        miss_prefetch=config.prefetch != "off")
    if pl.pcie_share and config.pcie_share is None:
        pl.pcie_share = prefetch_share(pl.pcie_share, pl.expected_coverage()["ram"], pl.top_k, pl.miss_prefetch)
    return pl


# The CPU's prefetch of guessed misses (doorbell.c prefetch_guess) and the PCIe share compete: both shorten the CPU's
# part of a layer, and the GPU's reads come from the RAM the CPU streams. Measured on the H200 box (48-layer
# Qwen3-30B-A3B Q4_0, docs/perf-log.md session 10): at 8 GiB (55% of routes from RAM) share 0 with the prefetch
# 109.5 tok/s, share 0.211 94.5; at --cpu-moe (100%) 0.211 75.1, share 0 61.1. Between the two points the share
# grows linearly from 0 at PREFETCH_SHARE_FROM to the full share at all routes from RAM (not measured in between).
PREFETCH_SHARE_FROM = 0.6


def prefetch_share(share: float, ram_coverage: float, k: int = 0, prefetch: bool = True) -> float:
    """The default PCIe share for the expected share of routes served from RAM. Beside the CPU's prefetch of guessed
    misses (`prefetch`) it grows from 0 at PREFETCH_SHARE_FROM to `share` at all routes from RAM; without it, it is
    `share`. Either way it is 0 where the GPU would read no expert of an average layer's misses (round(share x k x
    ram_coverage) == 0, k the routes a token takes a layer): a share turns the router's doorbell ring and wait_add's
    next norm off (memory.doorbell). Measured on the H200 box, one process each (docs/perf-log.md): with the prefetch
    at 8 GiB and an 8K context (61% of the routes from RAM) a share of 0.005 read nothing, 104.2 / 104.0 tok/s
    against 122.1 / 129.3 without it (session 31); with --prefetch off at 14 GiB (15% from RAM) a share of 0.228 read
    3.7 experts a token over 48 layers, 153.7 / 199.6 tok/s against 260.6 / 201.5 at 0 (round trip 44 against 25 us
    a layer; session 32)."""
    f = (ram_coverage - PREFETCH_SHARE_FROM) / (1.0 - PREFETCH_SHARE_FROM) if prefetch else 1.0
    s = round(share * min(1.0, max(0.0, f)), 3)
    return 0.0 if k and s * k * ram_coverage < 0.5 else s


def cache_bytes(model, ctx: int, dtype: torch.dtype, kv_dtype: str = "auto") -> tuple[int, int]:
    """(attention KV bytes, recurrent-state bytes) of the cache the engine allocates: session_cache at
    `ctx` on the meta device (no memory). --kv-offload moves the KV, not its size, so it is left out."""
    from ..runtime.kv_cache import KVCache, session_cache
    layers = [c for c in session_cache(model, ctx, dtype, "meta", kv_dtype).layers if c is not None]
    kv = sum(c.nbytes for c in layers if isinstance(c, KVCache))
    return kv, sum(c.nbytes for c in layers if not isinstance(c, KVCache))


def host_embedding(config, device: str) -> bool:
    """Whether the token embeddings stay in pinned RAM (models.host_embedding): on CUDA with memory tiers (the
    plan exists only then), unless --gpu-embed."""
    return str(device).startswith("cuda") and not getattr(config, "gpu_embed", False)


HOST_GROUP = "token embeddings (pinned RAM, rows gathered over PCIe)"


def pinned_bytes(n: int) -> int:
    """RAM a `pin_memory()` copy of n bytes takes: torch's caching host allocator rounds a block up to a power
    of two (Qwen3-30B-A3B's 622 MiB table pins 1 GiB), and pinned pages stay resident."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _groups(model, dtype, quant: dict[str, int] | None = None, host_embed: bool = False
            ) -> tuple[list[dict], int, int, int]:
    """Tensor groups of the non-expert params as loaded (compute dtype; `quant`: {name: bytes} of those kept in
    their GGUF blocks, models.quant_linear; host_embed: the token embeddings in RAM) -> (rows, dense,
    embeddings + lm_head on the device, embeddings in RAM)."""
    from ..weights.loader import EMBED
    quant = quant or {}
    dense_key = "dense (attention, norms, routers, dense MLPs)"
    embed_key = "lm_head" if host_embed else "embeddings + lm_head"
    rows = {dense_key: [0, 0], embed_key: [0, 0]}
    if host_embed:
        rows[HOST_GROUP] = [0, 0]
    for n, p in model.named_parameters():
        if EXPERT_PARAM.search(n):
            continue
        key = HOST_GROUP if host_embed and n == EMBED else \
            embed_key if ("embed" in n or n.startswith("lm_head")) else dense_key
        rows[key][0] += 1
        rows[key][1] += quant[n] if n in quant else p.numel() * (dtype.itemsize if p.is_floating_point()
                                                                  else p.element_size())
    out = [{"group": k, "tensors": v[0], "bytes": v[1]} for k, v in rows.items()]
    return out, rows[dense_key][1], rows[embed_key][1], rows.get(HOST_GROUP, [0, 0])[1]


def _fast_slots(tiers: list[str], n_fast: int, E: int, policy: str, profile: ExpertProfile | None):
    """-> (slots per layer, pinned experts per layer, experts to preload per layer)."""
    L = len(tiers)
    sizes = [E if t == "gpu" else 0 for t in tiers]
    pinned = [list(range(E)) if t == "gpu" else [] for t in tiers]
    preload = [list(range(E)) if t == "gpu" else [] for t in tiers]
    auto = [li for li, t in enumerate(tiers) if t == "auto"]
    n_fast = int(min(n_fast, len(auto) * E))
    if not auto or n_fast <= 0:
        return sizes, pinned, preload
    if profile is None:       # even split; free slots start filled (a policy evicts what is not used)
        for i, li in enumerate(auto):
            sizes[li] = min(E, n_fast // len(auto) + (1 if i < n_fast % len(auto) else 0))
            preload[li] = list(range(sizes[li]))
        return sizes, pinned, preload
    ranking = profile.ranking(auto)
    n_pin = int(n_fast * MIX_PIN_FRACTION) if policy == "mix" else n_fast
    for li, e in ranking[:n_pin]:
        sizes[li] += 1
        (pinned if policy in ("static", "mix") else preload)[li].append(e)
    if policy == "mix":       # the dynamic rest, spread evenly over the layers with room left
        rest = n_fast - n_pin
        while rest > 0:
            room = [li for li in auto if sizes[li] < E]
            if not room:
                break
            for li in room[:rest]:
                sizes[li] += 1
                rest -= 1
    for li in range(L):
        for e in pinned[li]:
            if e not in preload[li]:
                preload[li].append(e)
    if policy == "mix":       # dynamic slots start with the next hottest experts of their layer
        for li, e in ranking[n_pin:]:
            if len(preload[li]) < sizes[li]:
                preload[li].append(e)
    return sizes, pinned, preload


# ---------------------------------------------------------------- performance model
def prefill_copy_rule(layout: ExpertLayout, bw: dict, cpu_dtype: str = "bfloat16") -> dict:
    """When copying an expert over PCIe beats computing it on the CPU: the CPU needs
    max(bytes / cpu_gbs, n * flops / cpu_gflops) for n tokens; the copy bytes / pcie_gbs (the GPU's own
    compute is ~free at these sizes). -> {"tokens": n*, "copy_ms", "cpu_ms_per_token"}."""
    params = sum(int(torch.Size(p.logical_shape).numel()) for p in layout.params)
    flops = 2 * params
    raw = layout.raw_bytes
    copy_s = raw / (bw.get("pcie_gbs", 12.0) * 1e9)
    if layout.qtype:    # the C kernels read the blocks once per token: every token costs a GEMV
        gemv_s = raw / (bw.get(f"cpu_gbs_{layout.qtype}", bw.get("ram_gbs", 8.0) / 2) * 1e9)
        n = max(1, math.ceil(copy_s / gemv_s))
        return {"tokens": n, "copy_ms": copy_s * 1e3, "cpu_gemv_ms": gemv_s * 1e3, "cpu_ms_per_token": gemv_s * 1e3}
    gemv_s = raw / (bw.get(f"cpu_gbs_{cpu_dtype}", 8.0) * 1e9)
    per_tok = flops / (bw.get(f"cpu_gflops_{cpu_dtype}", 100.0) * 1e9)
    n = 1 if gemv_s >= copy_s else max(1, math.ceil(copy_s / per_tok))
    return {"tokens": n, "copy_ms": copy_s * 1e3, "cpu_gemv_ms": gemv_s * 1e3, "cpu_ms_per_token": per_tok * 1e3}


def pcie_rows(share: float, k: int, stage: int) -> int:
    """Device staging rows (and stage slots) of the PCIe share: what `share` can take of k misses, at most
    PCIE_MAX and the stage slots (the torch repack runs over every row, used or not). 0: no share."""
    return min(PCIE_MAX, stage, max(1, math.ceil(share * k - 1e-9))) if share > 0 and stage else 0


def pcie_share_default(bw: dict | None) -> float:
    """The PCIe share for this machine: 0.6 x PCIe / (PCIe + RAM read). PCIe / (PCIe + RAM) is where
    the GPU's reads and the CPU's would end together if they did not meet; they do: the GPU's reads
    come from the same RAM (on the H200 box a 16-thread CPU read fell 90 -> 80 GB/s beside a 44 GB/s
    gather), and the GPU side has fixed work per layer (gather, repack, hits). With the miss server
    at ~86 GB/s (session 6) the measured --cpu-moe decode was best at 0.125-0.25 and worse at 0.355
    (docs/perf-log.md); the H200 box (PCIe 52-55 GB/s, RAM 86-90) gets 0.22-0.23 (2 of 8 misses), a
    PCIe 4.0 desktop (25 / 60) 0.18, PCIe 3.0 (12 / 40) 0.14. Without both figures: PCIE_SHARE."""
    pcie, ram = (bw or {}).get("pcie_gbs"), (bw or {}).get("ram_gbs")
    if not pcie or not ram:
        return PCIE_SHARE
    return round(min(0.6, max(0.05, 0.6 * pcie / (pcie + ram))), 3)


def decode_ceiling(pl: Placement, bw: dict) -> dict:
    """Bytes each tier must read per decode token and the time that takes at its bandwidth.
    Overlapped bound = max over the tiers that work in parallel (DESIGN.md); serial = their sum."""
    cov = pl.expected_coverage()
    routes = pl.top_k * pl.num_layers
    cuda = pl.fast_device == "cuda"
    cpu_dt = pl.layout.qtype or str(pl.storage_dtype if cuda else pl.dtype).removeprefix("torch.")  # block formats: C kernels
    # dense weights are read once per token; the KV cache at the full context; embeddings: one row
    fast_bytes = pl.dense_bytes + pl.lm_head_bytes + pl.kv_bytes + pl.state_bytes + routes * cov["gpu"] * pl.expert_fast_bytes
    cpu_bytes = routes * (cov["ram"] + cov["ssd"]) * pl.layout.raw_bytes
    ssd_bytes = routes * cov["ssd"] * pl.layout.raw_bytes
    fast_bw = bw["hbm_gbs"] if cuda else bw["ram_gbs"]
    cpu_rate = min(bw["ram_gbs"], bw.get(f"cpu_gbs_{cpu_dt}", bw["ram_gbs"]))
    # with the PCIe share the GPU reads part of the RAM misses over PCIe while the CPU reads the rest: the
    # two rates add (H200 box: CPU 80 GB/s + a PCIe gather 44 GB/s at once, bench/bench_pcie_read.py)
    pcie = bw.get("pcie_gbs", 0.0) if cuda and pl.pcie_share else 0.0
    t = {"gpu": fast_bytes / (fast_bw * 1e9), "ram": cpu_bytes / ((bw["ram_gbs"] + pcie) * 1e9),
         "ram_torch": cpu_bytes / ((cpu_rate + pcie) * 1e9), "ssd": ssd_bytes / (bw["ssd_gbs"] * 1e9)}
    if cuda:
        bound, achievable = max(t["gpu"], t["ram"], t["ssd"]), max(t["gpu"], t["ram_torch"], t["ssd"])
    else:   # one memory bus: the "fast tier", the bank and the dense weights share RAM bandwidth
        bound = max(t["gpu"] + t["ram"], t["ssd"])
        achievable = max(t["gpu"] + t["ram_torch"], t["ssd"])
    return {"bytes": {"gpu": fast_bytes, "ram": cpu_bytes, "ssd": ssd_bytes},
            "ms": {k: v * 1e3 for k, v in t.items()}, "coverage": cov,
            "bound_ms": bound * 1e3, "bound_tok_s": 1 / bound if bound else float("inf"),
            "torch_cpu_ms": achievable * 1e3, "torch_cpu_tok_s": 1 / achievable if achievable else float("inf"),
            "serial_ms": sum(v for k, v in t.items() if k != "ram_torch") * 1e3, "cpu_dtype": cpu_dt}
