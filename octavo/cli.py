"""`octavo` command line. Each subcommand lives in octavo/commands/<name>.py and exposes
`HELP: str`, `add_arguments(parser)` and `run(args) -> int`."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from octavo.version import __version__
from octavo.errors import OctavoError
from octavo.extras import missing_extra_message

COMMANDS = ["export", "build", "generate", "chat", "serve", "bench", "trace", "demo", "triton"]


def _load(name: str):  # noqa: ANN202
    return importlib.import_module(f"octavo.commands.{name}")


class DefaultsFormatter(argparse.HelpFormatter):
    """--help shows every option's default: "(default: X)" is added to any help that does not state one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower()
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        if action.nargs == 0 and isinstance(action.default, bool):  # a switch
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


def _unavailable(message: str):  # noqa: ANN202
    def run(args: argparse.Namespace) -> int:
        print(f"octavo {args.command}: error: {message}", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="LLM serving with a paged KV cache and continuous "
                                     "batching", formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"octavo {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level: DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            mod = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name == f"octavo.commands.{name}":
                continue  # command not part of this build
            message = missing_extra_message(exc)
            if message is None:
                raise
            # listed, so `octavo --help` works and running it names the extra to install
            p = sub.add_parser(name, help=f"(not installed: {message})", add_help=False)
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(_run=_unavailable(message))
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, formatter_class=DefaultsFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except OctavoError as exc:
        print(f"octavo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc)
        if message is None:
            raise
        print(f"octavo {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
