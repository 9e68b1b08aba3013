"""`moetier synth`: write a random-weight checkpoint with the exact shapes of a big MoE model."""
from __future__ import annotations

import json

from ..errors import UserError
from ..tools.synth_shapes import shape_names


def _scale(text: str):
    if text == "tiny":
        return "tiny"
    try:
        return float(text)
    except ValueError:
        raise UserError(f"--scale must be a number in (0, 1] or 'tiny' (got {text!r})") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "synth", help="write a synthetic checkpoint with a real model's shapes",
        description="Write a checkpoint with random weights and the exact shapes of NAME: BF16 as a "
                    "safetensors directory (config.json, shards + index, tokenizer.json), quantized types "
                    "as one GGUF file with llama.cpp's tensor names. Weights are generated and written "
                    "one tensor at a time (on the GPU if there is one), then the routing of the first "
                    "layers is checked on the written weights. Shapes: " + ", ".join(shape_names()))
    p.add_argument("name", metavar="NAME", help="model shape: " + ", ".join(shape_names()))
    p.add_argument("--quant", default="BF16", type=str.upper, help="BF16 | Q8_0 | Q4_0 | Q4_K (default BF16)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="directory (safetensors) or .gguf file (a directory gets NAME-QUANT.gguf)")
    p.add_argument("--format", dest="fmt", default="auto", choices=("auto", "safetensors", "gguf"),
                   help="auto: safetensors for BF16, GGUF otherwise")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="keep only the first N layers")
    p.add_argument("--scale", type=str, default=None, metavar="F",
                   help="shrink widths, experts and vocabulary by F (0 < F <= 1), or 'tiny' (hidden size 64)")
    p.add_argument("--skew", type=float, default=0.0, metavar="S",
                   help="expert popularity follows Zipf(S): 0 = uniform; ~0.3-0.6 looks like trained "
                        "models; >= 0.8 makes one expert win most tokens (the check fails)")
    p.add_argument("--locality", type=float, default=0.5, metavar="L",
                   help="share of a token's router input that comes from its topic (temporal locality; default 0.5)")
    p.add_argument("--topics", type=int, default=64, help="topics (token-id blocks) for locality (default 64)")
    p.add_argument("--topic-run", type=int, default=64, metavar="N", help="mean tokens per topic run (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where weights are generated: auto | cpu | cuda")
    p.add_argument("--shard-size", default="4GiB", metavar="SIZE", help="safetensors shard size (default 4GiB)")
    p.add_argument("--check-tokens", type=int, default=512, metavar="N", help="tokens of the routing check")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object (the report) to stdout")
    p.set_defaults(func=main)


def main(args) -> int:
    import sys

    from ..config import parse_size
    from ..tools.synth import synth
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    report = synth(args.name, args.quant, args.out, layers=args.layers, skew=args.skew, seed=args.seed,
                   scale=_scale(args.scale) if args.scale else None, fmt=args.fmt, locality=args.locality,
                   topics=args.topics, topic_run=args.topic_run, device=args.device,
                   shard_bytes=parse_size(args.shard_size), check_tokens=args.check_tokens, log=log)
    if args.json:
        print(json.dumps(report))
    if report["routing"]["problems"]:
        return 2
    return 0
