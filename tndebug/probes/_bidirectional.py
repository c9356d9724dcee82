"""An encoder must see both sides: mask-broadcast's test of an encoder-only model's attention.

A decoder's causality test asks that the tokens after t leave the outputs at <= t unchanged; an
encoder's self-attention must do the opposite, in both directions (exact, eval, Subject calls):

* `later`: resampling the tokens after t must change the outputs at <= t;
* `earlier`: resampling the tokens before t must change the outputs at >= t.

A causal mask (a decoder's mask helper copied into an encoder, `is_causal=True` left on, a tril
where only the padding mask belongs) fails `later`; a transposed one (triu) fails `earlier`. Each
is told from a change of at most float rounding, so the decision needs no threshold tuned on a
model: `compare`'s tolerance (REL_TOL of the outputs' scale, two orders above fp32 rounding). A
trace then names the modules whose probabilities put no mass on any later (earlier) key, in any
head or row: one layer made causal while another still mixes both sides leaves the outputs
changing, and only its probabilities show it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tndebug.probes.raised import call as _call
from tndebug.probes._attn_stats import as_heads
from tndebug.probes._mask_tests import MASS_TOL, REL_TOL, Check, other_tokens, compare
from tndebug.subject import Subject

SIDE = {"later": ("the tokens after t", "the outputs at positions <= t", "causal"),
        "earlier": ("the tokens before t", "the outputs at positions >= t", "one-sided")}
INPUT = {"later": "unpadded rows with the tokens after t resampled",
         "earlier": "unpadded rows with the tokens before t resampled"}
FIX = {"later": ("An encoder's self-attention is bidirectional: mask only the pads "
                 "(keep = ids != pad_id, [B, 1, 1, S]), with no tril. A causal mask comes from "
                 "a decoder's code: is_causal=True on the attention (SDPA's is_causal= or the "
                 "module's flag), a causal mask helper (Hugging Face: create_causal_mask, or "
                 "config.is_decoder=True) where the bidirectional one belongs "
                 "(create_bidirectional_mask), or `& tril(ones(S, S))` added to the pad mask."),
       "earlier": ("An encoder's self-attention is bidirectional: mask only the pads "
                   "(keep = ids != pad_id, [B, 1, 1, S]). A mask that hides every earlier key "
                   "is a transposed causal mask (triu where tril was meant, or keep and mask "
                   "swapped in a masked_fill): remove it, or, in a decoder, use tril.")}


@dataclass
class Sides:
    """The two directions' smallest change (`later`, `earlier`: a Check per direction, `delta`
    the smallest over the cut points of the largest change), and the one-sided modules."""
    later: Check = field(default_factory=Check)
    earlier: Check = field(default_factory=Check)
    per_cut: dict = field(default_factory=dict)          # direction -> {t: change}
    blind: dict = field(default_factory=dict)            # direction -> [module path]
    masses: dict = field(default_factory=dict)           # module -> {"later": max, "earlier": max}
    traced: bool = False                                 # probabilities were seen

    def one_sided(self, side: str) -> bool:
        """The outputs ignore that side: no change beyond rounding at some cut point."""
        c = getattr(self, side)
        return c.finite and c.delta <= c.tol


def _rows(s: Subject, rows: int = 4, length: int = 10) -> torch.Tensor:
    """The test's input: unpadded rows of random content ids.  # [rows, length]"""
    g = torch.Generator().manual_seed(13)
    return torch.randint(s.first_content, s.src_vocab, (rows, s.fit(length)), generator=g).to(s.device)


def measure(s: Subject) -> Sides:
    """Both directions on unpadded rows, then one trace of their probabilities. Raises
    ModelRaised when the model raises on these inputs (mask-broadcast reports it)."""
    out = Sides()
    ids = _rows(s)
    S = ids.shape[1]
    g = torch.Generator().manual_seed(14)
    ref = _call("unpadded rows", s.logits, ids, ids)                          # [B, S, V]
    for side, cuts in (("later", sorted({0, S // 3, S // 2, S - 2})),
                       ("earlier", sorted({1, S // 2, 2 * S // 3, S - 1}))):
        worst: Check | None = None
        out.per_cut[side] = {}
        for t in cuts:
            alt = ids.clone()
            cols = slice(t + 1, None) if side == "later" else slice(0, t)
            alt[:, cols] = other_tokens(s, alt[:, cols], g, s.src_vocab)
            new = _call(INPUT[side], s.logits, alt, alt)
            seen = slice(0, t + 1) if side == "later" else slice(t, None)
            c = compare(ref[:, seen], new[:, seen])
            out.per_cut[side][t] = c.delta
            if not c.finite:
                worst = Check(finite=False)
                break
            worst = c if worst is None or c.delta / c.tol < worst.delta / worst.tol else worst
        setattr(out, side, worst or Check())
    if s.capture is not None:
        _trace(s, ids, out)
    return out


def _trace(s: Subject, ids: torch.Tensor, out: Sides) -> None:
    """The largest mass any real query of any head puts on the keys after it (before it), per
    self-attention module of the trace; a module whose largest is <= MASS_TOL sees one side."""
    trace = s.trace(ids, ids, reads=("attn.probs",))
    S = ids.shape[1]
    for rec in trace.records():
        if rec.probs is None or rec.kind != "enc_self":
            continue
        p = as_heads(rec.probs).float()                                       # [B, h, S, S]
        if p.shape[-2:] != (S, S) or not bool(p.isfinite().all()):
            continue
        out.traced = True
        ones = torch.ones(S, S, dtype=torch.bool, device=p.device)
        later = (p * ones.triu(1)).sum(-1)[..., :-1]                          # rows with a later key
        earlier = (p * ones.tril(-1)).sum(-1)[..., 1:]                        # rows with an earlier key
        out.masses[rec.site] = {"later": float(later.max()), "earlier": float(earlier.max())}
        for side, m in (("later", later), ("earlier", earlier)):
            if float(m.max()) <= MASS_TOL:
                out.blind.setdefault(side, []).append(rec.site)


def report(probe, sides: Sides) -> None:
    """mask-broadcast's findings for an encoder-only model's directions: `encoder-causal`
    (later tokens unseen) and `encoder-one-sided` (earlier tokens unseen), an error each, at the
    first module whose probabilities show it, else at the encoder's self-attention as a whole.
    When the outputs ignore a side yet every module's probabilities read it, the mask is not the
    cause: no verdict, and why."""
    if not (sides.later.finite and sides.earlier.finite):
        probe.skip("non-finite outputs: the encoder's two-sided test is inconclusive", where="")
        return
    probe.cover("", "checked")
    for side in ("later", "earlier"):
        tokens, outputs, word = SIDE[side]
        c, mods = getattr(sides, side), sides.blind.get(side, [])
        behaviour = sides.one_sided(side)
        if not behaviour and not mods:
            continue
        if behaviour and not mods and sides.traced:
            probe.skip(f"{outputs} do not change when {tokens} are resampled, yet every "
                       f"self-attention's probabilities read {side} keys: the information is "
                       f"lost outside the mask", where="encoder self-attention")
            continue
        where = mods[0] if mods else "encoder self-attention"
        more = f" (+{len(mods) - 1} more modules)" if len(mods) > 1 else ""
        if behaviour:
            text = (f"{outputs} do not change when {tokens} are resampled (at most "
                    f"{c.delta:.3g}, rounding is <= {c.tol:.3g}): the attention is {word}, and "
                    f"an encoder must see both sides")
        else:
            text = (f"real queries put no attention (at most {sides.masses[where][side]:.1e}) on "
                    f"any {side} key, in any head: this module's mask is {word}; the outputs still "
                    f"change with {tokens} through the other layers")
        probe.report("error", f"{where}: {text}{more}", where=where, step=0, code=(
            "encoder-causal" if side == "later" else "encoder-one-sided"),
            evidence={"direction": side, "min_change": c.delta, "tolerance": c.tol,
                      "change_per_cut": {str(t): d for t, d in sides.per_cut[side].items()},
                      "modules": {m: sides.masses[m] for m in mods},
                      "thresholds": {"behaviour": f"max|change| <= {REL_TOL:g}*(1+max|ref|) at "
                                                  f"some cut t: that side unseen",
                                     "mass": f"max mass on {side} keys <= {MASS_TOL:g}"}},
            fix=FIX[side])
