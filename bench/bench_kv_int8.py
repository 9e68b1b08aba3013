"""KV cache storage formats: accuracy vs an fp32 KV on the embedded default model, bytes per token,
and the decode cost of the dequantize-everything path; prints one JSON object.

Accuracy: teacher forcing over `--positions` tokens of English prose (Python module docstrings),
fed in chunks of 128 so later chunks read the earlier ones from the cache; per position
KL(fp32 || format) of the next-token distribution and top-1 agreement.

    python bench/bench_kv_int8.py [--positions 1024] [--decode 32] [--ctx 32768]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import textwrap
import time

import torch

from moetier import EngineConfig
from moetier.config import ModelArgs
from moetier.models import model_class
from moetier.runtime.engine import Engine
from moetier.runtime.kv_cache import session_cache

FORMATS = ["fp32", "bf16", "fp16", "int8"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Qwen3-30B-A3B's attention: 48 layers, 4 KV heads of 128
QWEN3_30B = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 2,
             "num_experts_per_tok": 1, "moe_intermediate_size": 8, "intermediate_size": 8}


def docs_ids(engine, n: int) -> torch.Tensor:
    text = "\n\n".join(m.__doc__ for m in (argparse, json, textwrap, collections, functools))
    ids = engine.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens; ask for --positions <= {len(ids)}")
    return torch.tensor(ids[:n])


def logits(model, ids, cache, chunk=128) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(ids[i:i + chunk], cache) for i in range(0, len(ids), chunk)]).float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl_median": kl.median().item(), "kl_mean": kl.mean().item(),
            "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def decode_ms(model, ids, kv: str, steps: int) -> float:
    """Median ms per decoded token after a len(ids) prefill (CPU, eager)."""
    cache = session_cache(model, len(ids) + steps + 1, torch.float32, "cpu", kv)
    times = []
    with torch.inference_mode():
        tok = model(ids, cache, last_only=True)[-1].argmax()[None]
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = model(tok, cache, last_only=True)[-1].argmax()[None]
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def bytes_per_token(model, dtype, ctx: int) -> dict:
    return {kv: session_cache(model, ctx, dtype, "meta", kv).nbytes / ctx for kv in FORMATS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed per format")
    ap.add_argument("--ctx", type=int, default=32768, help="context for the memory figures")
    a = ap.parse_args()
    engine = Engine.load(None, EngineConfig(device="cpu", progress=False))
    model, ids = engine.model, docs_ids(engine, a.positions)
    ref = logits(model, ids, session_cache(model, len(ids), torch.float32, "cpu", "fp32"))
    accuracy = {kv: compare(ref, logits(model, ids, session_cache(model, len(ids), torch.float32, "cpu", kv)))
                for kv in FORMATS[1:]}
    # control: the same positions seeing only their last 64 tokens (how much the context matters)
    tail = range(len(ids) - 64, len(ids))
    short = torch.cat([model(ids[i - 63:i + 1], model.make_cache(64, torch.float32, "cpu"))[-1:]
                       for i in tail]).float()
    with torch.device("meta"):
        big = model_class("qwen3_moe")(ModelArgs(**QWEN3_30B))
    big_bpt = bytes_per_token(big, torch.bfloat16, a.ctx)
    report = {
        "model": "moetier-default", "positions": len(ids), "reference": "fp32 KV",
        "accuracy": accuracy,
        "control_window64_last64": compare(ref[tail.start:], short),
        "bytes_per_token": {"moetier-default": bytes_per_token(model, torch.float32, a.ctx),
                            "qwen3-30b-a3b_attention": big_bpt},
        "int8_over_bf16": big_bpt["int8"] / big_bpt["bf16"],
        "qwen3-30b-a3b_kv_gib_at_ctx": {kv: b * a.ctx / 2**30 for kv, b in big_bpt.items()},
        "ctx": a.ctx,
        "decode_ms_per_token_cpu": {kv: decode_ms(model, ids, kv, a.decode) for kv in ("fp32", "int8")},
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
