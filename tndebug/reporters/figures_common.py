"""What every figure module shares: the `Plot` record, the attention-kind names, and the
drawing helpers (matplotlib's Agg canvas; no pyplot, no global backend switch). `save` is the
one place a figure becomes a PNG (tests replace it to read the Figure object itself)."""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation

from tndebug.reporters.recorder import TraceSnapshot

DPI = 100
KIND_TITLE = {"enc_self": "encoder self-attention", "dec_self": "decoder self-attention",
              "cross": "cross-attention (decoder queries, encoder keys)"}
KIND_SHORT = {"enc_self": "encoder self", "dec_self": "decoder self", "cross": "cross"}
STACK_COLOR = {"encoder": "tab:blue", "decoder": "tab:orange", "embed": "tab:gray"}


@dataclass
class Plot:
    name: str          # file name under fig_dir, e.g. "entropy.png"; "" for a figure that failed
    title: str         # a heading for the report
    caption: str       # one sentence: what is drawn and from which data
    findings: tuple[int, ...] = ()    # indices into report.findings it illustrates (report.md
    #                                   shows it next to the first of them; else under Figures)
    labels: dict = field(default_factory=dict)   # axis -> its label, read from the Figure drawn

    def to_dict(self) -> dict:
        """What report.json's `run.figures` lists."""
        return {"file": f"figures/{self.name}", "title": self.title, "caption": self.caption,
                "findings": list(self.findings)}


def notes_sentence(notes: dict[str, str]) -> str:
    """` Encoder self: no finite data after step 20.` for the panels that have a note."""
    by: dict[str, list[str]] = {}
    for panel, note in notes.items():
        if note:
            by.setdefault(note, []).append(panel)
    return "".join(f" {', '.join(p)}: {n}." for n, p in by.items())


def valid_rows(probs: torch.Tensor, snap: TraceSnapshot, kind: str):
    """probs with non-finite rows zeroed, and which query rows are real tokens whose rows are
    finite in every head (a NaN row is left out, never drawn as 0).  -> [b,h,T,S], [b,T]"""
    b, _, T, _ = probs.shape
    tokens = snap.src if kind == "enc_self" else snap.tgt
    if tokens is not None and tokens.shape[0] >= b and tokens.shape[1] == T:
        valid = tokens[:b] != snap.pad_id
    else:
        valid = torch.ones(b, T, dtype=torch.bool)
    valid = valid & torch.isfinite(probs).all(-1).all(1)
    p = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    return p, valid


def save(fig: Figure, path: Path) -> None:
    """PNG with light compression: encoding was a third of the drawing time at the default."""
    fig.savefig(path, pil_kwargs={"compress_level": 2})


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while the figures are drawn, then one young-generation pass.

    Matplotlib builds tens of thousands of long-lived objects per figure (artists, ticks,
    transforms), which set off ~170 collections per set of figures, each walking the survivors
    again: a fifth of the drawing time (base preset). Paused, their garbage (a figure's
    reference cycles) is collected once at the end, from the young generation only: the
    objects made while drawing, not the process's model and imports."""
    if not gc.isenabled():                  # the caller's choice: leave it so
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


def axis_labels(fig: Figure) -> dict:
    """{"<panel>.x"/"<panel>.y": label} of every labelled axes of `fig` (colorbars included):
    what a Plot records, so a test can check each figure has labelled axes."""
    out = {}
    for i, ax in enumerate(fig.axes):
        for which, text in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if text:
                out[f"{i}.{which}"] = text
    return out



def add_colorbar(fig: Figure, im, label: str, **adjust) -> None:
    """Axes first, then a colorbar in its own strip on the right (never over a panel)."""
    w = fig.get_figwidth()
    right = 1 - 1.25 / w                            # leave 1.25 in for the bar and its label
    fig.subplots_adjust(right=right, **adjust)
    top, bottom = adjust.get("top", 0.88), adjust.get("bottom", 0.12)
    cax = fig.add_axes((right + 0.25 / w, bottom, 0.15 / w, top - bottom))
    fig.colorbar(im, cax=cax, label=label)


SUPERSCRIPT = str.maketrans("0123456789-", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b")


class PlainLogFormatter(LogFormatterSciNotation):
    """matplotlib's log-axis labels (`3×10⁻²`, the same ticks labelled), as plain text with
    superscript digits, not mathtext: each mathtext label is parsed anew for every figure
    (the parse cache is the renderer's), a third of depth.png's drawing time."""

    def __call__(self, x, pos=None):
        s = super().__call__(x, pos)
        if not s.startswith("$\\mathdefault{"):
            return s
        s = s.removeprefix("$\\mathdefault{").removesuffix("}$").replace("\\times", "\u00d7")
        head, _, exp = s.partition("^{")
        return head.replace("-", "\u2212") + exp.removesuffix("}").translate(SUPERSCRIPT)


def log_scale(ax, axis: str = "y") -> None:
    """A log axis (base 10) whose labels are plain text (PlainLogFormatter)."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    which = ax.yaxis if axis == "y" else ax.xaxis
    for fmt, setter in ((which.get_major_formatter(), which.set_major_formatter),
                        (which.get_minor_formatter(), which.set_minor_formatter)):
        setter(PlainLogFormatter(10.0, labelOnlyBase=fmt.labelOnlyBase,
                                 minor_thresholds=fmt.minor_thresholds))


def block_grid(blocks: list[list[np.ndarray]], gap: int = 1) -> np.ndarray:
    """Rows of equal-sized 2-D blocks into one array, NaN (drawn white) between them."""
    h = max(b.shape[0] for row in blocks for b in row)
    w = max(b.shape[1] for row in blocks for b in row)
    n_cols = max(len(row) for row in blocks)
    out = np.full((len(blocks) * (h + gap) - gap, n_cols * (w + gap) - gap), np.nan)
    for i, row in enumerate(blocks):
        for j, b in enumerate(row):
            out[i * (h + gap):i * (h + gap) + b.shape[0], j * (w + gap):j * (w + gap) + b.shape[1]] = b
    return out


def set_ticks(ax, nx: int, ny: int, xlabel: str, ylabel: str) -> None:
    ax.set_xticks(range(nx), [f"{xlabel[0]}{i}" if xlabel == "head" else str(i) for i in range(nx)])
    ax.set_yticks(range(ny), [f"h{i}" if ylabel == "head" else str(i) for i in range(ny)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def annotate_cells(ax, mat: np.ndarray, im, fmt: str = "{:.2f}") -> None:
    if mat.size > 400:
        return
    lo, hi = im.get_clim()
    for (i, j), v in np.ndenumerate(mat):
        if not np.isfinite(v):
            continue
        dark = (v - lo) / ((hi - lo) or 1) < 0.55
        ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                color="white" if dark else "black")
