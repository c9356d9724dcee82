"""ReportSession: everything a command needs to show and save its results.

    session = ReportSession(out_dir, fmt="text", tensorboard=True)
    with session.progress(total_steps) as bar:      # rich progress on stderr
        ... bar.update(step, loss=..., lr=...)
    engine = ProbeEngine(probes, run, sinks=session.sinks)   # metrics and traces stream here
    session.log_scalars(step, {"train/loss": ...})
    code = session.finish(report, fail_on="error")           # in a `finally:` is fine

`finish` writes, in order: report.json, the figures (once), report.md, the TensorBoard text
and hparams; then prints the summary (`fmt` text: the findings table on stdout; json: the
report alone on stdout; md: report.md on stdout; everything else on stderr) and returns the
exit code. It is idempotent; `close()` only flushes and closes TensorBoard (also idempotent).
The report first gets every scalar the session recorded (`report.metrics`, unless it has its
own): what TensorBoard got, for `Report.metrics_frame()` and report.json.
Files: out_dir/report.json, report.md, figures/*.png, tb/events.out.tfevents.*
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from tndebug.report import Report
from tndebug.reporters import console
from tndebug.reporters.recorder import EVERY_UNIT, Recorder, plan_every, to_float

FORMATS = ("text", "json", "md")


class ReportSession:
    """Args:
        out_dir: where report.json, report.md, figures/ and tb/ go (created).
        fmt: what goes to stdout at the end: "text" | "json" | "md".
        tensorboard: write out_dir/tb (one SummaryWriter).
        figures: draw the PNGs at the end (the plots cost about a second).
        markdown: write report.md.
        tb_every: snapshot the probe batch (TensorBoard histograms and images, the figures'
            data) on the first probed step and every N steps; default about 20 per run.
        resume_step: the step a resumed run starts from: TensorBoard purges the events of
            the earlier run from there on (they were written after its last checkpoint).
        defer: write no file before `finish` (triage: a bad input leaves nothing behind):
            TensorBoard's input is held (`Deferred`) and replayed into tb/ at the end.
        echo: print the summary at the end (`tndebug.check(out=)` prints nothing).
        verbose: the summary as `-v` prints it (info findings of a CLEAN run too, the full
            evidence, the source lines around each finding's line).
    """

    def __init__(self, out_dir: str | Path, fmt: str = "text", tensorboard: bool = True, *,
                 figures: bool = True, markdown: bool = True, tb_every: int | None = None,
                 resume_step: int | None = None, defer: bool = False,
                 echo: bool = True, verbose: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        self.figures, self.markdown = figures, markdown
        self.echo = echo
        self.verbose = verbose
        self.tb_every = tb_every
        self.recorder = Recorder()
        self.tb = None
        self.held: Deferred | None = Deferred() if tensorboard and defer else None
        self._tb_args = {"heavy_every": tb_every, "purge_step": resume_step}
        if tensorboard and not defer:
            self._open_tensorboard()
        self.sinks: list = [self.recorder] + ([self.tb] if self.tb else []) + \
            ([self.held] if self.held else [])
        self.plots: list = []
        self.report_seconds = 0.0        # time spent in finish() (figures, files, printing)
        self._code: int | None = None

    # -- during the run -------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self, total: int, description: str = "training"):
        """A bar with `.update(done, **metrics)`; on stderr, plain lines when not a terminal.
        `total` also sets how often TensorBoard gets histograms and images (about 20 times)."""
        self.plan(total)
        with console.progress(total, description, console.make_console(stderr=True)) as bar:
            yield bar

    def plan(self, total: int | None) -> None:
        """How often the probe batch is snapshotted (TensorBoard histograms and images, the
        figures' data): about 20 times in a run of `total` steps; with `total` unknown (None),
        every 50 steps, the interval doubling each time the run passes 20 of them."""
        every = self.tb_every or (plan_every(total) if total else EVERY_UNIT)
        grow = not self.tb_every and not total
        final = total - 1 if total else None
        self.recorder.every, self.recorder.grow, self.recorder.final_step = every, grow, final
        if self.tb is not None:
            self.tb.heavy_every, self.tb.grow, self.tb.final_step = every, grow, final

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Training scalars (`train/loss`, `train/lr`, `eval/accuracy`): curves and TensorBoard."""
        values = {tag: to_float(v) for tag, v in scalars.items() if v is not None}   # one sync each
        self.recorder.log_scalars(step, values)
        if self.tb is not None:
            self.tb.log_scalars(step, values)
        if self.held is not None:
            self.held.log_scalars(step, values)

    def on_metric(self, step: int, tag: str, value: float) -> None:
        """A metric that does not come through a probe (same path as the probes' ones)."""
        for sink in self.sinks:
            sink.on_metric(step, tag, value)

    # -- the end --------------------------------------------------------------------------
    def finish(self, report: Report, fail_on: str = "error") -> int:
        """Write every file, print the summary, close TensorBoard; return the exit code."""
        if self._code is not None:
            return self._code
        t0 = time.perf_counter()
        report.run = relative_paths(report.run, self.out_dir)
        report.metrics = report.metrics or self.recorder.recorded()    # what TensorBoard got
        paths = {"report": str(self.out_dir / "report.json")}
        md = ""
        try:
            if self.figures:                      # drawn first: report.json lists them
                self.plots = _guarded("figures", self._draw, report) or []
            if self.held is not None:
                _guarded("TensorBoard", self._replay)
            report.write_json(self.out_dir / "report.json")
            md = _guarded("report.md", self._write_markdown, report, paths) or ""
            if self.tb is not None:
                _guarded("TensorBoard summary", self._write_tensorboard, report)
                paths["tensorboard"] = f"tensorboard --logdir {self.out_dir / 'tb'}"
        finally:
            self.close()
        self._code = report.exit_code(fail_on)
        if self.echo:
            self._print(report, md, paths)
        self.report_seconds += time.perf_counter() - t0
        return self._code

    def close(self) -> None:
        """Flush and close TensorBoard (safe to call twice, and after `finish`). For a run that
        ends without a Report; after it, `finish` still writes every file but TensorBoard's
        text and hparams."""
        if self.tb is not None:
            self.tb.close()

    def __enter__(self) -> "ReportSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- pieces ---------------------------------------------------------------------------
    def _write_markdown(self, report: Report, paths: dict) -> str:
        from tndebug.reporters import markdown
        md = markdown.render(report, self.plots)
        if self.markdown:
            (self.out_dir / "report.md").write_text(md)
            paths["markdown"] = str(self.out_dir / "report.md")
        return md

    def _draw(self, report: Report) -> list:
        """The figures (once), failed ones last; `run.figures` lists those drawn. A report that
        times its stages (triage's `timings_s`) gets this one too: `figures` (wall) and
        `figures_cpu` (this process's CPU seconds), the matplotlib import included."""
        t0, c0 = time.perf_counter(), time.process_time()
        from tndebug.reporters.plots import make_figures
        plots = make_figures(self.recorder, report, self.out_dir / "figures")
        for p in plots:
            if not p.name:
                print(f"tndebug: warning: {p.title}: {p.caption}", file=sys.stderr)
        plots = [p for p in plots if p.name] + [p for p in plots if not p.name]
        report.run = {**report.run, "figures": [p.to_dict() for p in plots if p.name]}
        if isinstance(report.run.get("timings_s"), dict):
            report.run["timings_s"] = {**report.run["timings_s"],
                                       "figures": round(time.perf_counter() - t0, 3),
                                       "figures_cpu": round(time.process_time() - c0, 3)}
        return plots

    def _open_tensorboard(self) -> None:
        from tndebug.reporters.tensorboard import TensorBoardSink   # TB only when asked
        self.tb = TensorBoardSink(self.out_dir / "tb", **self._tb_args)

    def _replay(self) -> None:
        """A deferred session's TensorBoard: opened now, shown what it was held."""
        held, self.held = self.held, None
        self._open_tensorboard()
        self.tb.final_step = self.recorder.final_step
        held.replay(self.tb)
        self.sinks = [s for s in self.sinks if s is not held] + [self.tb]

    def _write_tensorboard(self, report: Report) -> None:
        from tndebug.reporters import markdown
        from tndebug.reporters.common import counts
        c = counts(report)
        self.tb.write_summary(report.run, markdown.render(report, with_figures=False),
                              self.recorder.last_step,
                              {"findings_errors": c["error"], "findings_warnings": c["warning"]})

    def _print(self, report: Report, md: str, paths: dict) -> None:
        if self.fmt == "json":
            console.print_plain((self.out_dir / "report.json").read_text())   # byte for byte
            console.print_summary(report, console.make_console(stderr=True), paths, self.verbose)
        elif self.fmt == "md":
            console.print_plain(md)
            console.print_summary(report, console.make_console(stderr=True), paths, self.verbose)
        else:
            console.print_summary(report, console.make_console(), paths, self.verbose)


class Deferred:
    """A sink that holds what it is shown (metrics, traces, scalars) until `replay(sink)`.
    A trace's tensors are kept alive until then: one probed step (triage, check)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def on_metric(self, step: int, tag: str, value: float) -> None:
        self.calls.append(("on_metric", (step, tag, value)))

    def on_trace(self, step: int, trace) -> None:
        self.calls.append(("on_trace", (step, trace)))

    def log_scalars(self, step: int, scalars: dict) -> None:
        self.calls.append(("log_scalars", (step, dict(scalars))))

    def replay(self, sink) -> None:
        calls, self.calls = self.calls, []
        for name, args in calls:
            getattr(sink, name)(*args)


PATH_KEYS = ("checkpoint",)          # run keys that hold a file's path (`data` is a description)


def relative_paths(run: dict, out_dir: Path) -> dict:
    """`run` with its paths (PATH_KEYS) relative to the run directory (`checkpoint.pt`), so a
    report reads the same on another machine; a file outside it (triage's input) relative to
    the current directory when under it, else absolute."""
    out = dict(run)
    base, cwd = Path(out_dir).resolve(), Path.cwd().resolve()
    for key in PATH_KEYS:
        value = out.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).resolve()
        for root in (base, cwd):
            try:
                out[key] = str(path.relative_to(root))
                break
            except ValueError:
                continue
        else:
            out[key] = str(path)
    return out


def _guarded(what: str, fn, *args):
    """A reporter that fails costs its own output, never the report or the exit code."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        print(f"tndebug: warning: could not write {what}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
