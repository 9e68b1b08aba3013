"""Where a CUDA-graph decode step and an eager step part, module by module (perf-log session 18: the bf16 graph
replays' logits of `test_engine_quant_dense_on_cuda` took a few distinct values between runs, eager ones did not).

A tiny synthetic Qwen3-30B-A3B-shaped Q4_0 model (the test's), teacher-forced: each step runs eagerly on one cache and
as a graph replay on another. Forward hooks copy every block's attention, MoE and block output into buffers (the
copies are captured with the graph), so the first module whose outputs differ is named. Then the same replay is run
several times from one saved cache state: replays of one graph on the same inputs must agree bit for bit, and so must
eager steps. Prints one JSON object.

    python bench/graph_check.py [--dequantize-dense] [--layers 2] [--steps 16] [--repeats 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier import EngineConfig  # noqa: E402
from moetier.runtime.cuda_graph import DecodeGraph  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402
from moetier.tools.synth import synth  # noqa: E402


class Taps:
    """Forward hooks that copy module outputs into buffers of the current mode ('eager' or 'graph')."""

    def __init__(self, model):
        self.mode, self.bufs, self.names = "eager", {"eager": {}, "graph": {}}, []
        for i, blk in enumerate(model.model.layers):
            for name, mod in ((f"{i}.attn", blk.self_attn), (f"{i}.mlp", blk.mlp), (f"{i}.block", blk)):
                self.names.append(name)
                mod.register_forward_hook(lambda m, a, out, name=name: self._tap(name, out))

    def _tap(self, name: str, out) -> None:
        out = out[0] if isinstance(out, tuple) else out
        store = self.bufs[self.mode]
        if name not in store or store[name].shape != out.shape:   # prefill, then the T = 1 warm-up before capture
            for m in self.bufs.values():
                m[name] = torch.empty_like(out)
        store[name].copy_(out)

    def take(self, mode: str) -> dict:
        return {k: v.float().clone() for k, v in self.bufs[mode].items()}


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dequantize-dense", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=4, help="replays of one step from one saved cache state")
    a = p.parse_args()
    path = Path(tempfile.mkdtemp()) / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=a.layers, scale="tiny", log=lambda *x: None, progress=False)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 100, (25,), generator=g).cuda()
    forced = torch.randint(3, 100, (a.steps,), generator=g).cuda()
    eng = Engine.load(path, EngineConfig(device="cuda", dtype="bfloat16", dequantize_dense=a.dequantize_dense,
                                         max_context=128, progress=False))
    taps = Taps(eng.model)
    res = {"dequantize_dense": a.dequantize_dense, "steps": []}
    with torch.inference_mode():
        eager, graphed = eng.new_session().cache, eng.new_session().cache
        eng.model(prompt, eager)
        eng.model(prompt, graphed)
        taps.mode = "graph"
        graph = DecodeGraph(eng.model, graphed)
        for s, tok in enumerate(forced):
            taps.mode = "eager"
            le = eng.model(tok[None], eager)[-1].float()
            te = taps.take("eager")
            taps.mode = "graph"
            lg = graph.step(tok[None])[-1].float().clone()
            tg = taps.take("graph")
            first = next((n for n in taps.names if not torch.equal(te[n], tg[n])), None)
            res["steps"].append({"step": s, "logits_rel": round(rel(lg, le), 6), "first_differing": first,
                                 "rel": {n: round(rel(tg[n], te[n]), 6) for n in taps.names[:6]}})
        # the same step again and again from one state: graph replays, then eager steps
        for mode, cache in (("graph", graphed), ("eager", eager)):
            snap, outs = cache.snapshot(), []
            tok = forced[:1]
            for _ in range(a.repeats):
                cache.restore(snap)
                taps.mode = mode
                lo = (graph.step(tok) if mode == "graph" else eng.model(tok, cache))[-1].float().clone()
                outs.append((lo, taps.take(mode)))
            diffs = [{"logits_equal": torch.equal(o[0], outs[0][0]),
                      "first_differing": next((n for n in taps.names if not torch.equal(o[1][n], outs[0][1][n])),
                                              None)} for o in outs[1:]]
            res[f"{mode}_repeats"] = diffs
            cache.restore(snap)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
