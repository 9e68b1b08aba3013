"""`moetier chat`: interactive multi-turn chat in the terminal; earlier turns stay in the KV cache."""
from __future__ import annotations

import json
import sys

from ..runtime.generate import Done
from .common import add_model_args, add_sampling_args, load_engine, sampling_params

HELP = "commands: /stats (last reply's numbers), /reset (new conversation), /system TEXT, /exit"


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat",
                       description="Chat with MODEL in the terminal. Each turn reuses the KV cache of the "
                                   "conversation so far and computes only the new tokens. " + HELP)
    add_model_args(p)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_args(p)
    p.set_defaults(func=main, max_tokens=512)


def main(args) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine)
    session = engine.new_session()
    system = args.system
    messages: list[dict] = []
    stats: dict = {}
    tty = sys.stdin.isatty()
    if tty:
        print(f"moetier chat with {engine.name} on {engine.device}. {HELP}", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/stats":
            print(json.dumps(stats, indent=1), file=sys.stderr)
            continue
        if line.strip() == "/reset":
            messages, session = [], engine.new_session()
            continue
        if line.startswith("/system"):
            system, messages = line[len("/system"):].strip() or None, []
            continue
        messages.append({"role": "user", "content": line})
        msgs = ([{"role": "system", "content": system}] if system else []) + messages
        reply = ""
        for ev in engine.generate(messages=msgs, max_tokens=args.max_tokens, params=params,
                                  stop=args.stop, session=session):
            if isinstance(ev, Done):
                stats = ev.stats
                reply = ev.text
            else:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
        if tty:
            print(f"[{stats['generated_tokens']} tokens, {stats['decode_tok_s']:.1f} tok/s, "
                  f"{stats['cached_tokens']} cached]", file=sys.stderr)
    return 0
