"""ReportSession: everything a command needs to show and save its results.

    session = ReportSession(out_dir, fmt="text", tensorboard=True)
    with session.progress(total_steps) as bar:      # rich progress on stderr
        ... bar.update(step, loss=..., lr=...)
    engine = ProbeEngine(probes, run, sinks=session.sinks)   # metrics and traces stream here
    session.log_scalars(step, {"train/loss": ...})
    code = session.finish(report, fail_on="error")           # writes report.json/.md, TB, prints

(Placeholder: writes report.json only. The reporters issue fills in console, markdown, plots
and TensorBoard behind this same interface.)
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from tndebug.report import Report


class _NullBar:
    def update(self, step: int, **metrics) -> None:
        pass


class ReportSession:
    def __init__(self, out_dir: str | Path, fmt: str = "text", tensorboard: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        self.sinks: list = []

    @contextlib.contextmanager
    def progress(self, total: int, description: str = "training"):
        yield _NullBar()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def finish(self, report: Report, fail_on: str = "error") -> int:
        report.write_json(self.out_dir / "report.json")
        if self.fmt == "json":
            print(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            print(f"verdict: {report.verdict} ({len(report.findings)} findings)", file=sys.stdout)
        return report.exit_code(fail_on)
