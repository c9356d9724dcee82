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

Three figures, written to bench/results/report_overhead.json:

* `overhead_wall`: median(full) / median(plain) - 1, whole runs (noisy on a shared machine);
* `overhead_direct`: the wall seconds spent inside the full session's own code (its sinks,
  `log_scalars`, the progress bar, `finish`), timed around each call, over the plain run's
  median wall time;
* `overhead_cpu`: the same with process CPU seconds (`time.process_time`, which also counts
  TensorBoard's writer thread while a session call runs) over the plain run's CPU seconds. On a
  machine shared with other jobs wall time mostly measures the others; CPU time does not.
  The report passes when `overhead_cpu` <= 5% (`ok`).

One torch thread by default: two threads on two busy shared cores spin and time nothing useful.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from tndebug.probes.budget import DEFAULT_FRACTION  # noqa: E402
from tndebug.reporters.session import ReportSession  # noqa: E402
from tndebug.train import TrainConfig, model_config, run_training  # noqa: E402

RESULT = Path(__file__).parent / "results" / "report_overhead.json"
LIMIT = 0.05


class PlainSession:
    """The interface with nothing behind it but report.json (the pre-reporters placeholder)."""

    def __init__(self, out_dir) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list = []
        self.clock = [0.0, 0.0]
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
        with ticking(self.clock):
            report.write_json(self.out_dir / "report.json")
            print(f"verdict: {report.verdict} ({len(report.findings)} findings)")
        return report.exit_code(fail_on)


@contextlib.contextmanager
def ticking(clock: list[float]):
    """Adds wall seconds to clock[0] and CPU seconds to clock[1]."""
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        clock[0] += time.perf_counter() - w0
        clock[1] += time.process_time() - c0


class Timed:
    """Wraps a sink or bar and adds the time spent in its methods to the clock."""

    def __init__(self, inner, clock: list[float]) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*a, **k):
            with ticking(self._clock):
                return attr(*a, **k)
        return timed


class TimedSession(ReportSession):
    """A ReportSession that measures the time spent in itself."""

    def __init__(self, *a, **k) -> None:
        self.clock = [0.0, 0.0]
        with ticking(self.clock):
            super().__init__(*a, **k)
        self.sinks = [Timed(s, self.clock) for s in self.sinks]

    @contextlib.contextmanager
    def progress(self, total: int, description: str = "training"):
        with super().progress(total, description) as bar:
            yield Timed(bar, self.clock)

    def log_scalars(self, step, scalars):
        with ticking(self.clock):
            super().log_scalars(step, scalars)

    def finish(self, report, fail_on="error"):
        with ticking(self.clock):
            return super().finish(report, fail_on)


def one_run(full: bool, preset: str, steps: int, probes: str, out: Path) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    session = TimedSession(out, fmt="text") if full else PlainSession(out)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = run_training(model_config("copy", preset),      # `tndebug run`'s probe budget
                              TrainConfig(steps=steps, probe_budget=DEFAULT_FRACTION),
                              probes=probes, session=session)
        session.finish(result.report)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"arm": "full" if full else "plain", "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "session_s": round(session.clock[0], 3), "session_cpu_s": round(session.clock[1], 3),
            "finish_s": round(session.report_seconds, 3),
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
    prov = Provenance.start(__file__, argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(False, "tiny", 5, args.probes, Path(tmp) / "warmup")      # imports, first calls
        for i in range(args.pairs):
            for full in (False, True):
                r = one_run(full, args.preset, args.steps, args.probes, Path(tmp) / f"{i}{full}")
                runs.append(r)
                print(json.dumps(r), file=sys.stderr)
    def med(arm, key):
        return statistics.median(r[key] for r in runs if r["arm"] == arm)
    plain, full = med("plain", "wall_s"), med("full", "wall_s")
    direct, plain_direct = med("full", "session_s"), med("plain", "session_s")
    cpu = (med("full", "session_cpu_s") - med("plain", "session_cpu_s")) / med("plain", "cpu_s")
    pairs = [round((f["session_cpu_s"] - p["session_cpu_s"]) / p["cpu_s"], 4)        # each pair's own
             for p, f in zip(runs[0::2], runs[1::2])]
    result = {
        "provenance": prov.finish(),
        "preset": args.preset, "steps": args.steps, "probes": args.probes, "pairs": args.pairs,
        "threads": args.threads,
        "plain_wall_s": plain, "full_wall_s": full,
        "full_session_s": direct, "plain_session_s": plain_direct,
        "overhead_wall": round(full / plain - 1, 4),
        "overhead_direct": round((direct - plain_direct) / plain, 4),
        "plain_cpu_s": med("plain", "cpu_s"), "full_session_cpu_s": med("full", "session_cpu_s"),
        "overhead_cpu": round(cpu, 4), "overhead_cpu_pairs": pairs, "limit": LIMIT,
        # met only when every pair is: a spread that crosses the limit is not met
        "ok": max(pairs) <= LIMIT, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
