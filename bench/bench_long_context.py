"""Long-context benchmark of one checkpoint (typically `moetier synth qwen3-next-80b-a3b --layers N`):
prefill tok/s at each prompt length, decode tok/s after the longest prompt, TTFT of a follow-up
prompt cold vs resumed from the session's snapshot, peak memory, and the KV + recurrent-state bytes
`plan` predicts vs what the session allocated. JSON on stdout, progress on stderr.

    python bench/bench_long_context.py /data/qnext-8l --prompt-len 4096,32768,131072 --gen 64 --chunk 4096

Prompts are the synthetic checkpoint's topic-local token streams (uniform ids for a real one), distinct
per length. Follow-ups: `resumed` = the longest prompt + --tail new tokens on the same session (its
cache holds the prompt and the generated tokens; a recurrent cache cannot cut those back, so it restores
the turn-boundary snapshot); `edited` = the first 3/4 of the prompt + --tail tokens (resumes from a
--snapshot-every snapshot when there is one, else from 0); `cold` = the resumed prompt on a new session.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import sys
import time

import torch

from moetier import EngineConfig, SamplingParams
from moetier.memory.plan import cache_bytes
from moetier.runtime.engine import Engine
from moetier.runtime.generate import Done, TokenEvent
from moetier.runtime.kv_cache import KVCache
from moetier.tools.synth import stream_for

GREEDY = SamplingParams(temperature=0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(engine) -> None:
    if engine.device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(engine) -> None:
    if engine.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak(engine) -> dict:
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if engine.device.startswith("cuda"):
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
    return out


def run(engine, prompt: list[int], session, gen: int) -> dict:
    """One request; decode tok/s from token timestamps after the 2nd token (a CUDA-graph capture and
    the first step's warm-up are left out)."""
    sync(engine)
    t0 = time.perf_counter()
    stamps, done = [], None
    for ev in engine.generate(prompt_ids=prompt, max_tokens=gen, params=GREEDY, session=session, ignore_eos=True):
        if isinstance(ev, TokenEvent) and ev.token_id >= 0:
            stamps.append(time.perf_counter())
        elif isinstance(ev, Done):
            done = ev
    sync(engine)
    s = done.stats
    r = {"prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"], "ttft_s": s["ttft_s"],
         "prefill_tok_s": s["prefill_tok_s"], "wall_s": round(time.perf_counter() - t0, 4)}
    if len(stamps) > 3:
        r["decode_tok_s"] = round((len(stamps) - 2) / (stamps[-1] - stamps[1]), 3)
        r["decode_tok_s_engine"] = s["decode_tok_s"]
        r["generated_tokens"] = len(stamps)
    return r


def cache_report(engine, session, ctx: int) -> dict:
    kv_plan, state_plan = cache_bytes(engine.model, ctx, engine.dtype, engine.config.kv_dtype)
    layers = [c for c in session.cache.layers if c is not None]
    kv = sum(c.nbytes for c in layers if isinstance(c, KVCache))
    return {"ctx": ctx, "kv_plan_bytes": kv_plan, "state_plan_bytes": state_plan, "kv_alloc_bytes": kv,
            "state_alloc_bytes": sum(c.nbytes for c in layers if not isinstance(c, KVCache)),
            "session_bytes_with_snapshots": session.nbytes,
            "snapshots": len(session.snapshots), "periodic_snapshots": len(session.periodic)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--prompt-len", default="4096,32768,131072", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--gen", type=int, default=64, help="tokens decoded after the longest prompt")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per forward)")
    p.add_argument("--kv-dtype", default="auto", help="auto | bf16 | fp16 | fp32 | int8")
    p.add_argument("--snapshot-every", type=int, default=0, help="periodic recurrent snapshots (tokens; 0: off)")
    p.add_argument("--tail", type=int, default=64, help="new tokens of the follow-up prompts")
    p.add_argument("--warmup", type=int, default=None, help="prompt tokens of an untimed warm-up run (0: none; "
                   "default: the shortest --prompt-len, at most 4096, so its timing has no first-call compiles)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-cuda-graph", action="store_true")
    a = p.parse_args()
    lens = sorted(int(x) for x in a.prompt_len.split(",") if x)
    if a.warmup is None:
        a.warmup = min(lens[0], 4096)
    ctx = lens[-1] + a.gen + a.tail + 8
    cfg = EngineConfig(device=a.device, dtype=a.dtype, max_context=ctx, kv_dtype=a.kv_dtype, threads=a.threads,
                       snapshot_every=a.snapshot_every, cuda_graphs=not a.no_cuda_graph, progress=False)
    t0 = time.perf_counter()
    engine = Engine.load(a.model, cfg)
    engine.prefill_chunk = a.chunk
    from moetier.kernels import deltanet_ops
    log(f"loaded {a.model} on {engine.device} ({engine.dtype}) in {time.perf_counter() - t0:.1f} s; "
        f"context {ctx}, chunk {a.chunk}, DeltaNet kernels: {deltanet_ops.backend()}")
    vocab = engine.args.vocab_size
    report = {"model": str(a.model), "device": engine.device, "dtype": str(engine.dtype).removeprefix("torch."),
              "gpu": torch.cuda.get_device_name() if engine.device.startswith("cuda") else None,
              "host": platform.node(), "args": vars(a), "layers": engine.args.num_hidden_layers,
              "deltanet_backend": deltanet_ops.backend(), "prefill": []}
    if a.warmup:   # untimed: the prompt, then a follow-up of --tail tokens (the resumed path's shapes compile here)
        warm = stream_for(a.model, vocab, a.warmup, seed=999)
        ws = engine.new_session(a.warmup + a.tail + 16)
        run(engine, warm, ws, 4)
        run(engine, warm + stream_for(a.model, vocab, a.tail, seed=998), ws, 1)
    session = None
    for i, n in enumerate(lens):
        last = i == len(lens) - 1
        session = None
        gc.collect()
        if engine.device.startswith("cuda"):
            torch.cuda.empty_cache()
        reset_peak(engine)
        session = engine.new_session()
        prompt = stream_for(a.model, vocab, n, seed=n)
        log(f"prefill {n} tokens" + (f", then decode {a.gen}" if last else ""))
        r = run(engine, prompt, session, a.gen if last else 1)
        r.update(peak(engine))
        log(f"  prefill {r['prefill_tok_s']:.1f} tok/s, ttft {r['ttft_s']:.3f} s"
            + (f", decode {r.get('decode_tok_s', 0):.2f} tok/s" if last else ""))
        report["prefill"].append(r)
        if last:
            report["decode"] = {k: r[k] for k in ("decode_tok_s", "decode_tok_s_engine", "generated_tokens") if k in r}
            report["decode"]["after_prompt_tokens"] = n
            report["cache"] = cache_report(engine, session, ctx)
    # follow-ups on the longest prompt's session, then the same prompt cold
    tail = stream_for(a.model, vocab, a.tail, seed=7)
    resumed_prompt = prompt + tail
    ttft = {}
    log(f"follow-up: {len(resumed_prompt)} tokens on the same session")
    ttft["resumed"] = run(engine, resumed_prompt, session, 1)
    edited = prompt[: 3 * len(prompt) // 4] + tail
    log(f"edit: {len(edited)} tokens (3/4 of the prompt + tail) on the same session")
    ttft["edited"] = run(engine, edited, session, 1)
    session = None
    gc.collect()
    log(f"cold: {len(resumed_prompt)} tokens on a new session")
    ttft["cold"] = run(engine, resumed_prompt, engine.new_session(), 1)
    ttft["speedup_resumed_vs_cold"] = round(ttft["cold"]["ttft_s"] / max(1e-9, ttft["resumed"]["ttft_s"]), 2)
    report["ttft"] = ttft
    report.update(peak(engine))
    log(f"ttft cold {ttft['cold']['ttft_s']:.3f} s, resumed {ttft['resumed']['ttft_s']:.3f} s "
        f"(cached {ttft['resumed']['cached_tokens']}), edited {ttft['edited']['ttft_s']:.3f} s "
        f"(cached {ttft['edited']['cached_tokens']})")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
