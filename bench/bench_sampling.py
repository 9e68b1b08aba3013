"""The CPU sampler's cost a token (runtime.sampling.Sampler) against the full-vocabulary way it replaced there (session
36), which the CUDA sampler keeps: the penalties and every filter a mask over all V logits (filter_logits), then
torch.multinomial (an exponential number per entry); prints JSON.

Per vocabulary size (8,192: the default model; 151,936: Qwen's) and parameter set (the default model's generation
config: T 0.7, top-k 40, top-p 0.9, repetition penalty 1.1; plain T 1; top-p 0.95 alone; min-p 0.05 alone): us a call,
best of --rounds interleaved rounds of --calls calls each, one thread, random logits x 3 (a flatter distribution than a
trained model's: top-p alone keeps more tokens here than it would there), and the ratio old / new.

    python bench/bench_sampling.py [--vocab 8192,151936] [--rounds 3] [--calls 50] [--threads 1] [--device cuda]

--device cuda: the logits on the GPU, us a call each, its token read back (the sync a decode step has anyway): the
CUDA sampler (runtime.sampling.DeviceDraw: one graph replay, "cuda_sampler_us"), its MOETIER_SAMPLER=triton form
("cuda_triton_us"; "triton_path": whether those parameters take it), the default without its graph ("cuda_eager_us"), the masks and torch.multinomial it replaced ("cuda_masks_multinomial_us"), and the CPU sampler on the
logits copied to the host, the copy included ("host_sampler_us").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier.runtime.sampling import Sampler, SamplingParams, _penalties_dense, filter_logits  # noqa: E402

PARAMS = {"generation_config": dict(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1),
          "temperature_1": dict(temperature=1.0), "top_p_0.95": dict(temperature=0.8, top_p=0.95),
          "min_p_0.05": dict(temperature=0.8, min_p=0.05)}


OPS = {"sort": lambda x: torch.sort(x, descending=True), "topk_21": lambda x: torch.topk(x, 21),
       "topk_1024": lambda x: torch.topk(x, 1024), "logsumexp_f64": lambda x: torch.logsumexp(x.double(), -1),
       "softmax_cumsum_f64": lambda x: torch.softmax(x.double(), -1).cumsum(-1), "nothing": lambda x: None}


def baseline(s: Sampler, logits: torch.Tensor) -> int:
    """The full-vocabulary way (the CUDA sampler's until session 38): penalties and filter_logits' masks over every logit, then
    torch.multinomial."""
    x = _penalties_dense(logits.float(), s.seen, s.counts, s.p)
    x = filter_logits(x / s.p.temperature, s.p.top_k, s.p.top_p, s.p.min_p)
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=s.gen))


def timed(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="8192,151936")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        return on_cuda(a)
    out = []
    for v in (int(x) for x in a.vocab.split(",")):
        logits = torch.randn(v, generator=torch.Generator().manual_seed(0)) * 3
        for name, kw in PARAMS.items():
            s = Sampler(SamplingParams(seed=1, **kw), v, "cpu", list(range(64)))
            old, new = [], []
            for _ in range(a.rounds):
                old.append(timed(lambda: baseline(s, logits), a.calls))
                new.append(timed(lambda: s(logits), a.calls))
            out.append({"vocab": v, "params": name, "full_vocab_us": round(min(old), 1),
                        "sampler_us": round(min(new), 1), "speedup": round(min(old) / min(new), 2)})
            print(out[-1], file=sys.stderr)
    json.dump({"threads": a.threads, "results": out}, sys.stdout, indent=1)
    print()
    return 0


def on_cuda(a) -> int:
    """The CUDA sampler against the CPU one on a host copy of the logits (see the module doc)."""
    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    out = []
    for v in (int(x) for x in a.vocab.split(",")):
        logits = (torch.randn(v, generator=torch.Generator().manual_seed(0)) * 3).cuda()
        for name, op in OPS.items():        # the sampler's pieces alone, each synced
            out.append({"vocab": v, "op": name, "us": round(min(timed(lambda: (op(logits), torch.cuda.synchronize()),
                                                                      a.calls) for _ in range(a.rounds)), 1)})
            print(out[-1], file=sys.stderr)
        for name, kw in PARAMS.items():
            make = lambda dev: Sampler(SamplingParams(seed=1, **kw), v, dev, list(range(64)))  # noqa: E731
            graph, host, old = make("cuda"), make("cpu"), make("cuda")
            os.environ["MOETIER_SAMPLER_GRAPH"] = "0"
            eager = make("cuda")
            eager(logits)
            os.environ.pop("MOETIER_SAMPLER_GRAPH")
            os.environ["MOETIER_SAMPLER"] = "triton"
            tri = make("cuda")
            tri(logits)
            os.environ.pop("MOETIER_SAMPLER")
            t = {k: [] for k in ("graph", "triton", "eager", "old", "host")}
            for _ in range(a.rounds):
                t["graph"].append(timed(lambda: graph(logits), a.calls))
                t["triton"].append(timed(lambda: tri(logits), a.calls))
                t["eager"].append(timed(lambda: eager(logits), a.calls))
                t["old"].append(timed(lambda: baseline(old, logits), a.calls))
                t["host"].append(timed(lambda: host(logits.cpu()), a.calls))
            best = {k: min(x) for k, x in t.items()}
            out.append({"vocab": v, "params": name, "cuda_sampler_us": round(best["graph"], 1),
                        "cuda_triton_us": round(best["triton"], 1), "triton_path": tri._graph.seed is not None,
                        "cuda_eager_us": round(best["eager"], 1), "cuda_masks_multinomial_us": round(best["old"], 1),
                        "host_sampler_us": round(best["host"], 1),
                        "masks_over_graph": round(best["old"] / best["graph"], 2)})
            print(out[-1], file=sys.stderr)
    json.dump({"device": torch.cuda.get_device_name(), "threads": a.threads, "results": out}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
