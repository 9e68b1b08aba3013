"""`moetier verify`: the same tokens through transformers (the reference) and moetier, compared.

Reports per-position KL(ref || ours) (median, max), top-1 agreement, max |delta logit| and how
many greedy continuation tokens agree. Needs `transformers` (pip install 'moetier[test]').
"""
from __future__ import annotations

import json
import sys

import torch

from ..errors import UserError
from .common import add_model_args, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compare moetier's logits with transformers' on the same tokens",
                       description="Run the same prompt through transformers (reference, on the CPU) and "
                                   "moetier; print KL divergence, top-1 agreement, max |delta logit| and "
                                   "greedy-continuation agreement.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", default="The Python programming language is", help="prompt text")
    p.add_argument("--prompt-ids", default=None, metavar="1,2,3", help="prompt as comma-separated token ids")
    p.add_argument("--greedy", type=int, default=16, metavar="N", help="greedy continuation tokens to compare")
    p.add_argument("--ref-dtype", default="float32", help="reference dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """ours, ref [T, V] -> KL(ref || ours) per position summary, top-1 agreement, max |delta|."""
    ours, ref = ours.double(), ref.double()
    lp_ref, lp_ours = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_ours)).sum(-1).clamp_min(0)
    return {
        "positions": int(ref.shape[0]),
        "kl_median": float(kl.median()), "kl_max": float(kl.max()),
        "top1_agreement": float((ours.argmax(-1) == ref.argmax(-1)).double().mean()),
        "max_abs_logit_diff": float((ours - ref).abs().max()),
    }


def main(args) -> int:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError("verify needs transformers as the reference: pip install 'moetier[test]'") from None
    from .run import parse_ids
    engine = load_engine(args)
    ids = parse_ids(args.prompt_ids) if args.prompt_ids else engine.encode(args.prompt)
    ref_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.ref_dtype)
    if ref_dtype is None:
        raise UserError("--ref-dtype must be float32 or bfloat16")
    try:
        ref = AutoModelForCausalLM.from_pretrained(str(engine.path), dtype=ref_dtype).eval()
    except Exception as e:
        raise UserError(f"transformers could not load {engine.path}: {e}") from None
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        want = ref(tokens[None]).logits[0].float()
        cache = engine.new_session(len(ids) + args.greedy + 2).cache
        got = engine.model(tokens.to(engine.device), cache).float().cpu()
        ref_gen = ref.generate(tokens[None], max_new_tokens=args.greedy, min_new_tokens=args.greedy,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    from ..runtime.generate import greedy_tokens
    ours_gen = greedy_tokens(engine.model, ids, args.greedy, engine.dtype)
    agree = next((i for i, (a, b) in enumerate(zip(ours_gen, ref_gen)) if a != b), min(len(ours_gen), len(ref_gen)))
    report = {**compare_logits(got, want), "greedy_tokens": args.greedy, "greedy_agreement": agree,
              "ours_greedy": ours_gen, "ref_greedy": ref_gen, "device": engine.device,
              "dtype": str(engine.dtype).removeprefix("torch.")}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"positions {report['positions']}: KL median {report['kl_median']:.2e}, max {report['kl_max']:.2e}; "
              f"top-1 agreement {report['top1_agreement']:.1%}; max |delta logit| {report['max_abs_logit_diff']:.3e}; "
              f"greedy tokens agreeing {agree}/{args.greedy}", file=sys.stdout)
    return 0
