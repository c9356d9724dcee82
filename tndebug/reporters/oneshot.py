"""Outputs of a one-pass diagnosis (`tndebug triage`, `tndebug.check(out=)`): report.json,
report.md, figures/ and tb/ from the one probed forward and backward, through ReportSession.

    with writing(out, overwrite=False, where="check") as session:     # refused before any work
        report = check(..., sinks=session.sinks)
        written(session, report)

Nothing is written before the report exists (the session is deferred): a bad input leaves no
file. tb/ never holds two runs: a previous triage's or check's events there (the directory's
old report.json says which) are replaced; a training run's tb/ is kept, and this diagnosis then
writes no TensorBoard events (a warning says so: pass another output directory).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from tndebug.errors import UsageError
from tndebug.outputs import LIBRARY, claim_output
from tndebug.report import Report
from tndebug.reporters.session import ReportSession

ONE_PASS_MODES = ("triage", "check")       # run.mode of the reports whose tb/ a rerun replaces


def previous_mode(d: Path) -> str | None:
    """run.mode of the report already in `d` (None: none, unreadable, or a training run's)."""
    try:
        return json.loads((Path(d) / "report.json").read_text()).get("run", {}).get("mode")
    except (OSError, ValueError, AttributeError):
        return None


def tensorboard_place(d: Path, previous: str | None) -> bool:
    """May this diagnosis write d/tb? Yes when tb/ holds no events, or a previous one-pass
    diagnosis's (removed now); no for a training run's (kept, with a warning)."""
    events = sorted((Path(d) / "tb").glob("events.out.tfevents.*"))
    if not events:
        return True
    if previous in ONE_PASS_MODES:
        for e in events:
            e.unlink()
        return True
    print(f"tndebug: warning: {Path(d) / 'tb'} holds another run's TensorBoard events (kept); "
          f"no TensorBoard written for this {previous or 'diagnosis'}: use another output "
          f"directory to get one", file=sys.stderr)
    return False


@contextlib.contextmanager
def writing(out, *, overwrite: bool, where: str, figures: bool = True, tensorboard: bool = True,
            fmt: str = "text", echo: bool = False):
    """Claim `out` by tndebug/outputs.py's rule (library wording: out=, overwrite=True),
    then yield a deferred ReportSession whose `sinks` go to the probed pass."""
    if not isinstance(out, (str, Path)):
        raise UsageError(f"{where}: out={out!r}; expected a directory path (str or Path)")
    prev = previous_mode(Path(out)) if overwrite else None
    try:
        with claim_output(str(out), str(out), overwrite=overwrite, kind="triage",
                          names=LIBRARY) as d:
            tb = tensorboard and tensorboard_place(d, prev)
            yield ReportSession(d, fmt=fmt, tensorboard=tb, figures=figures, defer=True,
                                echo=echo)
    except UsageError as e:
        if str(e).startswith(f"{where}:"):
            raise
        raise UsageError(f"{where}: {e}") from None


def written(session: ReportSession, report: Report) -> Report:
    """Write every file of `report` (the exit code is the caller's business); return it."""
    session.finish(report, fail_on="never")
    return report
