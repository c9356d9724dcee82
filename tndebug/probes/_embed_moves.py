"""Does the embedding output (token part + PE, before any attention) at real positions change
with the padded length or with the batch companions? (issue 19)

Exact, like mask-broadcast's behaviour tests: a right-padded batch against the same batch with
EXTRA_PADS pad columns appended on both sides, and one unpadded example alone against it in its
batch, compared at the real positions only. A positional encoding indexed by the padded shape
(`x + pe[:, x.size(1)]`, one PE per sequence indexed by the batch) moves here; a healthy
embedding (positions 0..T-1 for every row) does not, to the bit. positional-encoding names it;
mask-broadcast, whose behaviour tests then fail with every mask holding, defers to it.
"""
from __future__ import annotations

import torch

from tndebug.probes._attn_stats import probe_batch
from tndebug.probes._mask_tests import EXTRA_PADS as EXTRA, REL_TOL as REL   # the same exact test
from tndebug.probes._tolerance import tol
from tndebug.subject import Subject


class NotAnEmbedding(Exception):
    """The only tensor found where the embedding output should be mixes tokens: it comes after
    an attention, so the test has no tensor to read (no verdict, never another tensor's)."""


def _outs(trace) -> tuple[dict[str, torch.Tensor], bool]:
    """({site: embedding output [B, L, d]}, whether it came from the stream's entry point): the
    capture's embed taps, else its embed stream points (to be shown token-local first)."""
    out = {site: parts["out"] for site, parts in trace.embed.items() if parts.get("out") is not None}
    from_stream = not out
    if from_stream:
        out = {p.name: p.x for p in trace.streams if p.kind == "embed"}
    return {k: v for k, v in out.items() if v.dim() == 3}, from_stream


def _token_local(s: Subject, src, tgt, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sites of `ref` whose rows at positions 1.. do not move when the token at position 0
    changes: an embedding output is a function of each position's own token; a tensor after
    an attention is not (issue 45: the fallback read one and blamed the PE for a leak)."""
    def other(x):
        y = x.clone()
        if y.shape[1]:
            y[:, 0] = torch.where(y[:, 0] == s.first_content, s.first_content + 1, s.first_content)
        return y
    with s.evaluating():
        moved, _ = _outs(s.trace(other(src), other(tgt), reads=("embed", "stream")))
    kept = {}
    for site, a in ref.items():
        b = moved.get(site)
        if b is None or b.shape != a.shape or a.shape[1] < 2:
            continue
        if float((b[:, 1:] - a[:, 1:]).abs().max()) <= tol(REL, a, b) * (1 + float(a.abs().max())):
            kept[site] = a
    return kept


def _delta(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor) -> tuple[float, float] | None:
    """(max|b - a|, its tolerance) over `keep` [B, L]; None when not finite or nothing compared."""
    a, b = a[keep].float(), b[keep].float()
    if not a.numel() or not (a.isfinite().all() and b.isfinite().all()):
        return None
    return float((b - a).abs().max()), tol(REL, a, b) * (1 + float(a.abs().max()))


def embedding_moves(s: Subject) -> dict[str, dict]:
    """{"src_pad_length" | "tgt_pad_length" | "batch": {"site", "delta", "tol"}} for each
    comparison in which an embedding output moved at real positions (the worst site; a site's
    side is read off its length); {} when none did, or when the embeddings are not captured.
    Raises what the model raises."""
    if s.capture is None:
        return {}
    S, T = s.fit(10 + EXTRA) - EXTRA, s.fit(9 + EXTRA) - EXTRA
    src, tgt = probe_batch(s, 6, S, T, seed=11)
    if S == T and S > 3:                              # the side of a site is read off its length
        tgt = tgt[:, :-1]
    S, T = src.shape[1], tgt.shape[1]
    sides = {S: ("src", src != s.pad_id), T: ("tgt", tgt != s.pad_id)}
    pads = lambda x: torch.cat([x, torch.full((x.shape[0], EXTRA), s.pad_id, dtype=x.dtype,  # noqa: E731
                                                   device=x.device)], 1)
    one = 1                                            # probe_batch leaves the odd rows unpadded
    with s.evaluating():
        ref, from_stream = _outs(s.trace(src, tgt, reads=("embed", "stream")))
        longer, _ = _outs(s.trace(pads(src), pads(tgt), reads=("embed", "stream")))
        alone, _ = _outs(s.trace(src[one:one + 1], tgt[one:one + 1], reads=("embed", "stream")))
    if from_stream and ref:
        local = _token_local(s, src, tgt, ref)
        if not local:
            raise NotAnEmbedding("no embedding output was captured, and the stream's entry "
                                 "point mixes tokens (it moves when another token changes): it "
                                 "comes after an attention, so the padded-shape test has no "
                                 "tensor to read")
        ref = local
    found: dict[str, dict] = {}
    for test, other, rows in (("pad_length", longer, slice(None)), ("batch", alone, slice(one, one + 1))):
        for site, a in ref.items():
            b = other.get(site)
            if b is None or a.shape[1] not in sides or b.shape[1] < a.shape[1] \
                    or b.shape[0] != a[rows].shape[0]:
                continue
            side, keep = sides[a.shape[1]]
            d = _delta(a[rows], b[:, :a.shape[1]], keep[rows])
            key = f"{side}_{test}" if test == "pad_length" else test
            if d and d[0] > d[1] and (key not in found or d[0] / d[1] > found[key]["delta"] / found[key]["tol"]):
                found[key] = {"site": site, "delta": d[0], "tol": d[1]}
    return found
