"""A chat's next turns: the time to first token of a prompt that extends a session's cache, with the continuation
prefill as a CUDA graph replay (runtime.cuda_graph.PrefillGraphs) and eagerly, in one process (one engine: the
graphs' context is set to 0 for the eager rounds). Each round is a new session: a first prompt of --prompt-len random
tokens, then --turns turns of --new random tokens (plus the last generated token) and --gen generated tokens.

    python bench/chat_turns.py MODEL [--prompt-len 1500,6000] [--new 40] [--turns 6] [--gen 4]

JSON: per prompt length and mode, each turn's TTFT and the median over the turns after the first two (a token
bucket's first prompt runs eagerly and its second captures).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetier import EngineConfig, SamplingParams  # noqa: E402
from moetier.runtime.engine import Engine  # noqa: E402
from moetier.runtime.generate import Done, TokenEvent  # noqa: E402


def conversation(eng, prompt_len: int, new: int, turns: int, gen: int, g) -> list[dict]:
    vocab = eng.args.vocab_size
    s = eng.new_session()
    ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
    out = []
    for turn in range(turns + 1):
        if turn:
            ids = ids + torch.randint(100, vocab - 100, (new,), generator=g).tolist()
        evs = list(eng.generate(prompt_ids=ids, max_tokens=gen, params=SamplingParams(temperature=0), session=s,
                                ignore_eos=True))
        ids = ids + [ev.token_id for ev in evs if isinstance(ev, TokenEvent) and ev.token_id >= 0]
        st = next(ev for ev in evs if isinstance(ev, Done)).stats
        out.append({"turn": turn, "new_tokens": st["prompt_tokens"] - st["cached_tokens"],
                    "cached": st["cached_tokens"], "ttft_ms": round(st["ttft_s"] * 1e3, 2)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompt-len", default="1500,6000")
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--gen", type=int, default=4)
    p.add_argument("--ctx", type=int, default=8192)
    a = p.parse_args()
    eng = Engine.load(a.model, EngineConfig(progress=False, max_context=a.ctx))
    pg = eng._prefill_graphs()
    res = {"model": a.model, "device": eng.device, "graphs": pg is not None,
           "context": getattr(pg, "context", 0), "runs": []}
    g = torch.Generator().manual_seed(0)
    for n in (int(x) for x in a.prompt_len.split(",")):
        for mode in ("graph", "eager", "graph"):
            if pg:
                pg.context = res["context"] if mode == "graph" else 0
            turns = conversation(eng, n, a.new, a.turns, a.gen, g)
            later = [t["ttft_ms"] for t in turns[3:]]
            r = {"prompt_len": n, "mode": mode, "turns": turns,
                 "median_ttft_ms": round(statistics.median(later), 2) if later else None,
                 "graphs": sorted(k for k in pg.graphs) if pg else []}
            print(json.dumps({k: v for k, v in r.items() if k != "turns"}), file=sys.stderr, flush=True)
            res["runs"].append(r)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
