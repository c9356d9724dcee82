"""What the full report costs: a default `tndebug run` with a plain session vs the full one.

    python bench/report_overhead.py                      # small preset, 400 steps, 2 pairs
    python bench/report_overhead.py --preset tiny --steps 60 --pairs 1   # a quick look

Both arms run the real trainer (`tndebug.train.run_training`, TrainConfig defaults: copy task,
400 steps, batch 64, probes all) in this one process, interleaved (plain, full, plain, full,
...) so that both see the same machine load:

* plain: `PlainSession`, what ReportSession was before the reporters: no sinks, no progress
  bar, report.json and one verdict line;
* full:  ReportSession() as `tndebug run` uses it: progress bar, the recorder, TensorBoard
  (scalars, histograms, images, layout, text, hparams), the PNG figures, report.md, the summary.

Two figures, written to bench/results/report_overhead.json:

* `overhead_wall`: median(full) / median(plain) - 1, whole runs (noisy on a shared machine);
* `overhead_direct`: the seconds spent inside the full session's own code (its sinks,
  `log_scalars`, progress, `finish`), timed around each call, over the plain run's median wall
  time. The report passes when `overhead_direct` <= 5%.

One torch thread by default: two threads on two busy shared cores spin and time nothing useful.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tndebug.reporters.session import ReportSession
from tndebug.train import TrainConfig, model_config, run_training

RESULT = Path(__file__).parent / "results" / "report_overhead.json"
LIMIT = 0.05


class PlainSession:
    """The interface with nothing behind it but report.json (the pre-reporters placeholder)."""

    def __init__(self, out_dir) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list = []
        self.clock = [0.0]
        self.report_seconds = 0.0

    @contextlib.contextmanager
    def progress(self, total, description="training"):
        class Bar:
            def update(self, done, **metrics):
                pass
        yield Bar()

    def log_scalars(self, step, scalars):
        pass

    def finish(self, report, fail_on="error"):
        t0 = time.perf_counter()
        report.write_json(self.out_dir / "report.json")
        print(f"verdict: {report.verdict} ({len(report.findings)} findings)")
        self.clock[0] += time.perf_counter() - t0
        return report.exit_code(fail_on)


class Timed:
    """Wraps a sink or bar and adds the seconds spent in its methods to `clock[0]`."""

    def __init__(self, inner, clock: list[float]) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._clock[0] += time.perf_counter() - t0
        return timed


class TimedSession(ReportSession):
    """A ReportSession that measures the time spent in itself."""

    def __init__(self, *a, **k) -> None:
        self.clock = [0.0]
        t0 = time.perf_counter()
        super().__init__(*a, **k)
        self.clock[0] += time.perf_counter() - t0
        self.sinks = [Timed(s, self.clock) for s in self.sinks]

    @contextlib.contextmanager
    def progress(self, total: int, description: str = "training"):
        with super().progress(total, description) as bar:
            yield Timed(bar, self.clock)

    def log_scalars(self, step, scalars):
        t0 = time.perf_counter()
        super().log_scalars(step, scalars)
        self.clock[0] += time.perf_counter() - t0

    def finish(self, report, fail_on="error"):
        t0 = time.perf_counter()
        try:
            return super().finish(report, fail_on)
        finally:
            self.clock[0] += time.perf_counter() - t0


def one_run(full: bool, preset: str, steps: int, probes: str, out: Path) -> dict:
    t0 = time.perf_counter()
    session = TimedSession(out, fmt="text") if full else PlainSession(out)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = run_training(model_config("copy", preset), TrainConfig(steps=steps),
                              probes=probes, session=session)
        session.finish(result.report)
    wall = time.perf_counter() - t0
    return {"arm": "full" if full else "plain", "wall_s": round(wall, 3),
            "session_s": round(session.clock[0], 3), "finish_s": round(session.report_seconds, 3),
            "status": result.report.run.get("status"), "findings": len(result.report.findings)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=TrainConfig().steps)
    ap.add_argument("--probes", default="all")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(False, "tiny", 5, args.probes, Path(tmp) / "warmup")      # imports, first calls
        for i in range(args.pairs):
            for full in (False, True):
                r = one_run(full, args.preset, args.steps, args.probes, Path(tmp) / f"{i}{full}")
                runs.append(r)
                print(json.dumps(r), file=sys.stderr)
    plain = statistics.median(r["wall_s"] for r in runs if r["arm"] == "plain")
    full = statistics.median(r["wall_s"] for r in runs if r["arm"] == "full")
    direct = statistics.median(r["session_s"] for r in runs if r["arm"] == "full")
    plain_direct = statistics.median(r["session_s"] for r in runs if r["arm"] == "plain")
    result = {
        "command": "python bench/report_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset, "steps": args.steps, "probes": args.probes, "pairs": args.pairs,
        "threads": args.threads, "load_average": [round(x, 2) for x in os.getloadavg()],
        "plain_wall_s": plain, "full_wall_s": full,
        "full_session_s": direct, "plain_session_s": plain_direct,
        "overhead_wall": round(full / plain - 1, 4),
        "overhead_direct": round((direct - plain_direct) / plain, 4),
        "limit": LIMIT, "ok": (direct - plain_direct) / plain <= LIMIT, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
