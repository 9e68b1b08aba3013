"""`moetier <command>`: each command lives in moetier/commands/<name>.py with `add_parser` and `main`."""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import UserError

# command -> module under moetier.commands (in help order; each module has add_parser + main)
ORDER = ["run", "chat", "serve", "plan", "profile", "bench", "verify", "quantize", "imatrix", "synth"]


def commands() -> list[str]:
    import pkgutil
    from . import commands as pkg
    found = {m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name != "common"}
    return [c for c in ORDER if c in found] + sorted(found - set(ORDER))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetier",
        description="Run giant Mixture-of-Experts LLMs on one machine: dense weights and hot experts on the GPU, "
                    "the expert bank in RAM, the rest on SSD. With no MODEL, commands use the embedded default model.")
    p.add_argument("--version", action="version", version=f"moetier {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands():
        importlib.import_module(f".commands.{name}", __package__).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except UserError as e:
        print(f"moetier: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nmoetier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
