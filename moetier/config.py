"""Model and engine configuration.

`ModelArgs` is the one normalised view of a checkpoint's config (HF `config.json` or GGUF
metadata): every architecture reads the fields it needs from it. `EngineConfig` holds every
engine knob (device, dtype, budgets, policies); it is frozen and built once by the CLI or API.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

# HF config key aliases -> our field name (first match wins).
_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "experts_per_token", "num_experts_per_token"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "num_shared_experts": ("n_shared_experts", "num_shared_experts"),
}


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    # RoPE: {"rope_type", "rope_theta", "factor", ...} as transformers 5 normalises it
    rope_parameters: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    num_shared_experts: int = 0
    # token ids
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # everything else the architecture may need (DeepSeek's MLA ranks, GPT-OSS's layer types ...)
    extra: dict = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """Normalise a Hugging Face `config.json` dict."""
        cfg = dict(cfg)
        if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        for name, keys in _ALIASES.items():
            for k in keys:
                if cfg.get(k) is not None:
                    cfg[name] = cfg[k]
                    break
        required = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise UserError(f"config.json lacks {', '.join(missing)}: is this a causal language model config?")
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        if not cfg.get("head_dim"):
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg["rope_parameters"] = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        cfg["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in cfg.items() if k in names and v is not None}
        return cls(**known, extra=cfg)

    @classmethod
    def from_gguf(cls, metadata: dict, shapes: dict | None = None) -> "ModelArgs":
        """Normalise GGUF metadata (`general.architecture`, `{arch}.block_count`, ...); `shapes`
        (tensor name -> torch shape) tells what only the tensors say (tied output, dense layers)."""
        from .weights.gguf_arch import hf_config
        return cls.from_hf(hf_config(metadata, shapes))

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 keeps RoPE in `rope_parameters`; older configs use rope_theta + rope_scaling."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_type", rp.pop("type", None) or "default")
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg and "partial_rotary_factor" not in rp:
        rp["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if rp["rope_type"] in ("yarn", "llama3", "longrope"):
        rp.setdefault("original_max_position_embeddings",
                      cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)))
    return rp


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_size(text: str | int | None) -> int | None:
    """'8GiB' -> 8589934592, '512MB' -> 512e6, 'auto'/None -> None, plain numbers are bytes."""
    if text is None or isinstance(text, int):
        return text
    if str(text).strip().lower() == "auto":
        return None
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"cannot read size {text!r}: write it like 8GiB, 512MiB, 24GB or auto")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = " kmgt".index(unit) if unit else 0
    return int(num * (1024 if binary or not unit else 1000) ** power)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, built once. Budgets are in bytes; None means auto."""
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    dtype: str = "auto"             # auto | float32 | bfloat16 | float16
    max_context: int | None = None  # tokens of KV cache; default min(model max, 8192)
    gpu_mem: int | None = None
    ram_mem: int | None = None
    gpu_reserve: int | None = None
    threads: int | None = None
    seed: int | None = None
    progress: bool = True
    cuda_graphs: bool = True        # decode step (and short fresh prefills) as CUDA graphs (off: eager, for debugging)
    fused_decode: bool = True       # CUDA decode step: fused Triton norm / router / attention (kernels/small_ops.py)
    cpu_compile: str = "auto"       # CPU decode step built by AOTInductor: on (build once, cached) | off |
                                    # auto (use the cached build, else build it in a background process
                                    # for the next run/request; MOETIER_NO_BACKGROUND_BUILD=1 stops that)
    kv_dtype: str = "auto"          # KV cache storage: auto (the model dtype) | bf16 | fp16 | fp32 | int8
    kv_offload: bool = False        # KV in (pinned) host memory, copied to the GPU each step (no-op on CPU)
    snapshot_every: int = 0         # recurrent models: also snapshot their state every N prompt tokens (0: off)
    prompt_cache: str | None = None  # directory of cache snapshots shared across sessions and processes
    prompt_cache_mem: int = 2 << 30  # byte budget of that directory (least recently used files go first)
    dequantize_experts: bool = False  # GGUF: dequantize expert tensors at load (default: computed on their
                                      # stored Q8_0/Q4_0/Q4_K blocks where a kernel exists)
    dequantize_dense: bool = False  # GGUF on CUDA: dequantize attention / lm_head / dense MLP weights at load
                                    # (default: Q8_0/Q4_0/Q4_K/Q6_K ones stay in their blocks, models.quant_linear)
    gpu_embed: bool = False         # CUDA with memory tiers: keep the token embeddings on the GPU (default: pinned RAM)
    # memory tiers (moetier/memory); any of these turns them on
    tiers: bool = False             # set when a budget flag was given, even "auto"
    cpu_moe: bool = False           # every layer's experts stay off the fast tier (llama.cpp --cpu-moe)
    n_cpu_moe: int = 0              # ... the experts of layers 0..N-1 (llama.cpp --n-cpu-moe)
    override_tensor: tuple = ()     # ((regex, "gpu"|"cpu"|"disk"), ...): the first matching rule wins
    cache_policy: str | None = None  # lru | lfu | static | mix; None: lru, or mix with an expert profile
    expert_profile: str | None = None  # profile JSON: pin/preload the hottest experts
    save_profile: str | None = None  # write the expert counts seen while running to this file at exit
    prefetch: str = "auto"          # on | off | auto (on only where measured to help)
    cpu_threads: int | None = None  # threads for CPU expert work (torch intra-op threads)
    direct_io: bool = False         # O_DIRECT reads of streamed experts (bypass the page cache)
    pcie_share: float | None = None  # CUDA graphed decode: share of each layer's misses the GPU reads from
                                     # pinned RAM over PCIe instead of the CPU computing them (None: the
                                     # default from the measured bandwidths, memory.plan.pcie_share_default;
                                     # 0: off)
    prefill_copy_tokens: int | None = None  # copy a missed expert to the fast tier in prefill from this
                                            # many tokens per chunk on (None: the measured rule; 0: never)

    def resolved_device(self) -> str:
        import torch
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
        if self.device not in ("cpu",) and not self.device.startswith("cuda"):
            raise UserError(f"unknown device {self.device!r}: use auto, cpu, cuda or cuda:N")
        return self.device

    def resolved_dtype(self, device: str):
        import torch
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        if self.dtype not in names:
            raise UserError(f"unknown dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        return names[self.dtype]

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
