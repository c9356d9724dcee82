"""End-of-run figures (PNG, matplotlib's Agg canvas; no pyplot, no global backend switch).

Each `figure_*` function takes the Recorder (and the Report) and returns a `Plot` written
under `fig_dir`, or None when the run gave it nothing to draw. `make_figures` draws them all,
once, at the end of the run. `attention_image` colours one attention map for TensorBoard.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tndebug.report import Report
from tndebug.reporters.recorder import Recorder, TraceSnapshot
from tndebug.trace import KINDS

DPI = 100
KIND_TITLE = {"enc_self": "encoder self-attention", "dec_self": "decoder self-attention",
              "cross": "cross-attention (decoder queries, encoder keys)"}
_HEAD_METRIC = re.compile(r"attn/(enc_self|dec_self|cross)/layer(\d+)/head(\d+)/(\w+)")
_RESID = re.compile(r"depth/(encoder|decoder)/layer(\d+)/resid_rms")
_GRAD = re.compile(r"grad/(\w+)/layer(\d+)/norm")
KIND_SHORT = {"enc_self": "encoder self", "dec_self": "decoder self", "cross": "cross"}
STACK_COLOR = {"encoder": "tab:blue", "decoder": "tab:orange", "embed": "tab:gray"}


@dataclass
class Plot:
    name: str          # file name under fig_dir, e.g. "entropy_enc_self.png"
    title: str         # a heading for the report
    caption: str       # one sentence: what is drawn and from which data


def make_figures(rec: Recorder, report: Report, fig_dir: Path) -> list[Plot]:
    """Draw every figure the recorded data allows; a figure that fails is skipped, not fatal."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    jobs = [lambda: figure_curves(rec, report, fig_dir), lambda: figure_entropy(rec, fig_dir),
            lambda: figure_similarity(rec, fig_dir)]
    jobs += [lambda k=kind: figure_attention_maps(rec, k, fig_dir) for kind in KINDS]
    jobs.append(lambda: figure_depth(rec, fig_dir))
    for job in jobs:
        try:
            p = job()
        except Exception as e:  # noqa: BLE001 - a figure must never cost the report
            p = Plot("", "figure failed", f"{type(e).__name__}: {e}")
        if p is not None:
            plots.append(p)
    return plots


# -- attention entropy per layer x head --------------------------------------------------
def entropy_matrix(rec: Recorder, kind: str):
    """([layers, heads] mean normalised attention entropy (entropy / ln keys, 1 = uniform), step,
    source, note) or None: from head-collapse's metric (its last finite values), unless the
    probe batch's snapshot is later (the run's final step) or the metric has no finite value;
    then from the snapshot (same definition, non-finite rows left out). The note says
    `no finite data after step N` where later values were not finite."""
    series = {(int(l), int(h)): sv for (k, l, h, m), sv in rec.series_matching(_HEAD_METRIC).items()
              if k == kind and m == "entropy"}
    snap, note = rec.attention_snapshot()
    recs = [a for a in (snap.attention if snap else []) if a.kind == kind and a.layer is not None]
    if series:
        L = max(l for l, _ in series) + 1
        H = max(h for _, h in series) + 1
        mat = np.full((L, H), np.nan)
        last = max(s for sv in series.values() for s, _ in sv)
        finite = [s for sv in series.values() for s, v in sv if math.isfinite(v)]
        if finite and not (recs and snap.step > last):
            step = max(finite)                      # one step for every cell: the last finite
            for (l, h), sv in series.items():
                mat[l, h] = next((v for s, v in reversed(sv) if s <= step and math.isfinite(v)),
                                 np.nan)
            return mat, step, "the head-collapse metric", \
                (f"no finite data after step {step}" if last > step else "")
        if not recs:
            return mat, None, "the head-collapse metric", f"no finite data (last step {last})"
        if not finite:
            note = "; ".join(x for x in (note, "the head-collapse metric is NaN; "
                                         "non-finite rows left out") if x)
    if not recs:
        return None
    L = max(a.layer for a in recs) + 1
    H = max(a.probs.shape[1] for a in recs)
    mat = np.full((L, H), np.nan)
    for a in recs:
        p, valid = _valid_rows(a.probs, snap, kind)                 # [b, h, T, S], [b, T]
        n = (p > 0).sum(-1)                                         # [b, h, T] keys in play
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / n.clamp(min=2).float().log()
        w = (valid[:, None, :] & (n >= 2)).float()                  # [b, h, T]
        mat[a.layer, :p.shape[1]] = ((ent * w).sum((0, 2)) / w.sum((0, 2)).clamp_min(1)).numpy()
    return mat, snap.step, f"the probe batch ({recs[0].probs.shape[0]} examples)", \
        note.replace("no finite attention", "no finite data")


def figure_entropy(rec: Recorder, fig_dir: Path) -> Plot | None:
    got = {k: m for k in KINDS if (m := entropy_matrix(rec, k)) is not None}
    if not got:
        return None
    top = max([1.0] + [float(np.nanmax(m[0])) for m in got.values() if np.isfinite(m[0]).any()])
    L = max(m[0].shape[0] for m in got.values())
    H = max(m[0].shape[1] for m in got.values())
    fig = Figure(figsize=(len(got) * max(2.6, 0.55 * H + 1.0) + 1.2, max(2.6, 0.45 * L + 1.7)),
                 dpi=DPI)
    axes = fig.subplots(1, len(got), squeeze=False)[0]
    steps = {m[1] for m in got.values()}
    one = len(steps) == 1 and None not in steps
    for ax, (kind, (mat, step, source, note)) in zip(axes, got.items()):
        im = ax.imshow(mat, cmap="magma", aspect="auto", vmin=0, vmax=top)
        _ticks(ax, mat.shape[1], mat.shape[0], "head", "layer")
        _annotate(ax, mat, im)
        if not np.isfinite(mat).any():
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, color="gray", wrap=True)
        at = "" if one else ("(no finite data)" if step is None else f"(step {step})")
        ax.set_title(f"{KIND_SHORT[kind]}\n{at}".rstrip(), fontsize=9)
    notes = sorted({m[3] for m in got.values() if m[3] and np.isfinite(m[0]).any()})
    fig.suptitle("Attention entropy per layer and head" + (f", step {steps.pop()}" if one else "")
                 + (f"\n{'; '.join(notes)}" if notes else ""), fontsize=10)
    _colorbar(fig, im, "entropy / ln(keys)", left=0.07, top=0.70 if notes else 0.76, bottom=0.17,
              wspace=0.35)
    _save(fig, fig_dir / "entropy.png")
    sources = sorted({m[2] for m in got.values()})
    return Plot("entropy.png", "Attention entropy per layer and head",
                f"Mean normalised entropy (entropy / ln of the keys in play) of each head's "
                f"attention over real query rows, from {' and '.join(sources)}, one panel per "
                f"attention type. 0: every query looks at one key; 1: uniform attention."
                + _notes_sentence({KIND_SHORT[k]: m[3] for k, m in got.items()}))


# -- head similarity matrices ------------------------------------------------------------
def similarity_matrices(snap: TraceSnapshot, kind: str) -> list[tuple[int, np.ndarray]]:
    """[(layer, [h, h] 1 - Jensen-Shannon divergence in bits between heads' rows)] from the
    probe batch: head-collapse's `similarity` is the mean of a row without the diagonal."""
    out = []
    for a in sorted((a for a in snap.attention if a.kind == kind), key=lambda a: a.layer or 0):
        p, valid = _valid_rows(a.probs, snap, kind)                  # [b, h, T, S], [b, T]
        w = valid.float()
        logp = p.clamp_min(1e-30).log()
        h = p.shape[1]
        js = np.zeros((h, h))
        for i in range(h):
            m = (p[:, i:i + 1] + p) / 2                               # [b, h, T, S]
            logm = m.clamp_min(1e-30).log()
            d = ((p[:, i:i + 1] * (logp[:, i:i + 1] - logm)).sum(-1) +
                 (p * (logp - logm)).sum(-1)) / (2 * math.log(2))     # [b, h, T]
            js[i] = ((d * w[:, None]).sum((0, 2)) / w.sum().clamp(min=1)).numpy()
        out.append((a.layer or 0, np.clip(1.0 - js, 0.0, 1.0)))
    return out


def figure_similarity(rec: Recorder, fig_dir: Path) -> Plot | None:
    snap, note = rec.attention_snapshot()
    got = {k: m for k in KINDS if snap and (m := similarity_matrices(snap, k))}
    if not got:
        return None
    L = max(len(m) for m in got.values())
    H = max(x.shape[0] for m in got.values() for _, x in m)
    fig = Figure(figsize=(min(16.0, max(4.5, 0.4 * L * (H + 1) + 2.4)), 1.0 + len(got) *
                          max(1.5, 0.4 * H + 0.75)), dpi=DPI)
    axes = fig.subplots(len(got), 1, squeeze=False)[:, 0]
    for ax, (kind, mats) in zip(axes, got.items()):
        grid = _grid([[m for _, m in mats]])
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1)
        xs, labels = [], []
        for j, (layer, m) in enumerate(mats):
            x0 = j * (m.shape[1] + 1)
            xs += [x0 + h for h in range(m.shape[1])]
            labels += [f"h{h}" for h in range(m.shape[1])]
            ax.text(x0 + (m.shape[1] - 1) / 2, -0.7, f"layer {layer}", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_yticks(range(H), [f"h{h}" for h in range(H)], fontsize=7)
        ax.set_ylabel(KIND_SHORT[kind], fontsize=8)
        if grid.size <= 400:
            _annotate(ax, grid, im, fmt="{:.1f}")
        ax.spines[:].set_visible(False)
    fig.suptitle(f"Head similarity per layer (probe batch, step {snap.step})"
                 + (f"\n{note}" if note else ""), fontsize=10)
    _colorbar(fig, im, "1 - JS divergence (bits)", left=0.1, top=0.86, bottom=0.08, hspace=0.45)
    _save(fig, fig_dir / "head_similarity.png")
    return Plot("head_similarity.png", "Head similarity per layer",
                f"Similarity of every pair of heads, 1 - Jensen-Shannon divergence (bits) of "
                f"their attention rows on the probe batch at step {snap.step}"
                + (f" ({note})" if note else "") + ", one block per "
                f"layer (1 on the diagonal). Off-diagonal cells near 1 are duplicated heads; "
                f"some redundancy is normal, exact copies are a bug.")


# -- attention maps of the probe batch ---------------------------------------------------
LABEL_CELL = 0.11            # inches per cell from which every token gets a tick label


def figure_attention_maps(rec: Recorder, kind: str, fig_dir: Path,
                          example: int | None = None) -> Plot | None:
    """Layers (rows) x heads (columns) of one example's attention at one step, the queries'
    tokens down the side and the keys' along the bottom; NaN/Inf cells in magenta."""
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
    q_labels = _token_labels(queries, snap, bos=kind != "enc_self") or [str(i) for i in range(T)]
    k_labels = _token_labels(keys, snap, bos=kind == "dec_self") or [str(i) for i in range(S)]
    cell = min(0.24, 7.5 / max(H * (S + 2), 1), 6.0 / max(L * (T + 2), 1))   # inches per cell
    fig = Figure(figsize=(max(5.0, cell * H * (S + 2) + 2.4), max(3.0, cell * L * (T + 2) + 2.0)),
                 dpi=DPI)
    axes = fig.subplots(L, H, squeeze=False)
    cmap = colormaps["viridis"].with_extremes(under="magenta")
    k0 = _first_pad(keys, snap.pad_id)
    q0 = _first_pad(queries, snap.pad_id)
    font = 6 if cell >= LABEL_CELL else 5
    nonfinite = 0
    for i, a in enumerate(recs):
        for h in range(H):
            ax = axes[i, h]
            if h >= a.probs.shape[1]:
                ax.set_axis_off()
                continue
            p = a.probs[example, h].numpy()                                   # [T, S]
            bad = ~np.isfinite(p)
            nonfinite += int(bad.sum())
            im = ax.imshow(np.where(bad, -1.0, p), cmap=cmap, vmin=0, vmax=1,
                           interpolation="nearest", aspect="equal")
            _token_ticks(ax.set_xticks, k_labels, cell, font, rotate=True)
            _token_ticks(ax.set_yticks, q_labels, cell, font)
            ax.tick_params(length=0, pad=1, labelbottom=i == L - 1, labelleft=h == 0)
            if k0 is not None:
                ax.axvline(k0 - 0.5, color="red", linestyle="--", linewidth=1.0)
            if q0 is not None:
                ax.axhline(q0 - 0.5, color="red", linestyle="--", linewidth=1.0)
            if kind == "dec_self":
                ax.plot([-0.5, min(S, T) - 0.5], [-0.5, min(S, T) - 0.5], color="white",
                        linewidth=0.5, alpha=0.6)
            if i == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"layer {a.layer}\nqueries", fontsize=8)
            if i == L - 1:
                ax.set_xlabel("keys", fontsize=8)
    index = snap.rows[example] if example < len(snap.rows) else example
    fig.suptitle(f"Attention maps: {KIND_TITLE[kind]}\nexample {index} of the probe batch, "
                 f"step {snap.step}" + (f"; {note}" if note else ""), fontsize=10)
    _colorbar(fig, im, "attention probability", left=0.14, top=0.84, bottom=0.12,
              wspace=0.08, hspace=0.15)
    name = f"attention_{kind}.png"
    _save(fig, fig_dir / name)
    marks = ("Red dashed lines mark where padding starts (vertical: keys, horizontal: queries); "
             "none are drawn when this example has no padding. ")
    if kind == "dec_self":
        marks += "The faint diagonal is the causal limit: any mass right of it sees the future. "
    if nonfinite:
        marks += f"Magenta: {nonfinite} NaN/Inf cells. "
    return Plot(name, f"Attention maps: {kind}",
                f"One panel per layer (rows) and head (columns), example {index} of the probe "
                f"batch at step {snap.step}" + (f" ({note})" if note else "") +
                f"; query tokens down the side, key tokens along the bottom. Queries: "
                f"{_fmt_tokens(queries, snap.pad_id)}; keys: {_fmt_tokens(keys, snap.pad_id)}. "
                f"{marks}Mass on padding is a mask bug.")


def _token_labels(tokens: list[int] | None, snap: TraceSnapshot, bos: bool) -> list[str] | None:
    """`BOS 5 7 ... pad`: token ids, `pad` for padding, `BOS` for a decoder input's first token
    when every kept example starts with it."""
    if tokens is None:
        return None
    labels = ["pad" if t == snap.pad_id else str(t) for t in tokens]
    first = snap.tgt[:, 0] if snap.tgt is not None and snap.tgt.dim() == 2 else None
    if bos and labels and first is not None and bool((first == first[0]).all()):
        labels[0] = "BOS"
    return labels


def _token_ticks(set_ticks, labels: list[str], cell: float, font: int, rotate: bool = False) -> None:
    """A tick per token where cells are wide enough for a label, else every k-th."""
    k = max(1, math.ceil(LABEL_CELL / max(cell, 1e-6))) if cell < LABEL_CELL else 1
    idx = list(range(0, len(labels), k))
    set_ticks(idx, [labels[i] for i in idx], fontsize=font, **({"rotation": 90} if rotate else {}))


def padded_example(snap: TraceSnapshot | None) -> int:
    """The longest kept example that has source padding (masks show there), else 0."""
    if snap is None or snap.src is None or snap.src.dim() != 2:
        return 0
    n_pad = (snap.src == snap.pad_id).sum(1)               # [b]
    if int(n_pad.max()) == 0:
        return 0
    return int(torch.where(n_pad > 0, n_pad, n_pad.max() + 1).argmin())


def attention_image(probs: torch.Tensor, min_cell: int = 96) -> np.ndarray:
    """Heads side by side, viridis, upscaled; NaN in magenta.  probs [h, T, S] -> [H, W, 3] uint8

    Coloured at [h, T, S] and upscaled as bytes, not as floats (an image per attention site
    at every snapshot step of a training run)."""
    p = probs.detach().float().cpu().numpy()
    h, T, S = p.shape
    k = max(1, math.ceil(min_cell / max(T, S, 1)))
    rgb = colormaps["viridis"](np.clip(np.nan_to_num(p, nan=0.0), 0, 1), bytes=True)[..., :3]
    rgb[~np.isfinite(p)] = (255, 0, 255)
    rgb = rgb.repeat(k, axis=1).repeat(k, axis=2)                                  # [h, kT, kS, 3]
    out = np.full((T * k, h * S * k + 2 * (h - 1), 3), 255, dtype=np.uint8)       # 2 px white gaps
    for i in range(h):
        x = i * (S * k + 2)
        out[:, x:x + S * k] = rgb[i]
    return out


# -- depth: residual RMS and gradient norm -----------------------------------------------
GRAD_AT_OUTPUT = "gradient norm at the layer's output (dL/dx)"
GRAD_OF_PARAMS = "gradient norm of the layer's parameters"


def _depth_data(rec: Recorder):
    """({step: (rms {(stack, layer): v}, grad {(stack, layer): v})}, source, grad label): from
    the probe-batch snapshots that hold both (the same step for both panels), else from the
    probe metrics at the steps both were measured at (else every step either was)."""
    snaps = {}
    for snap in rec.snapshots:
        rms = {(st, l): v for (st, l, kind, _), v in snap.stream_rms.items()
               if l is not None and kind == "layer"}
        grad = {(st, l): v for (st, l, kind, _), v in snap.grad_norm.items()
                if l is not None and kind == "layer"}
        if rms or grad:
            snaps[snap.step] = (rms, grad)
    both = {s: rg for s, rg in snaps.items() if rg[0] and rg[1]}
    rms, grad = {}, {}
    for pattern, out in ((_RESID, rms), (_GRAD, grad)):
        for (stack, layer), series in rec.series_matching(pattern).items():
            for step, v in series:
                out.setdefault(step, {})[(stack, int(layer))] = v
    steps = sorted(set(rms) & set(grad)) or sorted(set(rms) | set(grad))
    if both and (not steps or max(both) >= max(steps)):      # the snapshots reach as far
        return both, "the probe batch", GRAD_AT_OUTPUT
    if not steps and snaps:
        return snaps, "the probe batch", GRAD_AT_OUTPUT
    return {s: (rms.get(s, {}), grad.get(s, {})) for s in steps}, "probe metrics", GRAD_OF_PARAMS


def figure_depth(rec: Recorder, fig_dir: Path) -> Plot | None:
    data, source, grad_label = _depth_data(rec)
    if not data:
        return None
    measured = max([s.step for s in rec.snapshots if s.stream_rms or s.grad_norm] +
                   [x for pat in (_RESID, _GRAD) for sv in rec.series_matching(pat).values()
                    for x, _ in sv], default=-1)      # the last step either quantity was seen
    finite = [s for s, (r, g) in data.items()
              if all(math.isfinite(v) for v in (*r.values(), *g.values()))]
    last_step = max(data)
    note = ""
    if not finite:
        shown, note = [], f"no finite data (last step {last_step})"
    else:
        shown = sorted({min(finite), max(finite)})
        if last_step > max(finite):
            note = f"no finite data after step {max(finite)}"
        elif measured > max(finite):
            note = (f"later steps, to step {measured}, measured only one of the two "
                    f"(TensorBoard: depth/, grad/)")
    fig = Figure(figsize=(9.0, 3.8), dpi=DPI)
    ax1, ax2 = fig.subplots(1, 2)
    for ax, which, label, log in ((ax1, 0, "residual stream RMS", False),
                                  (ax2, 1, grad_label, True)):
        values = []
        for s in shown:
            by = data[s][which]
            last = s == shown[-1]
            for stack in sorted({st for st, _ in by}):
                layers = sorted(l for st, l in by if st == stack)
                ys = [by[(stack, l)] for l in layers]
                values += ys
                ax.plot(layers, ys, marker="o", color=STACK_COLOR.get(stack, "tab:green"),
                        linestyle="-" if last else ":", alpha=1.0 if last else 0.6,
                        label=f"{stack}, step {s}")
        if not values:
            ax.text(0.5, 0.5, note or f"not measured at step {shown[-1]}", ha="center",
                    va="center", transform=ax.transAxes, color="gray")
        ax.set_xlabel("layer")
        ax.set_ylabel(label, fontsize=8 if len(label) > 24 else 10)
        if log and values and all(v > 0 for v in values):
            ax.set_yscale("log")
        elif values and all(math.isfinite(v) for v in values):
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_ylim(bottom=min(0.0, min(values)), top=max(values) * 1.1 or 1.0)   # from 0
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if values:
            ax.legend(fontsize=7)
    ax1.set_title("Residual stream RMS by depth", fontsize=10)
    ax2.set_title("Gradient norm by depth", fontsize=10)
    steps = (f"step {shown[0]} (dotted) and step {shown[-1]} (solid)" if len(shown) > 1 else
             f"step {shown[0]}" if shown else "")
    fig.suptitle(f"From {source}" + (f", {steps}" if steps else "") + (f"; {note}" if note else ""),
                 fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.82, bottom=0.15, wspace=0.3)
    _save(fig, fig_dir / "depth.png")
    what = "output RMS and the " + grad_label.removeprefix("gradient norm ").replace(
        "of the layer's parameters", "norm of its parameters' gradient").replace(
        "at the layer's output (dL/dx)", "norm of the loss gradient at its output")
    return Plot("depth.png", "Residual RMS and gradient norm by depth",
                f"Each layer's {what}, from {source}, at {steps or 'no step'}: both panels "
                f"show the same steps." + (f" {note[0].upper()}{note[1:]}." if note else "") +
                " Steady growth with depth is normal for Pre-LN; a jump or a collapse to 0 at "
                "one layer is not.")


# -- loss and learning-rate curves -------------------------------------------------------
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
            ax.set_yscale("log")
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
        ax.set_title(title, fontsize=10 if "\n" not in title else 8)
        ax.grid(alpha=0.3)
        if finite:
            ax.legend(fontsize=7, loc="best")
    w = fig.get_figwidth()
    fig.subplots_adjust(left=0.8 / w, right=1 - 0.15 / w, top=0.86, bottom=0.15, wspace=0.4)
    _save(fig, fig_dir / "curves.png")
    return Plot("curves.png", "Loss and learning rate",
                "Training (and evaluation) curves as logged, finite values only; dashed lines "
                "mark the first sign a probe saw and where the run stopped."
                + _notes_sentence(notes))


def _merge_marks(marks: list[tuple[int, str, str]], span: int) -> list[tuple[int, str, str]]:
    """Marks closer than 4% of the x range share one line and one label (no overprinting)."""
    out: list[tuple[int, str, str]] = []
    for step, text, color in sorted(marks):
        if out and step - out[-1][0] <= max(1, 0.04 * span):
            out[-1] = (out[-1][0], f"{out[-1][1]} / {text}", out[-1][2])
        else:
            out.append((step, text, color))
    return out


# -- helpers -----------------------------------------------------------------------------
def _notes_sentence(notes: dict[str, str]) -> str:
    """` Encoder self: no finite data after step 20.` for the panels that have a note."""
    by: dict[str, list[str]] = {}
    for panel, note in notes.items():
        if note:
            by.setdefault(note, []).append(panel)
    return "".join(f" {', '.join(p)}: {n}." for n, p in by.items())


def _step_marks(report: Report) -> list[tuple[int, str, str]]:
    from tndebug.reporters.common import run_status
    marks = []
    if report.first_sign is not None and report.first_sign.step is not None:
        marks.append((report.first_sign.step, f"first sign: {report.first_sign.probe}", "tab:red"))
    status, step = run_status(report)
    if status != "completed" and step is not None:
        marks.append((step, status, "black"))
    return marks


def _valid_rows(probs: torch.Tensor, snap: TraceSnapshot, kind: str):
    """probs with non-finite rows zeroed, and which query rows are real tokens.  -> [b,h,T,S], [b,T]"""
    b, _, T, _ = probs.shape
    tokens = snap.src if kind == "enc_self" else snap.tgt
    if tokens is not None and tokens.shape[0] >= b and tokens.shape[1] == T:
        valid = tokens[:b] != snap.pad_id
    else:
        valid = torch.ones(b, T, dtype=torch.bool)
    p = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    return p, valid


def _save(fig: Figure, path: Path) -> None:
    """PNG with light compression: encoding was a third of the drawing time at the default."""
    fig.savefig(path, pil_kwargs={"compress_level": 2})


def _colorbar(fig: Figure, im, label: str, **adjust) -> None:
    """Axes first, then a colorbar in its own strip on the right (never over a panel)."""
    w = fig.get_figwidth()
    right = 1 - 1.25 / w                            # leave 1.25 in for the bar and its label
    fig.subplots_adjust(right=right, **adjust)
    top, bottom = adjust.get("top", 0.88), adjust.get("bottom", 0.12)
    cax = fig.add_axes((right + 0.25 / w, bottom, 0.15 / w, top - bottom))
    fig.colorbar(im, cax=cax, label=label)


def _grid(blocks: list[list[np.ndarray]], gap: int = 1) -> np.ndarray:
    """Rows of equal-sized 2-D blocks into one array, NaN (drawn white) between them."""
    h = max(b.shape[0] for row in blocks for b in row)
    w = max(b.shape[1] for row in blocks for b in row)
    n_cols = max(len(row) for row in blocks)
    out = np.full((len(blocks) * (h + gap) - gap, n_cols * (w + gap) - gap), np.nan)
    for i, row in enumerate(blocks):
        for j, b in enumerate(row):
            out[i * (h + gap):i * (h + gap) + b.shape[0], j * (w + gap):j * (w + gap) + b.shape[1]] = b
    return out


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


def _fmt_tokens(tokens: list[int] | None, pad_id: int) -> str:
    if tokens is None:
        return "(not recorded)"
    shown = " ".join("pad" if t == pad_id else str(t) for t in tokens[:24])
    return f"`{shown}{' ...' if len(tokens) > 24 else ''}`"


def _ticks(ax, nx: int, ny: int, xlabel: str, ylabel: str) -> None:
    ax.set_xticks(range(nx), [f"{xlabel[0]}{i}" if xlabel == "head" else str(i) for i in range(nx)])
    ax.set_yticks(range(ny), [f"h{i}" if ylabel == "head" else str(i) for i in range(ny)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _annotate(ax, mat: np.ndarray, im, fmt: str = "{:.2f}") -> None:
    if mat.size > 400:
        return
    lo, hi = im.get_clim()
    for (i, j), v in np.ndenumerate(mat):
        if not np.isfinite(v):
            continue
        dark = (v - lo) / ((hi - lo) or 1) < 0.55
        ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                color="white" if dark else "black")
