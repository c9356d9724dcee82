"""The picture of a finding's evidence, drawn next to the finding in report.md.

* `mask-broadcast`: the numbers the finding carries (each module's mass on keys it must not
  see, against the probe's threshold; each failed behaviour test's change, in units of its
  tolerance), and, from the recorded probe batch, the mass every layer and head puts on those
  keys (future keys in decoder self-attention, pad keys everywhere).

`finding_kinds` says which attention kind a finding is about (from the modules it names,
matched against the recorded attention sites), for linking the attention maps too.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from tndebug.findings import Finding
from tndebug.reporters import figures_common as C
from tndebug.reporters.figures_common import DPI, KIND_SHORT, KIND_TITLE, Plot, annotate_cells, add_colorbar
from tndebug.reporters.recorder import Recorder, TraceSnapshot
from tndebug.capture.trace import KIND_WORDS as _KIND_WORDS, KINDS

KIND_WORDS = {words: kind for kind, words in _KIND_WORDS.items()}   # mask-broadcast's kind names
FORBIDDEN = {"enc_self": "pad keys", "dec_self": "future and pad keys", "cross": "source pad keys"}


def site_kinds(rec: Recorder) -> dict[str, str]:
    """Attention site (module path) -> kind, from the recorded probe batch."""
    snap, _ = rec.attention_snapshot()
    return {a.site: a.kind for a in (snap.attention if snap else [])}


def finding_kinds(f: Finding, sites: dict[str, str]) -> set[str]:
    """The attention kinds a finding is about: its place (in tndebug's naming or the model's),
    the modules its evidence names, or a kind's own name (`decoder (self-attention)`)."""
    places = [f.where, f.evidence.get("tndebug_where", "")]
    modules = f.evidence.get("modules")
    if isinstance(modules, dict):
        places += list(modules)
    kinds = {sites[p] for p in places if p in sites}
    kinds |= {KIND_WORDS[p] for p in places if p in KIND_WORDS}
    return kinds


def mask_figures(rec: Recorder, findings: list[Finding], fig_dir: Path) -> list[Plot]:
    """One figure per mask-broadcast finding that carries numbers (module masses or failed
    behaviour tests)."""
    sites = site_kinds(rec)
    out = []
    for i, f in enumerate(findings):
        if f.probe != "mask-broadcast" or not _numbers(f):
            continue
        kinds = sorted(finding_kinds(f, sites), key=KINDS.index)
        p = figure_mask(rec, f, i, kinds[0] if kinds else None, fig_dir)
        if p is not None:
            out.append(p)
    return out


def _numbers(f: Finding) -> dict:
    """{label: (value, threshold, unit)} of what the finding measured."""
    ev, out = f.evidence, {}
    thresholds = ev.get("thresholds") or {}
    mass_tol = thresholds.get("forbidden_mass")
    for site, st in (ev.get("modules") or {}).items():
        if isinstance(st, dict) and "forbidden_mass_max" in st and isinstance(mass_tol, (int, float)):
            out[f"{site}: max mass on masked keys"] = (st["forbidden_mass_max"], mass_tol, "mass")
    behaviour = dict(ev.get("behaviour") or {})
    for key in ("batch", "src_pad_length"):              # the findings without a kind
        if isinstance(ev.get(key), dict):
            behaviour[key] = ev[key]
    for test, c in behaviour.items():
        if isinstance(c, dict) and c.get("tol"):
            out[f"{test}: max |change|"] = (c["delta"], c["tol"], "change")
    return out


def figure_mask(rec: Recorder, f: Finding, index: int, kind: str | None,
                fig_dir: Path) -> Plot | None:
    numbers = _numbers(f)
    snap, note = rec.attention_snapshot()
    mass = forbidden_mass(snap, kind) if kind else None                  # [L, H] or None
    panels = 1 + (mass is not None)
    fig = Figure(figsize=(5.2 * panels + 1.2, max(2.8, 0.35 * len(numbers) + 1.8)), dpi=DPI)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    labels = list(numbers)
    ratio = [max(v / t, 1e-3) if math.isfinite(v) else 1e3 for v, t, _ in numbers.values()]
    ax.barh(range(len(labels)), ratio, color=["tab:red" if r > 1 else "tab:green" for r in ratio])
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    C.log_scale(ax, "x")
    ax.set_yticks(range(len(labels)), [_short(x) for x in labels], fontsize=7)
    ax.invert_yaxis()
    for y, (v, t, _) in enumerate(numbers.values()):
        ax.text(ax.get_xlim()[0] * 1.3, y, f" {v:.3g} (limit {t:.3g})", va="center", fontsize=7,
                color="white")
    ax.set_xlabel("measured / its threshold (dashed: 1)", fontsize=8)
    ax.set_title("What the finding measured", fontsize=9)
    if mass is not None:
        ax2 = axes[1]
        im = ax2.imshow(mass, cmap="magma", vmin=0, vmax=max(1e-6, float(np.nanmax(mass)), 0.05),
                        aspect="auto")
        ax2.set_xticks(range(mass.shape[1]), [f"h{h}" for h in range(mass.shape[1])], fontsize=7)
        ax2.set_yticks(range(mass.shape[0]), [str(l) for l in range(mass.shape[0])], fontsize=7)
        ax2.set_xlabel("head", fontsize=8)
        ax2.set_ylabel("layer", fontsize=8)
        annotate_cells(ax2, mass, im)
        ax2.set_title(f"Probe batch, step {snap.step}: max mass on {FORBIDDEN[kind]}", fontsize=9)
        add_colorbar(fig, im, "attention mass", left=0.30, top=0.80, bottom=0.2, wspace=0.35)
    else:
        fig.subplots_adjust(left=0.45, right=0.97, top=0.80, bottom=0.2)
    what = KIND_TITLE.get(kind, f.where or "the model") if kind else (f.where or "the model")
    fig.suptitle(f"mask-broadcast evidence: {what}" + (f"\n{note}" if note and mass is not None
                                                     else ""), fontsize=10)
    name = f"mask_{kind or 'model'}_{index}.png"
    labels_ = C.axis_labels(fig)
    C.save(fig, fig_dir / name)
    caption = ("Left: each number the finding carries, divided by the threshold it was judged "
               "against (log scale; red bars cross it): the mass real queries put on keys they "
               "must not see, and the change of the outputs in the behaviour tests.")
    if mass is not None:
        caption += (f" Right: the largest share of attention any real query of the probe batch "
                    f"(at step {snap.step}) puts on {FORBIDDEN[kind]}, per layer and head "
                    f"(0 in a correct {KIND_SHORT[kind]} attention).")
    return Plot(name, f"Evidence: mask-broadcast, {KIND_SHORT.get(kind, 'model') if kind else 'model'}",
                caption, findings=(index,), labels=labels_)


def forbidden_mass(snap: TraceSnapshot | None, kind: str) -> np.ndarray | None:
    """[layers, heads] the largest attention mass a real query row puts on keys it must not
    see (pad keys; future keys too in decoder self-attention), over the kept examples; None
    when the tokens of the probe batch were not recorded with the attention."""
    if snap is None:
        return None
    recs = sorted((a for a in snap.attention if a.kind == kind and a.layer is not None),
                  key=lambda a: a.layer)
    q_tok = snap.src if kind == "enc_self" else snap.tgt
    k_tok = snap.tgt if kind == "dec_self" else snap.src
    if not recs or q_tok is None or k_tok is None:
        return None
    b, _, T, S = recs[0].probs.shape
    if q_tok.shape[0] < b or q_tok.shape[1] != T or k_tok.shape[0] < b or k_tok.shape[1] != S:
        return None
    allowed = (k_tok[:b] != snap.pad_id)[:, None, None, :]                     # [b, 1, 1, S]
    if kind == "dec_self":
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()         # [b, 1, T, S]
    real = (q_tok[:b] != snap.pad_id)[:, None, :]                             # [b, 1, T]
    L = max(a.layer for a in recs) + 1
    H = max(a.probs.shape[1] for a in recs)
    out = np.full((L, H), np.nan)
    for a in recs:
        p = torch.nan_to_num(a.probs.float(), nan=0.0)                        # [b, h, T, S]
        forb = (p * ~allowed).sum(-1)                                         # [b, h, T]
        forb = torch.where(real.expand_as(forb), forb, torch.zeros_like(forb))
        out[a.layer, :p.shape[1]] = forb.amax(dim=(0, 2)).numpy()
    return out


def _short(label: str, n: int = 60) -> str:
    return label if len(label) <= n else "…" + label[-(n - 1):]
