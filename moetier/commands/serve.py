"""`moetier serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) and the chat page."""
from __future__ import annotations

import ipaddress
import sys

from ..config import parse_size
from ..errors import UserError
from .common import add_model_args, load_engine, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible API server and chat page",
                       description="Serve MODEL over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health, /metrics, and a chat page at /. Requests run one at a time in "
                                   "arrival order; conversations reuse their cached prefix. See docs/api.md.")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    g.add_argument("--port", type=positive_int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route")
    g.add_argument("--model-alias", default=None, metavar="NAME",
                   help="model id shown by /v1/models and accepted in requests (default: the model's name)")
    g.add_argument("--queue-size", type=positive_int, default=16, metavar="N",
                   help="requests that may wait behind the running one; more get 429 (default 16)")
    g.add_argument("--session-mem", default="2GiB", metavar="SIZE",
                   help="KV cache kept for prefix reuse across requests (default 2GiB; at least one session)")
    g.add_argument("--max-sessions", type=positive_int, default=8, metavar="N",
                   help="conversations whose KV cache is kept (default 8)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=main)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args) -> int:
    try:
        import uvicorn
        from ..server.app import create_app
        from ..server.protocol import ServerConfig
    except ImportError as e:
        raise UserError(f"moetier serve needs FastAPI and uvicorn ({e.name} is missing): "
                        "pip install 'moetier[server]'") from None
    if args.port > 65535:
        raise UserError(f"--port must be at most 65535 (got {args.port})")
    session_mem = parse_size(args.session_mem)
    if session_mem is None:
        raise UserError("--session-mem needs a size such as 2GiB")
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                          model_alias=args.model_alias, queue_size=args.queue_size, session_mem=session_mem,
                          max_sessions=args.max_sessions)
    if not is_loopback(args.host) and not config.api_key:
        print(f"moetier: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    engine = load_engine(args)
    names = (str(args.model),) if args.model else ()
    app = create_app(engine, config, names)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"moetier: serving {app.state.moetier.model_id} on {engine.device} at http://{shown}:{args.port} "
          f"(chat page /, API /v1, context {engine.max_context} tokens)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    except OSError as e:  # address in use, permission denied
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0
