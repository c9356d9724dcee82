"""`tndebug probes`: the probes, with what each checks and when it runs."""
from __future__ import annotations

from tndebug.probes import PROBE_NAMES


def add_parser(sub) -> None:
    p = sub.add_parser("probes", help="list the probes (--probe NAME) and what each checks",
                       description="The probes that `tndebug run --probe` and `tndebug triage` attach. "
                                   "--codes lists the kind of every finding each can report, "
                                   "as `--select` / `--ignore` take them.")
    p.add_argument("--codes", action="store_true",
                   help="list every finding code (probe/kind) with its meaning")
    p.set_defaults(func=main)


def main(args) -> int:
    from tndebug.probes import probe_class           # the probes import torch: not in the parser
    from tndebug.probes.codes import all_codes
    if getattr(args, "codes", False):
        for code, meaning in all_codes():
            print(f"{code:<42}  {meaning}")
        return 0
    width = max(map(len, PROBE_NAMES))
    for name in PROBE_NAMES:
        cls = probe_class(name)
        print(f"{name:<{width}}  {cls.summary}  ({when(cls.default_schedule().__doc__)})")
    return 0


def when(doc: str) -> str:
    """A schedule's doc as a phrase: 'never' (no training step; the setup tests only) reads
    'at setup only', 'every 1 steps' reads 'every step'."""
    if doc == "never":
        return "at setup only"
    return "runs " + doc.replace("every 1 steps", "every step")
