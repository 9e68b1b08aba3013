"""What is live on the GPU at the peak of a bench-like run (issue #3: the budget is a hard limit).

Loads MODEL with the usual engine and memory flags under torch's allocator history, runs a prompt
and a decode as `moetier bench` does (the first decode captures the CUDA graph), then replays the
allocator's trace to find the moment of the peak and prints JSON: the budget, the plan's own
accounting (dense, KV, workspace, expert cache), the peak per phase (load / prefill / decode), and
the blocks live at the peak grouped by the innermost moetier frame that allocated them.

    python bench/vram_peak.py MODEL.gguf --gpu-mem 8GiB [--prompt-len 512] [--gen 40]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier.commands.common import add_model_args, engine_config  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402
from moetier.tools.bench_core import run_prompt  # noqa: E402
from moetier.tools.synth import stream_for  # noqa: E402
from moetier.tools.vram import live_at_peak, record  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=40)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    a.ctx = a.ctx or a.prompt_len + a.gen + 8
    record()
    phases = {}
    e = Engine.load(a.model, engine_config(a))
    phases["load"] = torch.cuda.max_memory_allocated()
    ids = stream_for(Path(a.model), e.args.vocab_size, a.prompt_len + a.gen, seed=1)
    torch.cuda.reset_peak_memory_stats()
    run_prompt(e, ids[:32], 8, ids[32:40])           # warm-up, as bench does (captures the graph)
    phases["warmup"] = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = run_prompt(e, ids[:a.prompt_len], a.gen, ids[a.prompt_len:])
    phases["prompt_and_decode"] = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, by_site = live_at_peak(snap)
    pl = e.tiers.pl if getattr(e, "tiers", None) is not None else None
    out = {"budget": getattr(e.config, "gpu_mem", None), "peak_by_phase": phases, "trace_peak": peak,
           "over_budget": (max(phases.values()) - e.config.gpu_mem) if e.config.gpu_mem else None,
           "decode_tok_s": r["decode_tok_s"],
           "plan": pl.summary() if pl is not None else None,
           "live_at_peak_by_site": dict(list(by_site.items())[:a.rows])}
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
