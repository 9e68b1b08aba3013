"""Flags shared by the commands that load a model, and their translation to EngineConfig."""
from __future__ import annotations

import argparse

from ..config import EngineConfig, parse_size
from ..memory.flags import add_memory_args, memory_fields
from ..errors import UserError
from ..runtime.sampling import SamplingParams


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory (config.json + *.safetensors), or a Hugging Face repo id; "
                        "default: the embedded default model")
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 "
                                                  "(default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--ctx", type=positive_int, default=None, metavar="N",
                   help="context length in tokens (KV cache size); default min(model max, 4096)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: half the CPUs, at least 1)")
    g.add_argument("--no-cuda-graph", dest="cuda_graphs", action="store_false",
                   help="decode (and prefill prompts of up to 2048 tokens) eagerly instead of replaying CUDA "
                        "graphs (debugging)")
    g.add_argument("--no-fused-decode", dest="fused_decode", action="store_false",
                   help="CUDA decode without the fused Triton RMSNorm / router / attention kernels (debugging)")
    g.add_argument("--cpu-compile", default="auto", choices=("auto", "on", "off"),
                   help="CPU decode step compiled ahead of time (AOTInductor, cached in ~/.cache/moetier/"
                        "cpu_decode): on = build it now if needed (15-25 s) and use it; auto (default) = use it "
                        "when cached, else decode eagerly and build it in the background for later requests "
                        "and runs (MOETIER_NO_BACKGROUND_BUILD=1: never); off = eager. ~1.7x faster decode "
                        "on the default model")
    g.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32", "int8"),
                   help="KV cache storage; int8 (+ an fp16 scale per 32 values) takes ~53%% of bf16; bf16 on a "
                        "CPU with bf16 hardware (AMX, AVX512-BF16) also runs attention in bf16 (faster long prompts) "
                        "(default: auto, the model dtype)")
    g.add_argument("--kv-offload", action="store_true",
                   help="keep the KV cache in pinned host memory and copy it to the GPU each step, "
                        "for very long contexts (slower; no-op on CPU)")
    g.add_argument("--snapshot-every", type=positive_int, default=0, metavar="N",
                   help="models with recurrent layers (Qwen3-Next): also snapshot their state every N "
                        "prompt tokens, so an edited long prompt resumes near the edit (default 0: off)")
    g.add_argument("--prompt-cache", default=None, metavar="DIR",
                   help="also write cache snapshots to DIR; a new session or process resumes from the "
                        "longest saved prefix of its prompt")
    g.add_argument("--prompt-cache-mem", default="2GiB", metavar="SIZE",
                   help="disk budget of --prompt-cache; the least recently used files go first (default 2GiB)")
    g.add_argument("--dequantize-experts", action="store_true",
                   help="GGUF: dequantize the expert tensors at load (to --dtype) instead of computing on "
                        "their stored blocks (more memory; on CUDA faster for the IQ2/IQ3_S/IQ1 formats where "
                        "the experts then fit)")
    g.add_argument("--dequantize-dense", action="store_true",
                   help="GGUF on CUDA: dequantize the attention, lm_head and dense MLP weights at load (to --dtype) "
                        "instead of computing on their stored Q8_0/Q4_0/Q4_K/Q6_K blocks (the old behaviour; more VRAM)")
    g.add_argument("--gpu-embed", action="store_true",
                   help="CUDA with memory budgets: keep the token embedding table in VRAM (default: in pinned RAM, "
                        "one row read over PCIe per token, as llama.cpp does; the VRAM goes to the expert cache)")
    g.add_argument("--gpu-mem", default=None, metavar="SIZE", help="GPU memory budget, e.g. 8GiB, or auto")
    g.add_argument("--ram-mem", default=None, metavar="SIZE", help="RAM budget for the expert bank, or auto")
    g.add_argument("--gpu-reserve", default=None, metavar="SIZE", help="VRAM left free when --gpu-mem is auto")
    add_memory_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else llama.cpp's)")
    g.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temperature", "--temp", type=float, default=None, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 0.95)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p * p_max (default 0.05)")
    g.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(device=args.device, dtype=args.dtype, max_context=args.ctx, threads=args.threads,
                        cuda_graphs=getattr(args, "cuda_graphs", True),
                        fused_decode=getattr(args, "fused_decode", True),
                        cpu_compile=getattr(args, "cpu_compile", "auto"),
                        kv_dtype=getattr(args, "kv_dtype", "auto"), kv_offload=getattr(args, "kv_offload", False),
                        snapshot_every=getattr(args, "snapshot_every", 0),
                        prompt_cache=getattr(args, "prompt_cache", None),
                        prompt_cache_mem=parse_size(getattr(args, "prompt_cache_mem", "2GiB")) or 2 << 30,
                        dequantize_experts=getattr(args, "dequantize_experts", False),
                        dequantize_dense=getattr(args, "dequantize_dense", False),
                        gpu_embed=getattr(args, "gpu_embed", False),
                        gpu_mem=parse_size(args.gpu_mem), ram_mem=parse_size(args.ram_mem),
                        gpu_reserve=parse_size(args.gpu_reserve), seed=getattr(args, "seed", None),
                        **memory_fields(args))


LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


def sampling_params(args, engine) -> SamplingParams:
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0 (got {args.max_tokens})")
    values = {**LLAMA_DEFAULTS, **engine.sampling_defaults()}
    for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if getattr(args, k) is not None:
            values[k] = getattr(args, k)
    return SamplingParams(**values, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed).check()


def load_engine(args):
    from ..runtime.engine import Engine
    return Engine.load(args.model, engine_config(args))
