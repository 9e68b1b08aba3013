"""`moetier run`: generate from a prompt (text or token ids), streamed, or as one JSON object."""
from __future__ import annotations

import json
import sys

from ..errors import UserError
from ..runtime.generate import Done
from .common import add_model_args, add_sampling_args, load_engine, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt",
                       description="Generate from a prompt with MODEL (default: the embedded model). "
                                   "Text streams to stdout; --json prints one JSON object at the end.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default=None, help="prompt text (default: a short English opener)")
    src.add_argument("--prompt-ids", default=None, metavar="1,2,3", help="prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object: text, token ids, stats")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print the notes meant for a terminal (such as a background build) when stderr is not one")
    p.set_defaults(func=main)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--prompt-ids must be comma-separated integers like 1,2,3 (got {text!r})") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def main(args) -> int:
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0 (got {args.max_tokens})")
    ids = parse_ids(args.prompt_ids) if args.prompt_ids else None
    engine = load_engine(args)
    params = sampling_params(args, engine)
    kw = {}
    if ids is not None:
        kw["prompt_ids"] = ids
    elif args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        kw["messages"] = msgs + [{"role": "user", "content": args.prompt or "Tell me about Python."}]
    else:
        kw["prompt"] = args.prompt if args.prompt is not None else "The Python programming language"
    done = None
    if not args.json and "prompt" in kw:
        sys.stdout.write(kw["prompt"])
    for ev in engine.generate(**kw, max_tokens=args.max_tokens, params=params, stop=args.stop):
        if isinstance(ev, Done):
            done = ev
        elif not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": done.token_ids, "prompt_token_ids": done.prompt_token_ids,
                          "finish_reason": done.finish_reason, "stats": done.stats}, ensure_ascii=False))
    else:
        s = done.stats
        print(f"\n\n[{s['prompt_tokens']} prompt tokens at {s['prefill_tok_s']:.1f} tok/s, "
              f"{s['generated_tokens']} generated at {s['decode_tok_s']:.1f} tok/s, "
              f"ttft {s['ttft_s'] * 1000:.0f} ms, finish: {done.finish_reason}]", file=sys.stderr)
    if sys.stderr.isatty() or args.verbose:
        note = cpu_compile_note(engine, done.stats, getattr(args, "cpu_compile", "auto"))
        if note:
            print(f"[{note}]", file=sys.stderr)
    return 0


def cpu_compile_note(engine, stats: dict, mode: str) -> str | None:
    """One line on the CPU decode path after an eager auto run: the background build, else how to build."""
    if stats.get("decode_path") != "eager" or stats.get("device") != "cpu" or mode != "auto":
        return None
    build = getattr(engine, "cpu_build", None)
    if build is not None:
        return f"decoded eagerly; {build.describe()}"
    if getattr(engine, "_cpu_decode", None) is False:   # not started: turned off, failed before, short of RAM
        return ("decoded eagerly: run once with --cpu-compile on to build a ~2x faster step for this model "
                "(15-25 s, cached; later runs use it)")
    return None
