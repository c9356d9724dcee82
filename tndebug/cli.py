"""The `tndebug` command. Thin: one module per subcommand in `tndebug/commands/`.

Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input or usage, 3 internal error.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tndebug import __version__
from tndebug.errors import UsageError

COMMANDS = ("run", "triage", "probes", "faults")

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's own code), no usage dump
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tndebug", description=(
        "Debug an encoder-decoder Transformer: train with probes attached (run), diagnose a "
        "checkpoint and its model code (triage), list what is checked (probes, faults)."))
    parser.add_argument("--version", action="version", version=f"tndebug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"tndebug.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"tndebug: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `tndebug faults | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print("tndebug: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        import os
        if os.environ.get("TNDEBUG_DEBUG"):
            raise
        print(f"tndebug: internal error: {type(e).__name__}: {e} "
              f"(set TNDEBUG_DEBUG=1 for the traceback; please report it)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
