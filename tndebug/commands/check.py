"""`tndebug check FILE.py:FACTORY`: the exact tests on model code, no checkpoint, no training.

The linter a user puts in CI: the factory builds the model (kwargs from --config), `tndebug.check`
runs the probes that judge code and weights from one forward and backward (on --data, else on
random ids), and the findings are printed. `--format concise` gives one ruff-like line per
finding, `FILE:LINE: CODE severity: message`, at the line of the user's code that made the
evidence where it is known, else at the factory. Nothing is written unless --out is given.
Exit codes as triage's: 0 clean, 1 findings at or above --fail-on, 2 bad input, 4 incomplete.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import sys

from tndebug.commands.flags import (HelpFormatter, add_code_options, add_fail_on, add_model_options, add_verbose,
                                    out_path)
from tndebug.errors import UsageError
from tndebug.probes import PROBE_NAMES

EPILOG = """examples:
  tndebug check model.py:build                    # how to call it: guessed (GPT-style: model(idx))
  tndebug check model.py:build --format concise   # FILE:LINE: CODE severity: message
  tndebug check seq2seq.py:make_model --adapter seq2seq.py:forward --config '{"d_model": 64}'
  tndebug check model.py:build --data held_out.pt --select missing-scale,mask-broadcast
see docs/triage.md (the same probes as triage --model, on the model as built)"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check", help="check your model code (no checkpoint, no training): the linter for CI",
        description="Build your model with FACTORY and run the exact tests that need no "
                    "training: the masks (causality, padding, batch independence), the fitted "
                    "score scale, NaN provenance, head and depth statistics. Each finding on "
                    "your code names the line that made its evidence.\n\n"
                    "Exit codes: 0 clean: nothing at or above --fail-on, and every probe that "
                    "applies checked the model; 1 findings at or above it; 4 no such finding, "
                    "but a probe that applies could not check the model (INCOMPLETE); 2 bad "
                    "input or usage; 3 internal error.",
        epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("model", metavar="FILE.py:FACTORY",
                   help="a function that returns your nn.Module (kwargs from --config)")
    add_model_options(
        p, config="the factory's keyword arguments",
        adapter="how to call the model: forward(model, src, tgt, pad_id) -> logits, or "
                "forward(model, ids, pad_id) -> logits for a decoder-only or encoder-only model "
                "(default: guessed from the model)",
        arch="what your model is, when its code cannot say (as triage's --arch)",
        data="your own batches: {'src', 'tgt'} (encoder-decoder, tgt BOS-led) or "
             "{'ids': LongTensor[N,T]} (one stack), as triage's --data (default: random ids from "
             "the model's vocabulary)",
        max_len="the longest sequence your model takes (default: found by calling it)",
        pad_id="the padding id (default 0); `none`: your data have no padding",
        bos_id="the id that starts every decoder input (default 1, or 2 when --pad-id is 1)",
        bos_default=None)
    p.add_argument("--probe", default=None,
                   help=f"probes to run: a,b (default: every probe that needs no training; "
                        f"known: {', '.join(PROBE_NAMES)})")
    p.add_argument("--format", choices=("concise", "text", "json"), default="text",
                   help="concise: one FILE:LINE: CODE severity: message line per finding, a "
                        "'not checked: PROBE: why' line per probe that could not check; text: "
                        "the findings table; json: the report (default text). With concise or "
                        "json, what your code prints goes to stderr")
    add_fail_on(p)
    add_code_options(p)
    add_verbose(p)
    p.add_argument("--out", type=out_path, default=None, metavar="DIR",
                   help="also write report.json, report.md, figures/ and tb/ there (default: "
                        "nothing is written)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a report already in --out")
    p.set_defaults(func=main)


def main(args) -> int:
    from tndebug.commands import cheap   # torch-free: a bad name, code or JSON is one line, fast
    from tndebug.paths import config_json
    cheap.codes(args.select, "--select")
    cheap.codes(args.ignore, "--ignore")
    cheap.adapter(args.adapter, "")
    config_json(args.config)
    cheap.out_place(args.out)
    from tndebug.capture.adapters import load_callable
    from tndebug.capture.user_model import build_user_model, parse_config
    from tndebug.library.check import check
    from tndebug import judge            # torch: not in the parser (a bad flag is refused before it)

    select = judge.codes_option(args.select, "--select")        # before any work
    ignore = judge.codes_option(args.ignore, "--ignore")
    quiet = args.format != "text"        # stdout is tndebug's: the user's prints go to stderr
    theirs = contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()
    with theirs:
        factory, _ = load_callable(args.model, "check")
        model, _ = build_user_model(args.model, parse_config(args.config) or {})
        forward, arch = None, args.arch
        if args.adapter in ("gpt", "bert"):
            arch = arch or {"gpt": "decoder", "bert": "encoder"}[args.adapter]
        elif args.adapter and ":" in args.adapter:
            forward, _ = load_callable(args.adapter, "--adapter")
        elif args.adapter:                          # annotated, tndebug: called by name
            forward = args.adapter
        data = _data(args)
        report = check(model, forward, data, pad_id=args.pad_id, bos_id=args.bos_id,
                       probes=args.probe, max_len=args.max_len, out=args.out,
                       overwrite=args.overwrite, select=select, ignore=ignore, arch=arch)
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2, default=str))
    elif args.format == "concise":
        for line in concise_lines(report, factory, model):
            print(line)
        from tndebug.reporters.common import counts_text
        for name, why in report.incomplete().items():    # exit 4 says why, in the same lines
            print(f"tndebug check: not checked: {name}: {why or 'no reason given'}")
        print(f"tndebug check: {report.verdict.upper()} ({counts_text(report)})")
    else:
        from tndebug.reporters.console import make_console, print_summary
        from pathlib import Path
        paths = {"report": str(Path(args.out) / "report.json"),
                 "markdown": str(Path(args.out) / "report.md")} if args.out else None
        print_summary(report, make_console(), paths, verbose=args.verbose)
    return report.exit_code(args.fail_on)


def _data(args):
    """--data as `tndebug.check` takes it: (src, tgt_in, tgt_out) or {'ids': ...}."""
    if not args.data:
        return None
    from tndebug.triage.userdata import OneStack, load_data
    loaded = load_data(args.data, 0 if args.pad_id is None else args.pad_id,
                       1 if args.bos_id is None else args.bos_id)
    return dict(loaded.raw) if isinstance(loaded, OneStack) else tuple(loaded)


def concise_lines(report, factory, model=None) -> list[str]:
    """`FILE:LINE: CODE severity: message`, most severe first; FILE:LINE is the finding's source
    line, else the `forward` def of the module it names, else the factory's def."""
    from tndebug.capture.source import shown_path
    from tndebug.reporters.common import sorted_findings
    try:
        home = (inspect.getsourcefile(factory), inspect.getsourcelines(factory)[1])
    except (TypeError, OSError):
        home = (getattr(getattr(factory, "__code__", None), "co_filename", "?"), 1)
    out = []
    for f in sorted_findings(report):
        src = f.source or _module_def(model, f.where)
        file, line = (src["file"], src["line"]) if src else home
        message = " ".join(f.message.split())
        out.append(f"{shown_path(file)}:{line}: {f.code or f.probe} {f.severity}: {message}")
    return out


def _module_def(model, where: str) -> dict | None:
    """The forward def of the module at `where` in `model`, when it is one of its paths."""
    from tndebug.capture.source import forward_def
    try:
        return forward_def(model.get_submodule(where)) if model is not None and where else None
    except AttributeError:
        return None
