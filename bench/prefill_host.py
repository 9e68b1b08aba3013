"""Is a short prefill host-bound? (all on the GPU: llama.cpp's pp512 7,991 tok/s on the 30B-A3B Q4_0 shape)

Loads MODEL with the usual flags, then for a random prompt of --prompt-len tokens (one chunk, a fresh cache each
time) times: the host's enqueue of the forward (until it returns, no sync) and the whole forward (synced), eager;
the same forward captured once in a CUDA graph and replayed (no host work: the GPU's own time), if it captures; and
the MoE of one layer alone at this T (the dequantize-all + torch._grouped_mm path against the Triton grouped kernels
on the planes). Prints JSON.

    python bench/prefill_host.py MODEL.gguf [--prompt-len 512] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier.commands.common import add_model_args, engine_config  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    a.ctx = a.ctx or a.prompt_len + 64
    e = Engine.load(a.model, engine_config(a))
    m = e.model
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, e.args.vocab_size, (a.prompt_len,), generator=g).to(e.device)
    cache = m.make_cache(a.prompt_len + 64, e.dtype, e.device)
    out: dict = {"model": Path(a.model).name, "prompt_len": a.prompt_len}
    cuda = str(e.device).startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def fwd():
        cache.truncate(0)
        return m(toks, cache, last_only=True)

    with torch.inference_mode():
        fwd()
        sync()
        enq, tot = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fwd()
            t1 = time.perf_counter()
            sync()
            enq.append((t1 - t0) * 1e3)
            tot.append((time.perf_counter() - t0) * 1e3)
        out["eager_enqueue_ms"] = [round(x, 2) for x in enq]
        out["eager_total_ms"] = [round(x, 2) for x in tot]
        out["eager_tok_s"] = round(a.prompt_len / (min(tot) / 1e3), 1)
        if not cuda:
            print(json.dumps(out, indent=1), flush=True)
            return
        try:
            cache.truncate(0)
            gr = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fwd()                               # warm-up on the side stream, as capture wants
            torch.cuda.current_stream().wait_stream(s)
            cache.truncate(0)
            with torch.cuda.graph(gr):
                m(toks, cache, last_only=True)
            reps = []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gr.replay()
                torch.cuda.synchronize()
                reps.append((time.perf_counter() - t0) * 1e3)
            out["graph_ms"] = [round(x, 2) for x in reps]
            out["graph_tok_s"] = round(a.prompt_len / (min(reps) / 1e3), 1)
            del gr
        except Exception as ex:  # noqa: BLE001 (report what broke the capture)
            out["graph_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        out["moe_layer"] = moe_layer(m, a.prompt_len, e.dtype, e.device)
    print(json.dumps(out, indent=1), flush=True)


def moe_layer(m, t: int, dtype, device) -> dict:
    """One layer's experts at T tokens: the engine's prefill path against the Triton grouped kernels (ms, graph
    replays of 10 calls)."""
    from moetier.kernels import ops
    from moetier.models.quant_experts import QuantExperts
    ex = next((mod for mod in m.modules() if isinstance(mod, QuantExperts) and mod.layout == "planes"), None)
    if ex is None:
        return {"error": "no QuantExperts with planes"}
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(t, ex.dim, device=device, dtype=dtype, generator=gen)
    k = 8
    ids = torch.stack([torch.randperm(ex.num_experts, device=device, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, device=device, generator=gen).to(dtype)
    res = {}

    def triton():
        return ops.moe(x, ids, w, ex.planes("gate_up"), ex.planes("down"), ex.act, None, fmt=ex.fmt,
                       down_fmt=ex.down_fmt)
    for name, fn in (("dequant_grouped_mm", lambda: ex._forward_dequant_grouped(x, ids, w)), ("triton", triton)):
        try:
            ref = fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            res[name + "_ms"] = round((time.perf_counter() - t0) * 100, 3)
            res[name + "_sum"] = float(ref.float().abs().sum())
        except Exception as exc:  # noqa: BLE001
            res[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return res


if __name__ == "__main__":
    main()
