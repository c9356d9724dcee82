"""The `tndebug` command. Thin: one module per subcommand in `tndebug/commands/`.

Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input or usage, 3 internal error,
4 nothing found but not everything that applies could be checked (INCOMPLETE / UNCHECKED),
130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from tndebug import __version__
from tndebug.errors import UsageError

COMMANDS = ("run", "triage", "check", "probes", "faults")

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False     # no prefix matching: `--prob all` is refused, not --probe
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse's own code), no usage dump
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    from tndebug.commands.flags import HelpFormatter
    parser = _Parser(prog="tndebug", formatter_class=HelpFormatter, description=(
        "Debug a Transformer (encoder-decoder, decoder-only or encoder-only): train with probes "
        "attached (run), diagnose a checkpoint and its model code (triage), check model code "
        "with no checkpoint, as a linter in CI (check), list what is checked (probes, faults)."),
        epilog="Exit codes: 0 clean; 1 findings at or above --fail-on (or a diverged run); 4 no "
               "such finding, but something that applies could not be checked (INCOMPLETE, "
               "UNCHECKED); 2 bad "
               "input or usage, in one line; 3 internal error; 130 interrupted; 143 terminated "
               "(SIGTERM). `tndebug COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"tndebug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"tndebug.commands.{name}").add_parser(sub)
    return parser


# Warnings that say nothing to a tndebug user: torch's advice about its own fast paths, and
# one that tndebug already explains in its own line.
NOISE = ("enable_nested_tensor is True",                       # nn.TransformerEncoder's fast path
         "looks like a TorchScript archive",                   # our message says what the file is
         "degrees of freedom is <= 0")                         # std of one value, on NaN input


def main(argv: list[str] | None = None) -> int:
    """Run one command. The warnings it raises (torch's, the user's model code's) are held and
    printed after tndebug's own lines, so the first line a user reads is tndebug's; known
    noise is dropped. The filters in force (-W, PYTHONWARNINGS) still apply."""
    with warnings.catch_warnings(record=True) as caught:
        code = _main(argv)
    seen = set()
    for w in caught if not sys.stderr.closed else ():   # closed: `tndebug faults | head`
        text = str(w.message)
        key = (w.category, text, w.filename, w.lineno)
        if key in seen or any(n in text for n in NOISE):
            continue
        seen.add(key)
        sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    return code


def _main(argv: list[str] | None) -> int:
    from tndebug.commands.flags import probe_selection
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            print(short_usage(parser), file=sys.stderr)
            return EXIT_USAGE
        if getattr(args, "probe", None) is not None:
            probe_selection(args.probe, args.command)
        try:
            return int(args.func(args) or 0)
        except SystemExit as e:           # tndebug never exits inside a command: the user's code did
            raise UsageError(user_exit(e)) from None
    except UsageError as e:
        print(f"tndebug: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `tndebug faults | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt as e:      # SigTerm (a KeyboardInterrupt) exits 143
        code = getattr(e, "exit_code", 130)
        print(f"tndebug: {'terminated (SIGTERM)' if code == 143 else 'interrupted'}", file=sys.stderr)
        return code
    except Exception as e:  # noqa: BLE001
        import os
        if os.environ.get("TNDEBUG_DEBUG"):
            raise
        print(f"tndebug: internal error: {type(e).__name__}: {e} "
              f"(set TNDEBUG_DEBUG=1 for the traceback; please report it)", file=sys.stderr)
        return EXIT_INTERNAL


def short_usage(parser: argparse.ArgumentParser) -> str:
    """`tndebug` alone: the commands in a few lines, not the whole help."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows = [f"  {a.dest:<8}{a.help}" for a in sub._choices_actions]
    return "\n".join(["usage: tndebug COMMAND ...  (`tndebug COMMAND --help`, `tndebug --help`)",
                      *rows])


def user_exit(e: SystemExit) -> str:
    """One line for a SystemExit raised by the user's code (--model, --adapter, --data, their
    import): the file and line that exited, from the traceback's last frame outside tndebug."""
    import os
    from pathlib import Path
    ours = Path(__file__).resolve().parent
    where = None
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not Path(name).resolve().is_relative_to(ours) and "_sitebuiltins" not in name:   # exit()
            where = (name, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    call = f"sys.exit({e.code!r})" if e.code is not None else "sys.exit()"
    if where is None:
        return f"the code tndebug ran called {call}; nothing was diagnosed"
    path, lineno, func = where
    try:
        path = os.path.relpath(path)
    except ValueError:
        pass
    inside = "at import" if func == "<module>" else f"in {func}()"
    return (f"{path} called {call} (line {lineno}, {inside}); tndebug runs that code to diagnose "
            f"it: remove the exit, or put it under `if __name__ == \"__main__\":`")


if __name__ == "__main__":
    sys.exit(main())
