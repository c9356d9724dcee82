"""missing-scale's fit: the scale actually applied between the projections' outputs and the
softmax input, c = <S, QK^T> / ||QK^T||^2, from one attention record's tensors (the probe's class
and its judgement are in missing_scale.py). Sums, not ratios, so that they add across steps and
processes."""
from __future__ import annotations

import math

import torch

from tndebug.probes._attn_stats import masked_entries
from tndebug.capture.trace import AttentionRecord

# P_FLOOR: float precision, no run (8a62a05).
P_FLOOR = 1e-30                      # probabilities below this are underflow, not a signal


_UNSET = object()


def fit_sums(rec: AttentionRecord, masked=_UNSET):
    """(sums [<x,y>, <x,x>, <y,y>, sum q^2, n_q, sum k^2, n_k, sum (q-k)^2, n_qk] on the device,
    source); or None.

    From the scores (the softmax input before the mask): y = S, x = QK^T over the entries the
    mask kept, each centred across the batch at its (head, query, key) position. Centring
    removes any term that does not depend on the sequence (a relative position bias, ALiBi, an
    additive causal mask), so the fit sees the scale alone: S = c QK^T + B(h, t, s) gives c
    exactly. From the probabilities only: y = row-centred ln P, x = row-centred QK^T over kept
    entries (the row constant ln Z cancels). Sums, not ratios, so that statistics add across
    processes. `masked`: masked_entries(rec), when the caller has it already.
    # q [B, h, T, d_k], k [B, h, S, d_k]
    """
    q, k = rec.q, rec.k
    if q is None or k is None or q.dim() != 4 or k.dim() != 4:
        return None
    # finiteness read before the float64 casts (which keep it) as |v| < inf (False for NaN and
    # +-inf: isfinite's values in 2 ops, not 4): every-step watch fits at every attention site
    # on small tensors, where each op's fixed cost is the cost
    qk32 = q.float() @ k.float().transpose(-2, -1)                        # [B, h, T, S]
    qk = qk32.double()
    if masked is _UNSET:
        masked = masked_entries(rec)
    if rec.scores is not None and rec.scores.shape == qk.shape:
        use = (rec.scores.abs() < math.inf) & (qk32.abs() < math.inf)
        y = rec.scores.double()
        if masked is not None:
            use &= ~masked
        # a probability of exactly 0 is a key the mask removed, even when the captured scores
        # already hold the mask's fill (MVP adds finfo.min to the product before the softmax,
        # so scores == masked scores and `masked` is empty: bench/hf_unseen.py DEV). A finite
        # unmasked score difference underflows to 0 only beyond ~100 nats, where the entry adds
        # nothing the fit needs (the kept entries give c as well).
        if rec.probs is not None and not rec.head_averaged and rec.probs.shape == qk.shape:
            use &= rec.probs != 0
        if qk.shape[0] >= 2:
            n = use.sum(0, keepdim=True)                                   # [1, h, T, S]
            use &= n >= 2
            n = n.clamp_min(1)
            x, y = qk.where(use, 0.0), y.where(use, 0.0)
            x = (x - x.sum(0, keepdim=True) / n).where(use, 0.0)
            y = (y - y.sum(0, keepdim=True) / n).where(use, 0.0)
        else:
            x, y = qk.where(use, 0.0), y.where(use, 0.0)
        source = "scores"
    else:
        p = rec.probs
        if p is None or rec.head_averaged or p.shape != qk.shape:
            return None
        p = p.double()
        use = p.isfinite() & (p > P_FLOOR) & qk.isfinite()
        if masked is not None:
            use &= ~masked
        n = use.sum(-1, keepdim=True)                                      # [B, h, T, 1]
        use &= n >= 2
        n = n.clamp_min(1)
        x, y = qk.where(use, 0.0), p.clamp_min(P_FLOOR).log().where(use, 0.0)
        x = (x - x.sum(-1, keepdim=True) / n).where(use, 0.0)
        y = (y - y.sum(-1, keepdim=True) / n).where(use, 0.0)
        source = "log-probs"
    qf = torch.nan_to_num(q.double(), nan=0.0, posinf=0.0, neginf=0.0)   # non-finite -> 0
    kf = torch.nan_to_num(k.double(), nan=0.0, posinf=0.0, neginf=0.0)
    one = qk.new_ones(())
    same = q.shape == k.shape                 # self-attention: is q the same tensor as k?
    dd = ((qf - kf) ** 2).sum() if same else one * 0
    return torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum(),
                        (qf * qf).sum(), one * q.numel(), (kf * kf).sum(), one * k.numel(),
                        dd, one * (k.numel() if same else 0)]), source


def fit_from_sums(sxy: float, sxx: float, syy: float) -> tuple[float, float]:
    """(c, relative residual ||y - c x|| / ||y||); NaN when nothing was finite."""
    if not sxx > 0 or not syy > 0:
        return math.nan, math.nan
    c = sxy / sxx
    return c, math.sqrt(max(syy - sxy * c, 0.0) / syy)
