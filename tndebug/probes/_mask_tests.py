"""mask-broadcast's exact tests: the inputs it builds (a right-padded batch, longer sequences,
other tokens), the behaviour tests that compare the model's outputs on them, and the checks of
each attention module's probabilities against the masks it must apply. The probe that runs
them, and says which attention breaks them, is mask_broadcast.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes.raised import ModelRaised, call as _call
from tndebug.probes._attn_stats import as_heads, probe_batch
from tndebug.probes._tolerance import tol
from tndebug.subject import Subject

# Exact tests, set on no run (8a62a05): fp32 rounding ~1e-7 vs effects of 1e-2..1. In 16 bits each
# is raised to 2 eps of the compute dtype (_tolerance.tol; MASS_TOL stays: a masked key's
# probability is exactly 0 in every dtype).
REL_TOL = 1e-5     # behaviour: max|change| > REL_TOL * (1 + max|reference|)
MASS_TOL = 1e-6    # probability a real query puts on keys it must not see
SUM_TOL = 1e-5     # |sum_j P_ij - 1| on real query rows
FIT_TOL = 1e-3     # relative residual of q (cross: k) as an affine map of its input row
EXTRA_PADS = 3     # pad columns appended in the pad-length tests
KINDS = ("enc_self", "dec_self", "cross")
NOTE = {k: FAULT_NOTES[k][2] for k in ("mask_inverted", "pad_mask_query_axis", "no_causal_mask",
                                        "causal_transposed", "mask_after_softmax", "no_memory_mask",
                                        "softmax_wrong_dim", "view_without_transpose")}


@dataclass
class Check:
    """One behavioural comparison: max |change| against its tolerance."""
    delta: float = 0.0
    tol: float = 0.0
    finite: bool = True

    @property
    def failed(self) -> bool:
        return self.finite and self.delta > self.tol

    def merge(self, other: "Check") -> "Check":
        worst = max(self, other, key=lambda c: (c.failed, c.delta / max(c.tol, 1e-30)))
        return Check(worst.delta, worst.tol, self.finite and other.finite)


def compare(ref: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None = None) -> Check:
    """ref, new [B, T, *]; keep [B, T] selects the positions compared."""
    if keep is not None:
        ref, new = ref[keep], new[keep]
    if ref.numel() == 0:
        return Check()
    finite = bool(ref.isfinite().all() and new.isfinite().all())
    if not finite:
        return Check(finite=False)
    return Check(float((new - ref).abs().max()), tol(REL_TOL, ref, new) * (1 + float(ref.abs().max())))


@dataclass
class Module:
    site: str
    kind: str
    stats: dict = field(default_factory=dict)
    problem: str = ""      # from the probabilities (exact)
    fix: str = ""
    code: str = ""         # the finding's code (mask-broadcast/<code>)
    fit: float | None = None   # affine-fit residual of the head split (worse side)
    fit_sides: dict = field(default_factory=dict)   # {"split" | "merge": residual}
    sources: dict = field(default_factory=dict)     # op role -> the user's line (AttentionRecord.sources)


def _content(s: Subject, like: torch.Tensor, g: torch.Generator, vocab: int) -> torch.Tensor:
    return torch.randint(s.first_content, vocab, like.shape, generator=g).to(like.device)


def other_tokens(s: Subject, x: torch.Tensor, g: torch.Generator, vocab: int) -> torch.Tensor:
    """Different content tokens at every position of x (content ids in, content ids out)."""
    lo, n = s.first_content, vocab - s.first_content
    r = torch.randint(1, max(n, 2), x.shape, generator=g).to(x.device)
    return lo + (x - lo + r) % n


def _longer(s: Subject, x: torch.Tensor, n: int, g: torch.Generator, vocab: int):
    """x with `n` columns appended: pads in every row but the first unpadded one, which gets
    real tokens, so that the batch is as long as its longest row (code that builds its masks
    from the rows' lengths, `sequence_mask(lengths)`, sees a batch it can take). Returns
    (longer [B, S+n], rows whose first S positions are comparable [B])."""
    out = torch.cat([x, torch.full((x.shape[0], n), s.pad_id, dtype=x.dtype, device=x.device)], 1)
    keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    full = (x != s.pad_id).all(1).nonzero()
    if len(full):
        b = int(full[0])
        out[b, x.shape[1]:] = _content(s, out[b, x.shape[1]:], g, vocab)
        keep[b] = False
    return out, keep


BASE = "a right-padded batch (half the rows padded, the others without padding)"
INPUTS = {"base": BASE,
          "causality": BASE + " with the later target tokens resampled",
          "tgt_pad_content": BASE + " with the target pads replaced by tokens",
          "tgt_pad_length": BASE + f" with {EXTRA_PADS} target pad columns appended",
          "src_pad_length": BASE + f" with {EXTRA_PADS} source pad columns appended",
          "batch": "one example alone (a row without padding, batch of 1)"}


# Errors that say a row's every key was masked: the nested-tensor fast path of
# nn.TransformerEncoder (eval mode) drops masked keys and cannot pad an empty row back, and a
# softmax over nothing has no defined output. On "a row without padding" that means the padding
# mask is inverted (True = keep where the code expects True = pad).
EMPTY_ROW = ("to_padded_tensor", "non-zero numel", "nested")


def likely_cause(e: ModelRaised) -> tuple[str, str] | None:
    text = str(e.error)
    if any(w in text for w in EMPTY_ROW):
        return ("a row whose every key is masked: on rows without padding that is an inverted "
                "key padding mask",
                "nn.Transformer / nn.MultiheadAttention take key_padding_mask with True at the "
                "pads (src == pad_id), not at the tokens to keep; " + NOTE["mask_inverted"])
    return None


def behaviour(s: Subject) -> dict[str, Check]:
    """Causality, pad length/content and batch independence (eval mode, Subject calls only).
    Raises ModelRaised when the model raises on one of these inputs."""
    g = torch.Generator().manual_seed(7)
    out = {k: Check() for k in ("causality", "tgt_pad_length", "tgt_pad_content", "enc_pad_length",
                                 "src_pad_length", "enc_batch", "batch")}
    has_encode = True
    cap = s.fit(12 + EXTRA_PADS) - EXTRA_PADS               # room for the appended pads
    logits = lambda what, src, tgt: _call(INPUTS[what], s.logits, src, tgt)   # noqa: E731
    encode = lambda what, src: _call(INPUTS[what], s.encode, src)              # noqa: E731
    for src, tgt in (probe_batch(s, 6, min(10, cap), min(9, cap), seed=1),
                     probe_batch(s, 5, min(7, cap), min(12, cap), seed=2)):
        pad, T = s.pad_id, tgt.shape[1]
        real_s, real_t = src != pad, tgt != pad
        if s.has_target:
            full = tgt.where(real_t, _content(s, tgt, g, s.tgt_vocab))      # no target pads
            base = logits("tgt_pad_content", src, full)
            for t in sorted({0, T // 3, T // 2, T - 2}):
                alt = full.clone()
                alt[:, t + 1:] = other_tokens(s, alt[:, t + 1:], g, s.tgt_vocab)
                out["causality"] = out["causality"].merge(
                    compare(base[:, :t + 1], logits("causality", src, alt)[:, :t + 1]))
            ref = logits("base", src, tgt)
            longer, rows = _longer(s, tgt, EXTRA_PADS, g, s.tgt_vocab)
            out["tgt_pad_length"] = out["tgt_pad_length"].merge(
                compare(ref, logits("tgt_pad_length", src, longer)[:, :T], real_t & rows[:, None]))
            out["tgt_pad_content"] = out["tgt_pad_content"].merge(
                compare(ref, base, real_t))
        enc = None
        if s.has_source:
            longer, rows = _longer(s, src, EXTRA_PADS, g, s.src_vocab)
            if s.has_target:
                out["src_pad_length"] = out["src_pad_length"].merge(
                    compare(ref, logits("src_pad_length", longer, tgt), real_t & rows[:, None]))
            enc = encode("base", src)
        has_encode = has_encode and enc is not None
        if enc is not None:
            enc_longer = encode("src_pad_length", longer)[:, :src.shape[1]]
            out["enc_pad_length"] = out["enc_pad_length"].merge(
                compare(enc, enc_longer, real_s & rows[:, None]))
        for b in (1, 3):                     # unpadded rows: a batch of one is as long as its row
            one = slice(b, b + 1)
            if s.has_target:
                out["batch"] = out["batch"].merge(
                    compare(ref[one], logits("batch", src[one], tgt[one]), real_t[one]))
            if enc is not None:
                out["enc_batch"] = out["enc_batch"].merge(
                    compare(enc[one], encode("batch", src[one]), real_s[one]))
    if not has_encode:
        out.pop("enc_pad_length"), out.pop("enc_batch")
    if not s.has_source:                     # decoder-only: no source side to pad
        out.pop("src_pad_length")
    if not s.has_target:                     # encoder-only: its tests are the encoder's (enc_*)
        for k in ("causality", "tgt_pad_length", "tgt_pad_content", "src_pad_length", "batch"):
            out.pop(k)
    return out


def expected(kind: str, src: torch.Tensor, tgt: torch.Tensor, pad: int):
    """(real query rows [B, 1, Tq], allowed keys [B, 1, Tq, Sk]) from the inputs alone."""
    sk, tk = src != pad, tgt != pad
    q_real, k_ok = {"enc_self": (sk, sk), "cross": (tk, sk), "dec_self": (tk, tk)}[kind]
    allowed = k_ok[:, None, :].expand(-1, q_real.shape[1], -1)                # [B, Tq, Sk]
    if kind == "dec_self":
        T = tgt.shape[1]
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=tgt.device).tril()
    return q_real[:, None], allowed[:, None]


def _normalised_axis(p: torch.Tensor, sum_tol: float = SUM_TOL) -> str | None:
    """The axis other than keys and queries that the probabilities [B, h, T, S] sum to 1 over
    (a softmax taken over the batch or the heads), or None. Exact: a softmax's sums are 1 to
    rounding, and no other axis sums to 1 by accident on random inputs of more than one row."""
    q = p.nan_to_num()
    for axis, name in ((0, "batch"), (1, "heads")):
        if p.shape[axis] > 1 and float((q.sum(axis) - 1).abs().max()) <= sum_tol:
            return name
    return None


def probs_check(m: Module, p: torch.Tensor, src, tgt, pad) -> str:
    """Mass on keys a real query must not see, row sums; sets m.problem when one fails.
    Returns "" when the probabilities were tested, else why they could not be."""
    sum_tol = tol(SUM_TOL, p)                 # the probabilities' own rounding counts
    p = as_heads(p).float()                                                   # [B, h, Tq, Sk]
    q_real, allowed = expected(m.kind, src, tgt, pad)
    if p.shape[0] != allowed.shape[0] or p.shape[-2:] != allowed.shape[-2:]:
        return (f"probabilities of shape {list(p.shape)} do not match the inputs' "
                f"[B={allowed.shape[0]}, Tq, Sk={allowed.shape[-1]}]")
    rows = (q_real & allowed.any(-1)).expand(p.shape[:3]) & p.isfinite().all(-1)   # [B, h, Tq]
    if not bool(rows.any()):
        return "no real query row with finite probabilities"
    forb = (p * ~allowed).sum(-1)[rows]
    hidden = rows & (~allowed).any(-1)                  # real rows that have keys to hide
    seen = (p * allowed).sum(-1)[hidden] if bool(hidden.any()) else p.new_ones(1)
    tot = p.sum(-1)[rows]
    col_err = float((p.nan_to_num().sum(-2) - 1).abs().max())
    st = dict(forbidden_mass_max=float(forb.max()), forbidden_mass_mean=float(forb.mean()),
              row_sum_min=float(tot.min()), row_sum_max=float(tot.max()), column_sum_err=col_err,
              blind_rows=float((seen < MASS_TOL).float().mean()))
    if m.kind == "dec_self":
        past = torch.ones(p.shape[-2:], dtype=torch.bool, device=p.device).tril(-1)
        st["past_mass_mean"] = float((p * (past & allowed)).sum(-1)[rows & past.any(-1)].mean())
    m.stats = st
    sum_err = max(abs(st["row_sum_min"] - 1), abs(st["row_sum_max"] - 1))
    span = f"{st['row_sum_min']:.3f}..{st['row_sum_max']:.3f}"
    other = _normalised_axis(p, sum_tol) if sum_err > sum_tol else None
    if sum_err > sum_tol:
        if col_err <= sum_tol:
            m.problem, m.fix = f"softmax over the query axis: columns sum to 1, rows to {span}", NOTE["softmax_wrong_dim"]
            m.code = "softmax-axis"
        elif other is not None:
            m.problem = f"softmax over the {other} axis: it sums to 1 there, the rows to {span}"
            m.fix, m.code = NOTE["softmax_wrong_dim"], "softmax-axis"
        elif st["forbidden_mass_max"] <= MASS_TOL:
            m.problem = f"rows sum to {span}, not 1: masked after softmax (masked keys stay in the denominator)"
            m.fix, m.code = NOTE["mask_after_softmax"], "mask-after-softmax"
        else:
            m.problem, m.fix = f"attention rows sum to {span}, not 1", NOTE["mask_after_softmax"]
            m.code = "row-sums"
    elif st["forbidden_mass_max"] > MASS_TOL:
        mass = st["forbidden_mass_max"]
        if st["blind_rows"] >= 0.99:
            m.problem = "mask inverted: real queries attend only to the keys that should be masked"
            m.fix, m.code = NOTE["mask_inverted"], "mask-inverted"
        elif m.kind == "dec_self" and st.get("past_mass_mean", 1.0) <= MASS_TOL:
            m.problem, m.fix = "causal mask transposed: queries see the future and not the past", NOTE["causal_transposed"]
            m.code = "causal-transposed"
        elif m.kind == "dec_self":
            m.problem = f"real queries put up to {mass:.3f} of their attention on future keys (no causal mask)"
            m.fix, m.code = NOTE["no_causal_mask"], "causal-leak"
        elif m.kind == "cross":
            m.problem = f"real queries put up to {mass:.3f} of their attention on source pad keys (no memory mask)"
            m.fix, m.code = NOTE["no_memory_mask"], "memory-leak"
        else:
            m.problem = (f"real queries put up to {mass:.3f} of their attention on pad keys "
                         f"(padding mask on the query axis, or missing)")
            m.fix, m.code = NOTE["pad_mask_query_axis"], "pad-leak"
    return ""
