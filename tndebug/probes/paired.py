"""Paired comparisons of held-out losses: one model, two ways of running it, compared sequence
by sequence. Triage's temperature sweep (triage/hygiene.py: the scores times alpha) and the
grouped-query kv-order test (probes/kv_order.py: the repeated heads in the other order) both
ask "is the other way significantly better?", with one rule, kept here below both front-ends
so `tndebug.check` and `tndebug triage` share it."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

# SOLVED: no run (docs/severity.md): data the model does not solve decides nothing.
SOLVED = 0.5            # a comparison is judged only if the better loss < SOLVED * ln V

# A mismatch needs a significant gain (for the sweep: over alpha = 1; the argmin of 13 noisy
# losses is never exactly 1): paired over the held-out sequences, the gain must be positive on a clear
# majority of them and its mean more than 2 standard errors (a one-sided z of 2, p ~ 0.02), and
# large in itself, >= MIN_GAIN_NATS and >= MIN_GAIN_REL of the loss at alpha = 1. A checkpoint
# trained without 1/sqrt(d_k) and loaded into scaled code is off by sqrt(d_k) >= 2.8 and loses
# nats, not hundredths; a gain below 0.05 nats per token (a likelihood ratio of 1.05) is what
# temperature calibration of a healthy model gives, not a missing scale.
# Set on no run (d1c22cc): statistical levels; only unit tests reach them (not held out; docs/thresholds.md).
MIN_SEQS = 8            # fewer paired sequences: no test, no finding
MAJORITY = 0.75         # share of sequences whose loss is lower at the best alpha
Z_SE = 2.0              # mean gain > Z_SE standard errors
MIN_GAIN_NATS = 0.05
MIN_GAIN_REL = 0.05


def sequence_losses(forward: Callable, src, tgt_in, tgt_out, pad_id: int) -> tuple[float, torch.Tensor]:
    """(mean cross-entropy over non-pad targets, per-sequence mean cross-entropy [B]); rows
    without a target token are NaN."""
    logits = forward(src, tgt_in)                                          # [B, T, V]
    B, T = tgt_out.shape
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt_out.reshape(-1),
                          ignore_index=pad_id, reduction="none").reshape(B, T)   # [B, T]
    keep = (tgt_out != pad_id).float()                                     # [B, T]
    n = keep.sum(1)                                                        # [B]
    per_seq = (tok * keep).sum(1) / n                                      # [B], NaN where n = 0
    return float((tok * keep).sum() / keep.sum().clamp(min=1)), per_seq


def paired_gain(at_1: torch.Tensor, at_best: torch.Tensor) -> dict:
    """The paired comparison of per-sequence losses at alpha = 1 and at the best alpha."""
    ok = at_1.isfinite() & at_best.isfinite()
    gain = (at_1 - at_best)[ok].double()                                   # [n] > 0: best is better
    n = int(gain.numel())
    if n < 2:
        return {"n": n}
    mean = float(gain.mean())
    se = float(gain.std(unbiased=True)) / math.sqrt(n)
    return {"n": n, "mean_gain": mean, "se": se, "z": mean / se if se > 0 else
            (math.inf if mean > 0 else 0.0), "share_better": float((gain > 0).double().mean())}
