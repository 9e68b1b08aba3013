"""`moetier profile MODEL --prompts FILE --out profile.json`: count which experts the prompts use.

Each prompt is prefilled and then generated from (--max-tokens); every MoE layer's routes are counted
per expert (tokens and routing weight, prompt and decode apart). Use the file with
--expert-profile FILE to pin or preload the hottest experts (see `moetier plan`).
FILE: one prompt per line (a line of comma-separated integers is token ids), or JSON lines
{"prompt": ...} | {"messages": [...]} | {"prompt_ids": [...]}.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..memory.profile import Recorder
from .common import add_model_args, add_sampling_args, load_engine, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="count which experts a set of prompts uses (for --expert-profile)",
                       description="Run MODEL over the prompts in FILE and write per-(layer, expert) route counts.")
    add_model_args(p)
    p.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line, or JSON lines")
    p.add_argument("--out", required=True, metavar="FILE", help="profile JSON to write")
    p.add_argument("--chat", action="store_true", help="wrap plain-text prompts as user messages")
    add_sampling_args(p)
    p.set_defaults(func=main, max_tokens=64)


def read_prompts(path: Path, chat: bool) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read --prompts {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: bad JSON ({e.msg})") from None
            keys = {"prompt", "messages", "prompt_ids"} & set(d)
            if len(keys) != 1:
                raise UserError(f"{path}:{n}: give exactly one of prompt, messages, prompt_ids")
            out.append({k: d[k] for k in keys})
        elif re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", line):
            out.append({"prompt_ids": [int(x) for x in line.split(",")]})
        elif chat:
            out.append({"messages": [{"role": "user", "content": line}]})
        else:
            out.append({"prompt": line})
    if not out:
        raise UserError(f"{path}: no prompts in the file")
    return out


def main(args) -> int:
    prompts = read_prompts(Path(args.prompts), args.chat)
    engine = load_engine(args)
    params = sampling_params(args, engine)
    rec = Recorder(engine.model, engine.args.model_type)
    generated = 0
    for i, kw in enumerate(prompts, 1):
        done = engine.complete(**kw, max_tokens=args.max_tokens, params=params)
        generated += len(done.token_ids)
        print(f"[{i}/{len(prompts)}] {done.stats['prompt_tokens']} prompt + {len(done.token_ids)} generated tokens",
              file=sys.stderr)
    rec.remove()
    prof = rec.profile
    prof.meta = {"prompts": len(prompts), "generated_tokens": generated}
    prof.save(args.out)
    share = np.sort(prof.share(), axis=1)[:, ::-1]
    e = prof.num_experts
    top = {f: float(share[:, :max(1, int(round(e * f)))].sum(axis=1).mean()) for f in (0.1, 0.25, 0.5)}
    print(f"wrote {args.out}: {len(prof.layers)} MoE layers x {e} experts, {len(prompts)} prompts, "
          f"{generated} generated tokens; the hottest 10% / 25% / 50% of each layer's experts take "
          f"{top[0.1]:.0%} / {top[0.25]:.0%} / {top[0.5]:.0%} of its routes")
    return 0
