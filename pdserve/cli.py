"""`pdserve` command line: one subcommand per entry of ``COMMANDS`` (a module in
``pdserve/commands/``; the other modules there are helpers the commands share).

Each module defines ``register(subparsers) -> None`` which adds its parser and sets
``func=run`` via ``set_defaults``. Modules are imported lazily so ``pdserve plan`` does not import
torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# what `pdserve --help` says (the module docstring is for developers)
DESCRIPTION = (
    "pdserve: disaggregated prefill/decode LLM serving with OpenAI-compatible HTTP and gRPC "
    "APIs. `pdserve COMMAND --help` describes a command."
)

# subcommand name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "pdserve.commands.serve",
        "run the whole system: Ray workers + HTTP and gRPC gateways",
    ),
    "router": ("pdserve.commands.router", "run a router against an existing Ray cluster"),
    "generate": ("pdserve.commands.generate", "offline batched generation on one process"),
    "bench": ("pdserve.commands.bench", "benchmark an OpenAI-compatible server"),
    "plan": ("pdserve.commands.plan", "KV cache capacity planner"),
    "convert": ("pdserve.commands.convert", "write the weights as a Hugging Face directory"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The ``pdserve`` parser, with the subcommand ``argv`` names fully registered."""
    return _build(argv)[0]


def _build(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """(the parser, its subcommand parsers by name)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == wanted:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                p = sub.add_parser(name, help=help_text)
                p.set_defaults(func=lambda _a, n=name: _not_yet(n))
                continue
            mod.register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser, sub.choices


def _innermost(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the deepest subcommand ``args`` chose below ``parser`` (``pdserve bench
    serve``'s for ``bench serve``), so an error shows that command's usage."""
    while True:
        action = next(
            (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        chosen = getattr(args, action.dest, None) if action is not None else None
        if action is None or chosen not in action.choices:
            return parser
        parser = action.choices[chosen]


def _not_yet(name: str) -> int:
    print(f"pdserve {name}: not yet available in this build", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _build(args_list)
    args, unknown = parser.parse_known_args(args_list)
    if unknown:  # name the subcommand's usage, not the top level's (`pdserve serve --typo`)
        _innermost(commands.get(args.command or "", parser), args).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
