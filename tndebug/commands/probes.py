"""`tndebug probes`: the probes, with what each checks and when it runs."""
from __future__ import annotations

from tndebug.probes import PROBE_NAMES, probe_class


def add_parser(sub) -> None:
    p = sub.add_parser("probes", help="list the probes (--probe NAME) and what each checks",
                       description="The probes that `tndebug run --probe` and `tndebug triage` attach.")
    p.set_defaults(func=main)


def main(args) -> int:
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
