"""End-of-run figures (PNG, matplotlib's Agg canvas; no pyplot, no global backend switch).

Each `figure_*` function takes the Recorder (and the Report) and returns a `Plot` written
under `fig_dir`, or None when the run gave it nothing to draw. `make_figures` draws them all,
once, at the end of the run.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from tndebug.report import Report
from tndebug.reporters import figures_common as C
from tndebug.reporters.figures_common import (DPI, KIND_SHORT, STACK_COLOR, Plot, annotate_cells,
                                              add_colorbar, block_grid, notes_sentence, set_ticks,
                                              valid_rows)
from tndebug.reporters.plots_attention import figure_attention_maps
from tndebug.reporters.plots_curves import figure_curves
from tndebug.reporters.plots_evidence import finding_kinds, mask_figures, site_kinds
from tndebug.reporters.recorder import Recorder, TraceSnapshot
from tndebug.capture.trace import KINDS
from tndebug import tags

# the metrics read, as tndebug/tags.py declares them: (family, its fixed parts)
_RESID = (tags.DEPTH, {"stat": "resid_rms"})          # -> (stack, layer)
_GRAD = (tags.GRAD, {})                               # -> (stack, layer)


def make_figures(rec: Recorder, report: Report, fig_dir: Path) -> list[Plot]:
    """Draw every figure the recorded data allows, and each finding's evidence where it has a
    picture (plots_evidence); a figure that fails is skipped, not fatal. Each Plot lists the
    findings it illustrates (`link`)."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    jobs = [lambda: figure_curves(rec, report, fig_dir), lambda: figure_entropy(rec, fig_dir),
            lambda: figure_similarity(rec, fig_dir)]
    jobs += [lambda k=kind: figure_attention_maps(rec, k, fig_dir) for kind in KINDS]
    jobs.append(lambda: figure_depth(rec, fig_dir))
    jobs.append(lambda: mask_figures(rec, report.findings, fig_dir))
    with C.gc_paused():
        for job in jobs:
            try:
                p = job()
            except Exception as e:  # noqa: BLE001 - a figure must never cost the report
                p = Plot("", "figure failed", f"{type(e).__name__}: {e}")
            plots += p if isinstance(p, list) else [p] if p is not None else []
    link(plots, report, rec)
    return plots


# which findings each figure illustrates: by probe; the attention maps by probe and kind
ILLUSTRATES = {"curves.png": ("loss-health", "lr-schedule"),
               "entropy.png": ("head-collapse", "missing-scale"),   # no 1/sqrt(d_k): peaky rows
               "head_similarity.png": ("head-collapse",),
               "depth.png": ("variance-drift", "gradient-flow", "ln-placement")}
MAP_PROBES = ("mask-broadcast", "nan-scores")


def link(plots: list[Plot], report: Report, rec: Recorder) -> None:
    """Set each Plot's `findings` (indices into report.findings) that it has none yet: the
    warnings and errors it illustrates (an advisory's picture is no evidence of a defect)."""
    sites = site_kinds(rec)
    for p in plots:
        if p.findings or not p.name:
            continue
        kind = p.name.removeprefix("attention_").removesuffix(".png") \
            if p.name.startswith("attention_") else None
        p.findings = tuple(i for i, f in enumerate(report.findings) if f.at_least("warning")
                           and (f.probe in ILLUSTRATES.get(p.name, ()) if kind is None else
                               f.probe in MAP_PROBES and kind in finding_kinds(f, sites)))


# -- attention entropy per layer x head --------------------------------------------------
def entropy_matrix(rec: Recorder, kind: str):
    """([layers, heads] mean normalised attention entropy (entropy / ln keys, 1 = uniform), step,
    source, note) or None: from head-collapse's metric (its last finite values), unless the
    probe batch's snapshot is later (the run's final step) or the metric has no finite value;
    then from the snapshot (same definition, non-finite rows left out). The note says
    `no finite data after step N` where later values were not finite."""
    series = {(int(l), int(h)): sv
              for (l, h), sv in rec.series_of(tags.HEAD, kind=kind, stat="entropy").items()}
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
        p, valid = valid_rows(a.probs, snap, kind)                 # [b, h, T, S], [b, T]
        n = (p > 0).sum(-1)                                         # [b, h, T] keys in play
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / n.clamp(min=2).float().log()
        w = (valid[:, None, :] & (n >= 2)).float()                  # [b, h, T]
        n_rows = w.sum((0, 2))                                      # [h]
        mat[a.layer, :p.shape[1]] = torch.where(n_rows > 0, (ent * w).sum((0, 2)) /
                                                n_rows.clamp_min(1), torch.nan).numpy()
    note = note.replace("no finite attention", "no finite data")
    if not np.isfinite(mat).any():
        note = note or f"no finite data (step {snap.step})"
    return mat, snap.step, f"the probe batch ({recs[0].probs.shape[0]} examples)", note


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
        set_ticks(ax, mat.shape[1], mat.shape[0], "head", "layer")
        annotate_cells(ax, mat, im)
        if not np.isfinite(mat).any():
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, color="gray", wrap=True)
        at = "" if one else ("(no finite data)" if step is None else f"(step {step})")
        ax.set_title(f"{KIND_SHORT[kind]}\n{at}".rstrip(), fontsize=9, y=1.0)
    notes = sorted({m[3] for m in got.values() if m[3] and np.isfinite(m[0]).any()})
    fig.suptitle("Attention entropy per layer and head" + (f", step {steps.pop()}" if one else "")
                 + (f"\n{'; '.join(notes)}" if notes else ""), fontsize=10)
    add_colorbar(fig, im, "entropy / ln(keys)", left=0.07, top=0.70 if notes else 0.76, bottom=0.17,
              wspace=0.35)
    C.save(fig, fig_dir / "entropy.png")
    sources = sorted({m[2] for m in got.values()})
    return Plot("entropy.png", "Attention entropy per layer and head",
                f"Mean normalised entropy (entropy / ln of the keys in play) of each head's "
                f"attention over real query rows, from {' and '.join(sources)}, one panel per "
                f"attention type. 0: every query looks at one key; 1: uniform attention."
                + notes_sentence({KIND_SHORT[k]: m[3] for k, m in got.items()}),
                labels=C.axis_labels(fig))


# -- head similarity matrices ------------------------------------------------------------
def similarity_matrices(snap: TraceSnapshot, kind: str) -> list[tuple[int, np.ndarray]]:
    """[(layer, [h, h] 1 - Jensen-Shannon divergence in bits between heads' rows)] from the
    probe batch: head-collapse's `similarity` is the mean of a row without the diagonal."""
    out = []
    for a in sorted((a for a in snap.attention if a.kind == kind), key=lambda a: a.layer or 0):
        p, valid = valid_rows(a.probs, snap, kind)                  # [b, h, T, S], [b, T]
        w = valid.float()
        logp = p.clamp_min(1e-30).log()
        h = p.shape[1]
        js = np.zeros((h, h))
        for i in range(h):
            m = (p[:, i:i + 1] + p) / 2                               # [b, h, T, S]
            logm = m.clamp_min(1e-30).log()
            d = ((p[:, i:i + 1] * (logp[:, i:i + 1] - logm)).sum(-1) +
                 (p * (logp - logm)).sum(-1)) / (2 * math.log(2))     # [b, h, T]
            js[i] = ((d * w[:, None]).sum((0, 2)) / w.sum()).numpy() if w.sum() > 0 else np.nan
        out.append((a.layer or 0, np.clip(1.0 - js, 0.0, 1.0)))
    return out


def figure_similarity(rec: Recorder, fig_dir: Path) -> Plot | None:
    snap, note = rec.attention_snapshot()
    got = {k: m for k in KINDS if snap and (m := similarity_matrices(snap, k))}
    if not got:
        return None
    if not any(np.isfinite(x).any() for m in got.values() for _, x in m):
        note = note or f"no finite data (step {snap.step})"        # NaN rows are left out
    L = max(len(m) for m in got.values())
    H = max(x.shape[0] for m in got.values() for _, x in m)
    width = min(16.0, max(4.5, 0.4 * L * (H + 1) + 2.4))
    # a panel as tall as its squares at the width they get (0.9 w - 1.25 in: the margins and
    # the colorbar), not as at 0.4 in a cell: a 6 x 8 model's panels were half white space
    cell = min(0.4, (0.9 * width - 1.25) / max(L * (H + 1) - 1, 1))
    fig = Figure(figsize=(width, 1.0 + len(got) * max(1.5, cell * H + 0.95)), dpi=DPI)
    axes = fig.subplots(len(got), 1, squeeze=False)[:, 0]
    # panels with the same blocks share the bottom one's head labels (a matrix is symmetric:
    # its rows name the columns too); ~100 fewer ticks to build on a 6 x 8 model
    layouts = {tuple((layer, m.shape[1]) for layer, m in mats) for mats in got.values()}
    for n, (ax, (kind, mats)) in enumerate(zip(axes, got.items())):
        grid = block_grid([[m for _, m in mats]])
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1)
        ax.tick_params(labelsize=7)          # before the ticks exist: not restyled one by one
        xs, labels = [], []
        for j, (layer, m) in enumerate(mats):
            x0 = j * (m.shape[1] + 1)
            xs += [x0 + h for h in range(m.shape[1])]
            labels += [f"h{h}" for h in range(m.shape[1])]
            ax.text(x0 + (m.shape[1] - 1) / 2, -0.7, f"layer {layer}", ha="center", va="bottom",
                    fontsize=8)
        if len(layouts) > 1 or n == len(got) - 1:
            ax.set_xticks(xs, labels)
            ax.set_xlabel("head, one block per layer", fontsize=8)
        else:
            ax.set_xticks([])
        ax.set_yticks(range(H), [f"h{h}" for h in range(H)])
        ax.set_ylabel(KIND_SHORT[kind], fontsize=8)
        if grid.size <= 400:
            annotate_cells(ax, grid, im, fmt="{:.1f}")
        ax.spines[:].set_visible(False)
    fig.suptitle(f"Head similarity per layer (probe batch, step {snap.step})"
                 + (f"\n{note}" if note else ""), fontsize=10)
    add_colorbar(fig, im, "1 - JS divergence (bits)", left=0.1, top=0.86, bottom=0.08, hspace=0.45)
    C.save(fig, fig_dir / "head_similarity.png")
    return Plot("head_similarity.png", "Head similarity per layer",
                f"Similarity of every pair of heads, 1 - Jensen-Shannon divergence (bits) of "
                f"their attention rows on the probe batch at step {snap.step}"
                + (f" ({note})" if note else "") + ", one block per "
                f"layer (1 on the diagonal). Off-diagonal cells near 1 are duplicated heads; "
                f"some redundancy is normal, exact copies are a bug.", labels=C.axis_labels(fig))


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
    for (family, fixed), out in ((_RESID, rms), (_GRAD, grad)):
        for (stack, layer), series in rec.series_of(family, **fixed).items():
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
                   [x for fam, fixed in (_RESID, _GRAD) for sv in rec.series_of(fam, **fixed).values()
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
            C.log_scale(ax, "y")
        elif values and all(math.isfinite(v) for v in values):
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_ylim(bottom=min(0.0, min(values)), top=max(values) * 1.1 or 1.0)   # from 0
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if values:
            ax.legend(fontsize=7)
    ax1.set_title("Residual stream RMS by depth", fontsize=10, y=1.0)
    ax2.set_title("Gradient norm by depth", fontsize=10, y=1.0)
    steps = (f"step {shown[0]} (dotted) and step {shown[-1]} (solid)" if len(shown) > 1 else
             f"step {shown[0]}" if shown else "")
    fig.suptitle(f"From {source}" + (f", {steps}" if steps else "") + (f"; {note}" if note else ""),
                 fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.82, bottom=0.15, wspace=0.3)
    C.save(fig, fig_dir / "depth.png")
    what = "output RMS and the " + grad_label.removeprefix("gradient norm ").replace(
        "of the layer's parameters", "norm of its parameters' gradient").replace(
        "at the layer's output (dL/dx)", "norm of the loss gradient at its output")
    return Plot("depth.png", "Residual RMS and gradient norm by depth",
                f"Each layer's {what}, from {source}, at {steps or 'no step'}: both panels "
                f"show the same steps." + (f" {note[0].upper()}{note[1:]}." if note else "") +
                " Steady growth with depth is normal for Pre-LN; a jump or a collapse to 0 at "
                "one layer is not.", labels=C.axis_labels(fig))
