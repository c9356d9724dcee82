"""Shared by the subcommands: argparse `type=` functions that refuse numbers that make no
sense (one line, exit 2), and the help formatter."""
from __future__ import annotations

import argparse
import math
import os


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid {'int' if kind is int else 'float'} value: {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (--nproc, --batch-size, --warmup, --heads)."""
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer >= 1")
    return value


def nonneg_int(text: str) -> int:
    """An integer >= 0 (--steps, --save-every, --seed, token ids)."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer >= 0")
    return value


def pad_id_or_none(text: str) -> int | None:
    """--pad-id: a token id >= 0, or `none` (the data hold no padding: character-level text)."""
    if text.strip().lower() == "none":
        return None
    try:
        return nonneg_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer >= 0, or none (no "
                                         f"padding in the data)") from None


def bounded_int(low: int, high, why: str):
    """A type= for an integer from `low` to `high` (a number, or a function giving it at parse
    time, as the machine's cores); above it the message says `why`."""
    def parse(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: must be an integer >= {low}")
        top = high() if callable(high) else high
        if value > top:
            raise argparse.ArgumentTypeError(f"{text}: must be at most {top} ({why})")
        return value
    parse.__name__ = "int"
    return parse


def cores() -> int:
    return os.cpu_count() or 1


# the bounds of `tndebug run`'s numbers, each with its reason (said when a value is above it)
MAX_BATCH = 65536
BATCH = bounded_int(1, MAX_BATCH, "a sequence of the small preset takes ~0.6 MB in a CPU step "
                    "(measured at 2048), so 65536 already need ~40 GB")
STEPS = bounded_int(0, 10**9, "a billion steps take about a year at 30 steps/s")
WARMUP = bounded_int(1, 10**9, "a billion steps take about a year at 30 steps/s")
SEED = bounded_int(0, 2**64 - 1, "torch takes 64-bit seeds")
THREADS = bounded_int(1, cores, "the cores of this machine: more threads only slow torch down")
NPROC = bounded_int(1, 64, "processes on this one machine (torchrun --standalone, one GPU "
                   "or a share of the cores each)")
MAX_LR_FACTOR = 1000.0


def lr_factor(text: str) -> float:
    """--lr-factor: a finite number > 0 and at most MAX_LR_FACTOR."""
    value = positive_float(text)
    if value > MAX_LR_FACTOR:
        raise argparse.ArgumentTypeError(
            f"{text}: must be at most {MAX_LR_FACTOR:g} (the default is 0.2; at 1000 the Noam "
            f"peak lr is above 1 for every preset at the default warmup, where no run trains)")
    return value


def probe_budget(text: str) -> float | str:
    """--probe-budget: a share of the step time in [0, 1] (0.03 or 3%), or "none" (no budget;
    kept as the word, so that the flag's absence, None, still means the default)."""
    if text.strip().lower() in ("none", "off"):
        return "none"
    value = _number(float, text.strip().rstrip("%")) / (100 if text.strip().endswith("%") else 1)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a share of the step time between 0 "
                                         f"and 1 (0.03 or 3%), or none")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (--lr-factor)."""
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number > 0")
    return value


def out_path(text: str) -> str:
    """--out: a path that is not empty or blank (an empty one would write into the current
    directory); the rest of the rule is tndebug/outputs.py's."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an empty path; pass a directory path "
                                         f"(without --out a fresh numbered directory is used)")
    return text


def probe_selection(spec: str, command: str) -> str:
    """--probe of run and triage: an empty selection ('' or ',') would check nothing and say
    CLEAN, so it is refused; `none` says that on purpose."""
    if not [s for s in spec.split(",") if s.strip()]:
        from tndebug.errors import UsageError
        raise UsageError(f"argument --probe: {spec!r} selects no probe; pass probe names "
                         f"(`tndebug probes` lists them), all, or none on purpose (see "
                         f"`tndebug {command} --help`)")
    return spec


class HelpFormatter(argparse.HelpFormatter):
    """Wraps the description and epilog to the terminal, paragraph by paragraph (blank-line
    separated); a paragraph written on several lines (examples, tables) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap
        out = []
        for para in text.split("\n\n"):
            if "\n" in para.strip("\n"):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


def add_model_options(p, *, config: str, adapter: str, arch: str, data: str, max_len: str,
                      pad_id: str, bos_id: str, bos_default: int | None) -> None:
    """How the user's model is built and called, for `triage --model` and `check` alike: each
    flag's name, metavar, type and choices defined once here; each command gives its own help
    words (triage also reads a checkpoint's config and has built-in tasks; check only builds)
    and --bos-id's default (triage: 1; check: None, told from --pad-id)."""
    p.add_argument("--config", metavar="JSON|FILE.json", help=config)
    p.add_argument("--adapter", metavar="annotated|tndebug|gpt|bert|FILE.py:FUNCTION", help=adapter)
    p.add_argument("--arch", choices=("seq2seq", "decoder", "encoder"), help=arch)
    p.add_argument("--data", metavar="FILE.pt|FILE.py:FUNCTION", help=data)
    p.add_argument("--max-len", type=positive_int, default=None, metavar="N", help=max_len)
    p.add_argument("--pad-id", type=pad_id_or_none, default=0, help=pad_id)
    p.add_argument("--bos-id", type=nonneg_int, default=bos_default, help=bos_id)


def add_fail_on(p) -> None:
    """--fail-on for run, triage and check alike: the exit code's threshold."""
    p.add_argument("--fail-on", choices=("error", "warning", "info", "never"), default="error",
                   help="exit 1 when a finding is at least this severe (default error)")


def add_code_options(p) -> None:
    """--select / --ignore: finding codes or probe names, as ruff takes rules."""
    p.add_argument("--select", metavar="CODES", default=None,
                   help="keep only these finding kinds: codes (mask-broadcast/causal-leak) or "
                        "probe names, comma-separated; `tndebug probes --codes` lists them")
    p.add_argument("--ignore", metavar="CODES", default=None,
                   help="drop these finding kinds (codes or probe names, comma-separated)")


def add_verbose(p) -> None:
    """-v for run, triage and check alike: the summary's every finding with its full evidence
    and its source lines."""
    p.add_argument("-v", "--verbose", action="store_true",
                   help="text summary: list the info findings of a CLEAN verdict too (else one "
                        "line says how many), each finding's evidence in full, and the lines "
                        "of your code around its source line")
