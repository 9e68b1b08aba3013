"""Dense baseline: a Qwen3-30B-A3B-shaped model with random bf16 weights, everything on one GPU.

Weights are generated on the device (no checkpoint on disk), zero-mean and scaled 1/sqrt(fan_in)
so activations stay finite and routing stays spread. Prints one JSON object: prefill tok/s for
each prompt length, decode tok/s, the routing spread, and the HBM byte bound for decode.

    python bench/bench_dense_gpu.py [--layers 48] [--prompt-len 512] [--gen 64]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from moetier.config import ModelArgs
from moetier.models import model_class
from moetier.runtime.generate import prefill

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False)


def random_model(cfg: dict, device: str, dtype, seed: int = 0):
    args = ModelArgs.from_hf(cfg)
    with torch.device("meta"):
        model = model_class(args.model_type)(args)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        fan_in = p.shape[-1]
        if "norm" in name:
            t = torch.ones(p.shape, device=device, dtype=dtype)
        else:
            t = torch.randn(p.shape, device=device, dtype=torch.float32, generator=g).mul_(1 / math.sqrt(fan_in)).to(dtype)
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(t, requires_grad=False))
    for mod in model.modules():
        for b, buf in list(mod._buffers.items()):
            mod._buffers[b] = buf.to(device)
    return model.eval(), args


def read_bandwidth(dev: str) -> float:
    """Bytes/s of a streaming read (a sum over 4 GiB, median of 10)."""
    x = torch.randn(2**30, device=dev, dtype=torch.float32)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x.sum()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del x
    return 4 * 2**30 / sorted(times[2:])[5]


def decode_rate(model, dtype, dev, gen: int, graph: bool) -> float:
    from moetier.runtime.cuda_graph import DecodeGraph
    cache = model.make_cache(16 + gen + 1, dtype, dev)
    logits = prefill(model, cache, list(range(16)), dev, 8192)
    g = DecodeGraph(model, cache) if graph else None
    buf = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.inference_mode():
        tok = int(torch.argmax(logits))
        for step in range(gen):
            if step == 8:
                torch.cuda.synchronize()
                t = time.perf_counter()
            buf.fill_(tok)
            logits = g.step(buf)[-1] if graph else model(buf, cache, last_only=True)[-1]
            tok = int(torch.argmax(logits))
        torch.cuda.synchronize()
    return (gen - 8) / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompt-len", default="512")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--hbm-bw", type=float, default=None, help="HBM read bandwidth, bytes/s (default: measured)")
    a = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=a.layers)
    t0 = time.perf_counter()
    model, args = random_model(cfg, dev, dtype)
    load_s = time.perf_counter() - t0
    if a.hbm_bw is None:
        a.hbm_bw = read_bandwidth(dev)
    out = {"model": "qwen3-30b-a3b-shaped (random bf16)", "hbm_read_bw": round(a.hbm_bw / 1e9, 1), "layers": a.layers, "build_s": round(load_s, 1),
           "gpu": torch.cuda.get_device_name(), "prefill": {}}
    seen = torch.zeros(args.num_hidden_layers, args.num_experts, device=dev)
    hooks = []
    for i, blk in enumerate(model.model.layers):
        def hook(mod, inp, outp, i=i):
            seen[i].index_add_(0, inp[1].flatten(), torch.ones(inp[1].numel(), device=dev))
        hooks.append(blk.mlp.experts.register_forward_hook(hook))
    for n in [int(x) for x in a.prompt_len.split(",")]:
        toks = torch.randint(0, args.vocab_size, (n,)).tolist()
        for rep in range(3):  # first is warm-up
            cache = model.make_cache(n + a.gen + 1, dtype, dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = prefill(model, cache, toks, dev, 8192)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
        out["prefill"][str(n)] = round(n / dt, 1)
        if n == int(a.prompt_len.split(",")[0]):
            for h in hooks:
                h.remove()
            share = seen.sum(0) / seen.sum()
            out["routing"] = {"experts_used_layer0": int((seen[0] > 0).sum()), "top8_share_layer0":
                              round(float(seen[0].topk(8).values.sum() / seen[0].sum()), 3),
                              "max_expert_share": round(float(share.max()), 4)}
    # decode: greedy, one token at a time, eager and as one CUDA graph per step
    from moetier.runtime.cuda_graph import DecodeGraph
    out["decode_tok_s_eager"] = round(decode_rate(model, dtype, dev, a.gen, graph=False), 1)
    dec = decode_rate(model, dtype, dev, a.gen, graph=True)
    d, l = args.hidden_size, args.num_hidden_layers
    attn = d * args.head_dim * (args.num_attention_heads * 2 + args.num_key_value_heads * 2)
    active = l * (attn + args.num_experts * d + args.num_experts_per_tok * 3 * d * args.moe_intermediate_size)
    bytes_tok = (active + d * args.vocab_size + d) * 2
    out.update(decode_tok_s=round(dec, 1), bytes_per_token=bytes_tok, hbm_bound_tok_s=round(a.hbm_bw / bytes_tok, 1),
               fraction_of_bound=round(dec / (a.hbm_bw / bytes_tok), 3),
               peak_vram_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
