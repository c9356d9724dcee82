"""The terminal: a progress bar on stderr while training, and the summary at the end.

The only module that imports rich. Readable without colour (NO_COLOR, pipes, CI logs):
severity is a word (ERROR / WARN / INFO), and when stderr is not a terminal the progress
bar becomes a plain line every tenth of the run.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TextIO

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, \
    TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from tndebug.capture.source import also_text, excerpt, source_text
from tndebug.report import Report
from tndebug.reporters.common import SEVERITY_WORD, VERDICT_WORD, break_at_dots, \
    first_sign_text, fmt_value, full_evidence, group_where_text, places_text, probe_groups, \
    sorted_groups, status_text, incomplete_text, unchecked_text, where_text
from tndebug.reporters.summary_text import console_evidence, partly_checked, result_text, \
    rows_counts_text, same_reason_together, shape_text, shown_groups

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
VERDICT_STYLE = {"clean": "bold green", "warnings": "bold yellow", "errors": "bold red",
                 "unchecked": "bold magenta", "incomplete": "bold magenta"}
PLAIN_WIDTH = 160            # not a terminal (CI logs, pipes): rich's 80 columns squeeze the table
BAR_NARROW = 140             # below it the progress bar drops %, time left, the metrics that do not fit


def make_console(file: TextIO | None = None, *, stderr: bool = False) -> Console:
    """A Console on `file` (default: the current stdout/stderr); colour only on a terminal."""
    file = file or (sys.stderr if stderr else sys.stdout)
    tty = hasattr(file, "isatty") and file.isatty()
    width = None if tty or os.environ.get("COLUMNS") else PLAIN_WIDTH
    return Console(file=file, width=width, highlight=False, soft_wrap=False)


# -- progress ----------------------------------------------------------------------------
def _fmt_metric(v) -> str:
    try:
        return fmt_value(float(v.item() if hasattr(v, "item") else v))
    except (TypeError, ValueError):
        return str(v)


class ProgressBar:
    """`update(done, loss=..., lr=...)` with `done` the steps completed so far (the trainer
    passes `step + 1`); it is clipped to `total`. Metrics that are None are not shown.

    Metric values may be tensors; they are read only when shown (a few times a second on a
    terminal, every tenth of the run otherwise), so the bar does not force a sync per step.
    """

    def __init__(self, total: int, description: str, console: Console) -> None:
        self.total, self.description, self.console = max(int(total), 0), description, console
        self.live = console.is_terminal
        self.metrics: dict = {}
        self.done = 0
        self.t0 = time.perf_counter()
        self._next_line = 0
        self._printed = 0
        self._progress: Progress | None = None
        self._task = None
        self.info_width: int | None = None      # room for the metrics on a narrow terminal

    def _rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.done / dt if dt > 0 else 0.0

    def fields(self, width: int | None = None) -> str:
        """`loss 1.02  lr 0.001  2.2 step/s`; with `width`, metrics dropped from the end (the
        rate first) until it fits, never cut mid-number."""
        parts = [f"{k} {_fmt_metric(v)}" for k, v in self.metrics.items()]
        parts.append(f"{self._rate():.1f} step/s")
        if width is not None:
            while len(parts) > 1 and len("  ".join(parts)) > width:
                parts.pop()
        return "  ".join(parts) if width is None or len("  ".join(parts)) <= width else ""

    def _columns(self) -> list:
        """The bar's columns for this console's width: below BAR_NARROW columns a short bar, the
        count, the elapsed time and the metrics that fit (no column squeezed into `…`)."""
        width = self.console.width
        n = len(str(self.total or 0))
        if width >= BAR_NARROW:
            self.info_width = None
            return [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TaskProgressColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}")]
        bar = 10 if width >= 60 else 5
        fixed = len(self.description) + 1 + bar + 1 + (2 * n + 1) + 1 + 7 + 1
        self.info_width = max(0, width - fixed - 1)
        return [TextColumn("[bold]{task.description}"), BarColumn(bar_width=bar),
                MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]

    def __enter__(self) -> "ProgressBar":
        if self.live:
            self._progress = Progress(*self._columns(), console=self.console,
                                      refresh_per_second=4, transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total or None,
                                                 info="")
        return self

    def update(self, done: int, **metrics) -> None:
        self.done = min(done, self.total) if self.total else done
        self.metrics.update({k: v for k, v in metrics.items() if v is not None})
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, info=_LazyFields(self))
        elif self.done >= self._next_line or self.done == self.total:
            self._line()

    def _line(self) -> None:
        every = max(1, self.total // 10) if self.total else 100
        self._next_line = (self.done // every + 1) * every
        self._printed = self.done
        of = f"/{self.total}" if self.total else ""
        self.console.print(f"{self.description}: step {self.done}{of}  {self.fields()}",
                           markup=False)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None
        elif self.done and self._printed < self.done:      # interrupted between two lines
            self._line()


class _LazyFields:
    """Renders the bar's metrics when rich draws, not when the trainer updates."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar

    def __format__(self, spec: str) -> str:
        return self.bar.fields(self.bar.info_width)

    def __str__(self) -> str:
        return self.bar.fields(self.bar.info_width)


@contextlib.contextmanager
def progress(total: int, description: str = "training", console: Console | None = None):
    bar = ProgressBar(total, description, console or make_console(stderr=True))
    with bar:
        yield bar


# -- the summary -------------------------------------------------------------------------
WIDE = 140                   # from this width on, message / evidence / fix get their own columns
NARROW = 100                 # below it, the place goes on the message's first line, not a column
WHERE_WIDTH = 30             # the where column; paths break only at dots
PLACES_SHOWN = 6             # places of a group listed in the terminal; all are in report.md


def source_block(f, verbose: bool) -> Text | None:
    """`source: FILE:LINE (Class.method): code` and the finding's other lines (`also ...`);
    with `-v` the code goes with the lines around it below the table (`source_excerpts`), where
    a table column cannot break it inside a name."""
    if not f.source:
        return None
    out = Text()
    shown = {**f.source, "code": ""} if verbose and f.source.get("line") else f.source
    out.append("source: ", style="bold").append(source_text(shown))
    for line in also_text(f.source):
        out.append("\n" + line, style="dim")
    return out


def source_excerpts(report: Report, width: int) -> list[Text]:
    """-v: for each finding shown with a source line, the lines of the user's file around it,
    numbered, dedented, the line itself marked `>`, each row within `width` (a long line goes
    on at a space: never broken inside a token)."""
    out = []
    for _, fs in shown_groups(report, True):
        src = fs[0].source
        if not src or not src.get("file") or not src.get("line"):
            continue
        text = Text()
        text.append(f"{fs[0].probe}: ", style="bold").append(source_text({**src, "code": ""}))
        for mine, row in excerpt(src, width - 1):
            text.append("\n" + row, style="bold" if mine else "dim")
        out.append(text)
    return out


def findings_table(report: Report, width: int = PLAIN_WIDTH, verbose: bool = True) -> Table:
    """One row per group of findings (one defect in several modules is one row, its places
    listed): severity, probe, where, step, message, evidence, fix on a wide console; on a
    narrower one message, evidence and fix stack in one column, and below NARROW columns the
    place moves into that column too. `verbose` (`-v`): every item of the evidence, and the
    source line with the lines around it."""
    t = Table(box=box.SIMPLE_HEAD, show_lines=False, expand=False, pad_edge=False)
    t.add_column("severity", no_wrap=True)
    t.add_column("probe", no_wrap=True)
    narrow, wide = width < NARROW, width >= WIDE
    if not narrow:
        t.add_column("where", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    if wide:
        t.add_column("message", overflow="fold", ratio=3)
        t.add_column("evidence", overflow="fold", ratio=2)
        t.add_column("fix", overflow="fold", ratio=3)
    else:
        t.add_column(("where / " if narrow else "") + "message / evidence / fix", overflow="fold")
    for group, fs in shown_groups(report, verbose):
        f = fs[0]
        many = len({where_text(x) for x in fs}) > 1
        cells = [Text(SEVERITY_WORD[f.severity], style=SEVERITY_STYLE[f.severity]), f.probe]
        if not narrow:
            cells.append(break_at_dots(group_where_text(fs), WHERE_WIDTH))
        cells.append("" if group.step is None else str(group.step))
        evidence = full_evidence(f, "\n" if wide else ", ") if verbose else \
            console_evidence(f, "\n" if wide else ", ")
        if many:
            evidence = f"({where_text(f)}) {evidence}" if evidence else ""
        places = f"{group_where_text(fs)}: {places_text(fs, PLACES_SHOWN)}" if many else ""
        message = Text(f.message)
        if many and not narrow:
            message.append("\nin ", style="bold").append(places)
        source = source_block(f, verbose)
        if wide:
            if source:
                message.append("\n").append(source)
            cells += [message, evidence, f.fix]
        else:
            body = Text()
            said = not many and f.where and f.message.startswith(f.where + ":")   # once
            if narrow and not said:
                body.append("where: ", style="bold").append(places if many else where_text(f))
                body.append("\n")
            body.append(message)
            if source:
                body.append("\n").append(source)
            if evidence:
                body.append("\nevidence: ", style="bold").append(evidence)
            if f.fix:
                body.append("\nfix: ", style="bold").append(f.fix)
            cells.append(body)
        t.add_row(*cells)
    return t


def summary(report: Report, paths: dict[str, str] | None = None, width: int = PLAIN_WIDTH,
            verbose: bool = False) -> Group:
    """The end-of-run summary: verdict, status, first sign, findings, probes, files. With a
    CLEAN verdict the info findings are one line unless `verbose`; the headline counts the
    table's rows (one per group of findings)."""
    parts = []
    head = Text()
    head.append("verdict: ", style="bold")
    head.append(VERDICT_WORD[report.verdict], style=VERDICT_STYLE[report.verdict])
    head.append(f"  ({rows_counts_text(report)})")
    parts.append(head)
    achieved = result_text(report)
    if achieved:
        parts.append(Text(achieved))
    shape = shape_text(report)
    if shape:
        parts.append(Text(shape))
    unchecked = unchecked_text(report)
    if unchecked:
        parts.append(Text(f"UNCHECKED: {unchecked}", style="bold"))
    missing = incomplete_text(report)
    if missing:
        parts.append(Text(f"NOT CHECKED: {missing}", style="bold"))
    codes = report.run.get("codes") or {}
    if codes.get("dropped"):
        how = "; ".join(f"--{k} {','.join(v)}" for k, v in codes.items() if k != "dropped" and v)
        parts.append(Text(f"{codes['dropped']} finding{'s' * (codes['dropped'] != 1)} left out "
                          f"({how})"))
    stopped = status_text(report)
    sign = first_sign_text(report)
    if stopped or sign:
        body = Text()
        if stopped:
            body.append(f"RUN {stopped}\n", style="bold red")
        if sign:
            body.append("first sign: ", style="bold")
            body.append(sign)
        parts.append(Panel(body, box=box.HEAVY, border_style="red", expand=False))
    shown = shown_groups(report, verbose)
    if shown:
        parts.append(findings_table(report, width, verbose))
        if verbose:
            parts.extend(source_excerpts(report, width))
    notes = len(sorted_groups(report)) - len(shown)
    if notes:
        where = "see report.md" if paths else "-v shows them"
        parts.append(Text(f"{notes} note{'s' * (notes != 1)}: {where}"))
    elif not report.findings:
        parts.append(Text("no findings"))
    groups = probe_groups(report)
    for status, label, style in (("fail", "failed", "red"), ("warn", "warned", "yellow"),
                                 ("pass", "passed", "green")):
        if groups.get(status):
            line = Text(f"probes {label} ({len(groups[status])}): ", style=style)
            line.append(", ".join(n for n, _ in groups[status]), style="default")
            parts.append(line)
    for status, label, word, style in (("internal error", "probes that raised (a tndebug bug: please "
                                        "report it)", "INTERNAL ERROR", "red"),
                                       ("no verdict", "probes with no verdict", "NO VERDICT", "magenta"),
                                       ("partial", "partly checked", "", "dim"),
                                       ("skipped", "probes skipped", "SKIPPED", "dim")):
        rows = partly_checked(report) if status == "partial" else groups.get(status, [])
        count = len(rows)
        if status == "skipped":
            rows = same_reason_together(rows)
        if rows:
            parts.append(Text(f"{label} ({count}):", style=style))
            parts.append(_reasons(rows, word))
    for label, path in (paths or {}).items():
        parts.append(Text(f"{label}: {path}", style="dim"))
    return Group(*parts)


def _reasons(rows: list[tuple[str, str]], word: str) -> Table:
    """`  WORD probe: reason`, the reason wrapping under itself (a hanging indent)."""
    t = Table.grid(padding=(0, 1))
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    for name, reason in rows:
        t.add_row(f"  {word + ' ' if word else ''}{name}:", reason or "no reason given")
    return t


def print_summary(report: Report, console: Console, paths: dict[str, str] | None = None,
                  verbose: bool = False) -> None:
    console.print(summary(report, paths, console.width, verbose))


def print_plain(text: str, file: TextIO | None = None) -> None:
    """JSON or Markdown on stdout, exactly as given (no rich wrapping or markup)."""
    file = file or sys.stdout
    file.write(text if text.endswith("\n") else text + "\n")
    file.flush()
