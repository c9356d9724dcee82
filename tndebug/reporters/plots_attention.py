"""Attention maps of the probe batch (one figure per attention kind); the token labels on their
axes. (TensorBoard's image of one attention site: reporters/attention_image.py.)"""
from __future__ import annotations

import functools
import math
import unicodedata
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from tndebug.reporters import figures_common as C
from tndebug.reporters.figures_common import DPI, KIND_TITLE, Plot, add_colorbar
from tndebug.reporters.recorder import Recorder, TraceSnapshot

LABEL_CELL = 0.11            # inches per cell from which every token gets a tick label


def figure_attention_maps(rec: Recorder, kind: str, fig_dir: Path,
                          example: int | None = None) -> Plot | None:
    """Layers (rows) x heads (columns) of one example's attention at one step, tiled into one
    image (one axes: a 6 x 8 model drew 48 axes and their ticks in ~1 s a figure), the queries'
    tokens down the side of each layer's row and the keys' under each head's column; NaN/Inf
    cells in magenta."""
    snap, note = rec.attention_snapshot()
    recs = sorted((a for a in (snap.attention if snap else []) if a.kind == kind),
                  key=lambda a: a.layer or 0)
    if example is None:
        example = padded_example(snap)
    if not recs or recs[0].probs.shape[0] <= example:
        return None
    L, H = len(recs), max(a.probs.shape[1] for a in recs)
    T, S = recs[0].probs.shape[-2:]
    queries = _tokens(snap.src if kind == "enc_self" else snap.tgt, example, T)
    keys = _tokens(snap.tgt if kind == "dec_self" else snap.src, example, S)
    names = rec.token_names
    q_labels = _token_labels(queries, snap, bos=kind != "enc_self", names=names) \
        or [str(i) for i in range(T)]
    k_labels = _token_labels(keys, snap, bos=kind == "dec_self", names=names) \
        or [str(i) for i in range(S)]
    grid, nonfinite = _tiled(recs, example, T, S, H)
    cell = min(0.24, 7.5 / max(H * (S + 1), 1), 6.0 / max(L * (T + 1), 1))   # inches per cell
    fig = Figure(figsize=(max(5.0, cell * H * (S + 1) + 2.6), max(3.0, cell * L * (T + 1) + 2.2)),
                 dpi=DPI)
    ax = fig.subplots()
    cmap = colormaps["viridis"].with_extremes(under="magenta", bad="white")
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", aspect="equal")
    font = 6 if cell >= LABEL_CELL else 5
    kx = _every(cell)
    # the ticks' look set before they exist: each tick is made so, not restyled after
    ax.tick_params(length=0, pad=1, labelsize=font)
    ax.tick_params(axis="x", labelrotation=90)
    ax.set_xticks([h * (S + 1) + j for h in range(H) for j in range(0, S, kx)],
                  [k_labels[j] for _ in range(H) for j in range(0, S, kx)])
    ax.set_yticks([i * (T + 1) + j for i in range(L) for j in range(0, T, kx)],
                  [q_labels[j] for _ in range(L) for j in range(0, T, kx)])
    ax.spines[:].set_visible(False)
    for h in range(H):
        ax.text(h * (S + 1) + (S - 1) / 2, -0.8, f"head {h}", ha="center", va="bottom", fontsize=8)
    for i, a in enumerate(recs):
        ax.text(H * (S + 1) - 0.6, i * (T + 1) + (T - 1) / 2, f"layer {a.layer}", ha="left",
                va="center", rotation=90, fontsize=8)
    _pad_and_causal_lines(ax, L, H, T, S, _first_pad(keys, snap.pad_id),
                          _first_pad(queries, snap.pad_id), causal=kind == "dec_self")
    ax.set_xlabel("keys (one block per head)", fontsize=8)
    ax.set_ylabel("queries (one block per layer)", fontsize=8)
    index = snap.rows[example] if example < len(snap.rows) else example
    fig.suptitle(f"Attention maps: {KIND_TITLE[kind]}\nexample {index} of the probe batch, "
                 f"step {snap.step}" + (f"; {note}" if note else ""), fontsize=10)
    add_colorbar(fig, im, "attention probability", left=0.12, top=0.84, bottom=0.14)
    name = f"attention_{kind}.png"
    labels = C.axis_labels(fig)
    C.save(fig, fig_dir / name)
    marks = ("Red dashed lines mark where padding starts (vertical: keys, horizontal: queries); "
             "none are drawn when this example has no padding. ")
    if kind == "dec_self":
        marks += "The faint diagonal is the causal limit: any mass right of it sees the future. "
    if nonfinite:
        marks += f"Magenta: {nonfinite} NaN/Inf cells. "
    return Plot(name, f"Attention maps: {kind}",
                f"One block per layer (rows) and head (columns), example {index} of the probe "
                f"batch at step {snap.step}" + (f" ({note})" if note else "") +
                f"; query tokens down the side, key tokens along the bottom"
                + (" (the saved tokenizer's tokens)" if names else "") +
                f". Queries: {_fmt_tokens(queries, snap.pad_id, names)}; keys: "
                f"{_fmt_tokens(keys, snap.pad_id, names)}. "
                f"{marks}Mass on padding is a mask bug.", labels=labels)


def _tiled(recs, example: int, T: int, S: int, H: int):
    """(grid, NaN/Inf count): each layer's heads side by side, the layers stacked, one blank
    (NaN) row and column between blocks; a non-finite cell is -1 (drawn magenta)."""
    L = len(recs)
    grid = np.full((L * (T + 1) - 1, H * (S + 1) - 1), np.nan)          # NaN: the white gaps
    nonfinite = 0
    for i, a in enumerate(recs):
        for h in range(a.probs.shape[1]):
            p = a.probs[example, h].numpy()                                   # [T, S]
            bad = ~np.isfinite(p)
            nonfinite += int(bad.sum())
            grid[i * (T + 1):i * (T + 1) + T, h * (S + 1):h * (S + 1) + S] = np.where(bad, -1.0, p)
    return grid, nonfinite


def _pad_and_causal_lines(ax, L: int, H: int, T: int, S: int, k0, q0, causal: bool) -> None:
    """Red dashed lines where padding starts in every block (k0: keys, q0: queries; None: no
    padding), and for decoder self-attention the faint diagonal of the causal limit."""
    segs = []
    for i in range(L):
        y0, x0s = i * (T + 1) - 0.5, [h * (S + 1) - 0.5 for h in range(H)]
        if k0 is not None:
            segs += [[(x + k0, y0), (x + k0, y0 + T)] for x in x0s]
        if q0 is not None:
            segs += [[(x, y0 + q0), (x + S, y0 + q0)] for x in x0s]
    if segs:
        ax.add_collection(LineCollection(segs, colors="red", linestyles="--", linewidths=1.0))
    if causal:
        n = min(S, T)
        ax.add_collection(LineCollection(
            [[(x, y), (x + n, y + n)] for i in range(L) for x in [h * (S + 1) - 0.5 for h in range(H)]
             for y in [i * (T + 1) - 0.5]], colors="white", linewidths=0.5, alpha=0.6))


def _every(cell: float) -> int:
    """A tick label on every k-th token: every one where cells are wide enough for a label."""
    return max(1, math.ceil(LABEL_CELL / max(cell, 1e-6))) if cell < LABEL_CELL else 1


def _token_labels(tokens: list[int] | None, snap: TraceSnapshot, bos: bool,
                  names: dict[int, str] | None = None) -> list[str] | None:
    """`BOS 5 7 ... pad`: token ids (or, with `names`, a saved tokenizer's tokens, shortened and
    escaped: `token_label`), `pad` for padding, `BOS` for a decoder input's first token when
    every kept example starts with it."""
    if tokens is None:
        return None
    labels = ["pad" if t == snap.pad_id else token_label(t, names) for t in tokens]
    first = snap.tgt[:, 0] if snap.tgt is not None and snap.tgt.dim() == 2 else None
    if bos and labels and first is not None and bool((first == first[0]).all()):
        labels[0] = "BOS"
    return labels


def padded_example(snap: TraceSnapshot | None) -> int:
    """The longest kept example that has source padding (masks show there), else 0."""
    if snap is None or snap.src is None or snap.src.dim() != 2:
        return 0
    n_pad = (snap.src == snap.pad_id).sum(1)               # [b]
    if int(n_pad.max()) == 0:
        return 0
    return int(torch.where(n_pad > 0, n_pad, n_pad.max() + 1).argmin())


def _tokens(x: torch.Tensor | None, example: int, length: int) -> list[int] | None:
    if x is None or x.shape[0] <= example or x.shape[1] != length:
        return None
    return x[example].tolist()


def _first_pad(tokens: list[int] | None, pad_id: int) -> int | None:
    """Where trailing padding starts, or None when there is none."""
    if not tokens or tokens[-1] != pad_id:
        return None
    i = len(tokens)
    while i > 0 and tokens[i - 1] == pad_id:
        i -= 1
    return i


LABEL_CHARS = 8             # a token label's length at most: 8 characters fit a 6 pt tick at 80 tokens


def token_label(t: int, names: dict[int, str] | None) -> str:
    """The axis label of id `t`: its token from `names`, shortened to LABEL_CHARS (`…`), spaces
    as `·`, control characters escaped (`\\n`), `$` escaped (matplotlib reads `$..$` as maths);
    the id itself without a name, or where the figures' font has no glyph for a character."""
    name = (names or {}).get(t)
    if not name:
        return str(t)
    out = []
    for ch in name:
        if ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif unicodedata.category(ch)[0] in "CZ" and ch != " ":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        elif ch == " ":
            out.append("\u00b7")
        elif ch == "$":
            out.append("\\$")
        elif not _has_glyph(ch):
            return str(t)
        else:
            out.append(ch)
    label = "".join(out)
    return label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "\u2026"


@functools.lru_cache(maxsize=1)
def _font_chars() -> frozenset:
    """The code points the figures' default font draws (a missing one is an empty box)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font
    return frozenset(FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap())


def _has_glyph(ch: str) -> bool:
    return ord(ch) < 128 or ord(ch) in _font_chars()


def _fmt_tokens(tokens: list[int] | None, pad_id: int, names: dict[int, str] | None = None) -> str:
    if tokens is None:
        return "(not recorded)"
    shown = " ".join("pad" if t == pad_id else
                     (repr(names[t])[1:-1].replace("`", "'") if names and t in names else str(t))
                     for t in tokens[:24])
    return f"`{shown}{' ...' if len(tokens) > 24 else ''}`"
