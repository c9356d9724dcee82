"""Helpers shared by the attention probes (nan-scores, missing-scale, mask-broadcast).

Everything here reads tensors of a `Trace` or calls a `Subject`; nothing reads a config.
"""
from __future__ import annotations

import torch

from tndebug.subject import Subject
from tndebug.trace import AttentionRecord, Trace

KIND_WORDS = {"enc_self": "encoder (self-attention)", "dec_self": "decoder (self-attention)",
              "cross": "decoder (cross-attention)"}


def masked_entries(rec: AttentionRecord) -> torch.Tensor | None:
    """Where the mask changed a score: masked_scores != scores, NaN-safe.  # [B, h, T, S]"""
    s, m = rec.scores, rec.masked_scores
    if s is None or m is None or s.shape != m.shape:
        return None
    return (m != s) & ~(m.isnan() & s.isnan())


def fully_masked_rows(rec: AttentionRecord) -> torch.Tensor | None:
    """Query rows whose every key is masked.  # [B, h, T]

    From the scores when both are captured; else from the probabilities: a row that is all
    zero (SDPA's safe softmax) or all NaN (eager softmax over -inf) had no key to attend to.
    """
    masked = masked_entries(rec)
    if masked is not None:
        return masked.all(-1)
    p = rec.probs
    if p is None or rec.head_averaged:
        return None
    return (p == 0).all(-1) | p.isnan().all(-1)


def as_heads(p: torch.Tensor) -> torch.Tensor:
    """Head-averaged probabilities [B, T, S] get a head axis of 1.  # [B, h, T, S]"""
    return p.unsqueeze(1) if p.dim() == 3 else p


def saturation(probs: torch.Tensor, keep: torch.Tensor | None = None):
    """(mean max-probability, mean normalised entropy H/ln n) over rows with n >= 2 keys.

    Device scalars; `keep` [.., T, S] marks the keys each row may attend to (default: p > 0).
    """
    p = as_heads(probs).float()
    keep = (p > 0) if keep is None else as_heads(keep).expand_as(p)
    n = keep.sum(-1)                                                       # [B, h, T]
    rows = (n >= 2) & p.isfinite().all(-1)
    plogp = torch.where(keep & (p > 0), p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
    h_norm = -plogp.sum(-1) / n.clamp_min(2).float().log()                 # [B, h, T]
    count = rows.sum().clamp_min(1)
    max_p = torch.where(rows, p.amax(-1), torch.zeros_like(h_norm)).sum() / count
    entropy = torch.where(rows, h_norm, torch.zeros_like(h_norm)).sum() / count
    return max_p, entropy


def probe_batch(subject: Subject, batch: int = 8, src_len: int = 12, tgt_len: int = 11,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random BOS-led batch in which the even rows are right-padded and the odd rows are not.

    Every padded row keeps at least 3 real tokens.  Returns (src [B, S], tgt [B, T]).
    """
    g = torch.Generator().manual_seed(seed)
    lo = subject.first_content
    src = torch.randint(lo, subject.src_vocab, (batch, src_len), generator=g)
    tgt = torch.randint(lo, subject.tgt_vocab, (batch, tgt_len), generator=g)
    tgt[:, 0] = subject.bos_id
    for b in range(0, batch, 2):
        s = int(torch.randint(3, src_len, (), generator=g))
        t = int(torch.randint(3, tgt_len, (), generator=g))
        src[b, s:] = subject.pad_id
        tgt[b, t:] = subject.pad_id
    return src.to(subject.device), tgt.to(subject.device)


def roles(trace: Trace) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (module path, role) for every tensor the Trace names.

    Roles: an AttentionRecord field ("q", "scores", "probs", ...), "stream", "embed.<part>",
    "ffn.hidden" or "logits".
    """
    out: dict[int, tuple[str, str]] = {}
    for rec in trace.attention.values():
        for f in ("q", "k", "v", "scores", "masked_scores", "probs", "z", "out"):
            x = getattr(rec, f)
            if x is not None:
                out[id(x)] = (rec.site, f)
    for p in trace.streams:
        out.setdefault(id(p.x), (p.name, "stream"))
    for owner, parts in trace.embed.items():
        for part, x in parts.items():
            out.setdefault(id(x), (owner, f"embed.{part}"))
    for owner, x in trace.ffn_hidden.items():
        out[id(x)] = (owner, "ffn.hidden")
    if trace.logits is not None:
        out.setdefault(id(trace.logits), ("logits", "logits"))
    return out
