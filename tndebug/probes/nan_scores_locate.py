"""nan-scores' search for the first NaN/Inf of a pass (the probe's class and its findings are in
nan_scores.py): which captured tensor, in execution order, holds one first, by module and op; the
fully-masked rows and the mask fill of its attention; the user's line; and the one-sum-per-tensor
flags the probe syncs every probed step."""
from __future__ import annotations

import math

import torch

from tndebug.probes._attn_stats import fully_masked_rows, masked_entries, roles
from tndebug.capture.source import pick, with_also
from tndebug.capture.trace import Trace

OPS = {"q": "query projection", "k": "key projection", "v": "value projection",
       "scores": "QK^T scores", "masked_scores": "masking", "probs": "softmax",
       "z": "attention-weighted sum", "out": "attention output projection",
       "stream": "sublayer (residual/norm)", "ffn.hidden": "feed-forward ReLU",
       "logits": "generator", "embed.tok": "token embedding", "embed.pe": "positional encoding",
       "embed.out": "embedding + PE"}


def _bad(x: torch.Tensor, role: str) -> torch.Tensor:
    """Non-finite entries; -inf in masked scores is the mask itself, not a fault."""
    if role == "masked_scores":
        return x.isnan() | (x == math.inf)
    return ~x.isfinite()


def bad_flags(plain: list[torch.Tensor], masked: list[torch.Tensor]) -> torch.Tensor | None:
    """[len(plain) + len(masked)] device flags, 1.0 where a tensor holds a bad entry (floats,
    so that flags add across processes); the same verdict as `_bad(x, role).any()`.

    One pass per tensor: its float32 sum is non-finite iff an entry is (NaN and ±inf
    propagate; a finite sum could overflow only past 3e38, and a false flag costs a replay
    that finds nothing, never a finding). Masked scores may hold -inf, so for them only NaN
    or +inf counts: their max is NaN or +inf exactly then. (The isfinite/any per tensor this
    replaces made three passes.)"""
    flags = [x.sum(dtype=torch.float32) for x in plain]
    flags += [x.amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32) for x in masked]
    if not flags:
        return None
    top = torch.stack(flags)
    bad = ~top.isfinite()
    if masked:
        bad[len(plain):] = top[len(plain):].isnan() | (top[len(plain):] == math.inf)
    return bad.float()


def first_nonfinite(trace: Trace) -> dict | None:
    """The first captured tensor, in execution order, holding NaN or Inf (host sync)."""
    role_of = roles(trace)
    for name, x in trace.order:
        if not x.is_floating_point():
            continue
        site, role = role_of.get(id(x), (name, ""))
        bad = _bad(x, role)
        if not bool(bad.any()):
            continue
        rows = int(bad.reshape(-1, x.shape[-1]).any(-1).sum()) if x.dim() else 1
        nan, inf = bool(x.isnan().any()), bool(bad.logical_and(~x.isnan()).any())
        what = "NaN and Inf" if nan and inf else "NaN" if nan else "Inf"
        out = dict(tensor=name, where=site,
                   op=OPS.get(role, "op"), what=what, rows=rows)
        rec = trace.attention.get(site)
        if rec is not None:
            out.update(_fully_masked(rec))
        line = nonfinite_line(trace, site, out)
        if line is not None:
            out["source"] = line        # popped into the finding's source, not its evidence
        return out
    return None


def _attention_at(trace: Trace, where: str):
    """The attention record of `where` or of the attention module holding it (its dropout)."""
    rec = trace.attention.get(where)
    if rec is None:
        rec = next((r for s, r in trace.attention.items() if where.startswith(s.split("#")[0] + ".")), None)
    return rec


def fill_line(rec) -> dict | None:
    """The line that fills the masked scores (masked_fill, the added mask, SDPA's mask), the
    line that built the mask second."""
    if rec is None:
        return None
    s = rec.sources
    applied = next((s[r] for r in ("mask", "mask_add", "add", "sdpa") if s.get(r)), None)
    return with_also(applied, (s.get("mask_built"), "the mask is built here"))


def nonfinite_line(trace: Trace, where: str, found: dict) -> dict | None:
    """The user's line for the first non-finite tensor: in an attention whose rows are all
    masked, the fill; elsewhere in an attention its softmax or score product; else the line
    that made the module's output (capture/origins.py), when recorded."""
    rec = _attention_at(trace, where)
    if rec is not None:
        fm = fully_masked_rows(rec)
        if fm is not None and bool(fm.any()):
            line = fill_line(rec)
            if line is not None:
                return line
        return pick(rec.sources, "softmax", "sdpa", "scores") if rec.sources else None
    return trace.made.get(where)


def mask_fill(rec) -> float | None:
    """The value written into masked scores (the most negative one), or None."""
    masked = masked_entries(rec)
    if masked is None or not bool(masked.any()):
        return None
    return float(rec.masked_scores[masked].min())


def _fully_masked(rec) -> dict:
    fm = fully_masked_rows(rec)
    if fm is None:
        return {}
    after = rec.probs if rec.probs is not None else rec.z
    out = {"fully_masked_rows": int(fm.sum())}
    if after is not None and after.dim() == 4 and after.shape[:3] == fm.shape:
        out["fully_masked_nonfinite_rows"] = int((fm & ~after.isfinite().all(-1)).sum())
    fill = mask_fill(rec)
    if fill is not None:
        out["fill"] = fill
    return out
