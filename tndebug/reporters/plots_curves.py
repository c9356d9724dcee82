"""Loss, learning-rate and evaluation curves of a training run (`figure_curves`)."""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tndebug.report import Report
from tndebug.reporters import figures_common as C
from tndebug.reporters.common import run_status
from tndebug.reporters.figures_common import DPI, Plot, notes_sentence
from tndebug.reporters.recorder import Recorder


def figure_curves(rec: Recorder, report: Report, fig_dir: Path) -> Plot | None:
    scalars = dict(rec.scalars)
    history = report.history or {}
    steps = history.get("step")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr")):   # the trainer's own history:
        h = history.get(key)                                        # every step, not every 10th
        if h:
            xs = steps if steps and len(steps) == len(h) else range(len(h))
            scalars[tag] = [(int(x), float(y)) for x, y in zip(xs, h) if y is not None]
    losses = {t: s for t, s in scalars.items() if t.endswith("loss") and s}
    lrs = {t: s for t, s in scalars.items() if t.endswith("/lr") and s}
    others = {t: s for t, s in scalars.items() if t.startswith("eval/") and t not in losses and s}
    finals = {t: s[-1][1] for t, s in others.items() if len(s) < 2}   # one point: a number, not a line
    others = {t: s for t, s in others.items() if t not in finals}
    if not losses and not lrs:
        return None
    panels = [(label, data) for label, data in (("loss", losses), ("learning rate", lrs),
                                                ("evaluation", others)) if data]
    fig = Figure(figsize=(4.2 * len(panels), 3.6), dpi=DPI)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    marks = _step_marks(report)
    all_steps = [x for _, data in panels for s in data.values() for x, _ in s]
    lo, hi = min(all_steps + [m[0] for m in marks]), max(all_steps + [m[0] for m in marks])
    notes: dict[str, str] = {}
    for ax, (label, data) in zip(axes, panels):
        finite = []
        for tag, series in sorted(data.items()):
            pts = [(x, y) for x, y in series if math.isfinite(y)]      # plot what is finite
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=tag, marker="." if len(xs) < 30 else None)
                finite += ys
            last_finite = pts[-1][0] if pts else None
            if len(pts) < len(series):
                after = [x for x, y in series if not math.isfinite(y)]
                notes[tag] = (f"no finite data after step {last_finite}" if last_finite is not None
                              and max(after) > last_finite else
                              (f"no finite data (step {min(after)})" if min(after) == max(after)
                               else f"no finite data (steps {min(after)}-{max(after)})")
                              if last_finite is None else
                              f"{len(series) - len(pts)} non-finite values left out")
        if label != "evaluation" and finite and min(finite) > 0 and max(finite) / min(finite) > 30:
            C.log_scale(ax, "y")
        else:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))   # short tick labels
        ax.set_xlim(lo - 0.5 - 0.02 * (hi - lo), hi + 0.5 + 0.02 * (hi - lo))
        for i, (step, text, color) in enumerate(_merge_marks(marks, hi - lo)):
            ax.axvline(step, color=color, linestyle="--", linewidth=1)
            ax.text(step, 0.98, f" {text}", color=color, fontsize=7, rotation=90,
                    va="top", ha="right" if i % 2 == 0 else "left",
                    transform=ax.get_xaxis_transform())
        said = [notes[t] for t in sorted(data) if t in notes]
        if not finite:
            ax.text(0.5, 0.3, "\n".join(said) or "no finite data", ha="center", va="center",
                    transform=ax.transAxes, color="gray", fontsize=9,
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9})
            ax.set_yticks([])
        elif said:
            ax.text(0.02, 0.02, "\n".join(said), transform=ax.transAxes, ha="left", va="bottom",
                    fontsize=7, color="tab:red")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))   # steps, not -0.4
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        title = label.capitalize()
        if label == "loss" and finals:
            title += "\n" + ", ".join(f"{t.removeprefix('eval/')} {v:.4g}" for t, v in finals.items())
        # y=1.0: the title where matplotlib puts it, without its search for an overlap (a
        # tenth of the drawing); kept for a long title over a y offset text (`1e-3`)
        ax.set_title(title, fontsize=10 if "\n" not in title else 8,
                     y=1.0 if "\n" not in title or ax.get_yscale() == "log" else None)
        ax.grid(alpha=0.3)
        if finite:
            ax.legend(fontsize=7, loc="best")
    w = fig.get_figwidth()
    fig.subplots_adjust(left=0.8 / w, right=1 - 0.15 / w, top=0.86, bottom=0.15, wspace=0.4)
    C.save(fig, fig_dir / "curves.png")
    return Plot("curves.png", "Loss and learning rate",
                "Training (and evaluation) curves as logged, finite values only; dashed lines "
                "mark the first sign a probe saw and where the run stopped."
                + notes_sentence(notes), labels=C.axis_labels(fig))


def _merge_marks(marks: list[tuple[int, str, str]], span: int) -> list[tuple[int, str, str]]:
    """Marks closer than 4% of the x range share one line and one label (no overprinting)."""
    out: list[tuple[int, str, str]] = []
    for step, text, color in sorted(marks):
        if out and step - out[-1][0] <= max(1, 0.04 * span):
            out[-1] = (out[-1][0], f"{out[-1][1]} / {text}", out[-1][2])
        else:
            out.append((step, text, color))
    return out


def _step_marks(report: Report) -> list[tuple[int, str, str]]:
    marks = []
    if report.first_sign is not None and report.first_sign.step is not None:
        marks.append((report.first_sign.step, f"first sign: {report.first_sign.probe}", "tab:red"))
    status, step = run_status(report)
    if status != "completed" and step is not None:
        marks.append((step, status, "black"))
    return marks
