"""Helpers shared by the attention probes (nan-scores, missing-scale, mask-broadcast).

Everything here reads tensors of a `Trace` or calls a `Subject`; nothing reads a config.
"""
from __future__ import annotations

import math

import torch

from tndebug.subject import Subject
from tndebug.capture.trace import AttentionRecord, Trace


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


def saturation_sums(probs: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[sum of max-probabilities, sum of normalised entropies H/ln n, rows] over finite rows
    with n >= 2 keys, as one device tensor (divide on the host; sums add across processes).

    `keep` [.., T, S] marks the keys each row may attend to (default: p > 0).
    """
    p = as_heads(probs).float()
    keep = (p > 0) if keep is None else as_heads(keep).expand_as(p)
    n = keep.sum(-1)                                                       # [B, h, T]
    rows = (n >= 2) & p.isfinite().all(-1)
    plogp = torch.where(keep & (p > 0), p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
    h_norm = -plogp.sum(-1) / n.clamp_min(2).float().log()                 # [B, h, T]
    zero = torch.zeros_like(h_norm)
    return torch.stack([torch.where(rows, p.amax(-1), zero).sum(),
                        torch.where(rows, h_norm, zero).sum(), rows.sum().float()])


def probe_batch(subject: Subject, batch: int = 8, src_len: int = 12, tgt_len: int = 11,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random BOS-led batch in which the even rows are right-padded and the odd rows are not.

    Every padded row keeps at least 3 real tokens.  Returns (src [B, S], tgt [B, T]).
    """
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = subject.fit(src_len), subject.fit(tgt_len)   # what the model takes
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


def _affine_residual(x: torch.Tensor, y: torch.Tensor, raw_only: bool = False) -> float | None:
    """min over input normalisations (raw, LayerNorm, RMSNorm; raw only with `raw_only`) of the
    affine-fit residual of y on x, over finite rows; None when rows do not outnumber features
    3 to 1."""
    x, y = x.detach().double().cpu(), y.detach().double().cpu()
    ok = x.isfinite().all(1) & y.isfinite().all(1)
    x, y = x[ok], y[ok]
    if len(x) < 3 * (x.shape[1] + 1):
        return None
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    spread = (y - y.mean(0)).norm().clamp_min(1e-300)
    best = math.inf
    forms = (x,) if raw_only else (x, (x - mu) / (var + 1e-5).sqrt(),
                                   x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    for f in forms:
        X = torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1)
        sol = torch.linalg.lstsq(X, y, rcond=1e-9, driver="gelsd").solution
        best = min(best, float((y - X @ sol).norm() / spread))
    return best


def head_split_fits(trace: Trace, sides: dict | None = None) -> dict[str, float]:
    """site -> residual of q (and of a cross-attention's k on the encoder output) as an affine
    function of the module's input row: exact (~1e-7) when heads are split per position.

    The input is the last stream point before the module in execution order; rows must
    outnumber features 3 to 1, else the module is not fitted. `sides`, when given, gets
    site -> {"split" | "merge": residual}: which side of the heads broke the fit."""
    streams = {id(p.x): p for p in trace.streams}
    role_of = roles(trace)
    last = last_enc = None
    out: dict[str, float] = {}
    for _, x in trace.order:
        p = streams.get(id(x))
        if p is not None:
            last = p
            last_enc = p if p.stack == "encoder" else last_enc
            continue
        site, role = role_of.get(id(x), ("", ""))
        rec = trace.attention.get(site)
        if rec is None or x.dim() != 4 or role not in ("q", "k"):
            continue
        src = last if role == "q" else (last_enc if rec.kind == "cross" else None)
        if src is None or src.x.shape[:2] != (x.shape[0], x.shape[2]):
            continue
        B, h, T, dk = x.shape
        r = _affine_residual(src.x.reshape(B * T, -1), x.transpose(1, 2).reshape(B * T, h * dk))
        if r is not None:
            out[site] = max(out.get(site, 0.0), r)
            side = sides.setdefault(site, {}) if sides is not None else {}
            side["split"] = max(side.get("split", 0.0), r)
    _fits_by_site(trace, out, sides if sides is not None else {})
    return out


def _fits_by_site(trace: Trace, out: dict[str, float], sides: dict) -> None:
    """The same fits where q is not a module output in execution order (a generic capture
    records q at the score product): v of a self-attention on the last stream point before the
    module's first call (the split side); and the merge side: the module's output on its heads'
    outputs z concatenated per position (exact, out = W_O concat_h z + b, when the heads are
    merged per position; a reshape without the transpose back reads other positions). The
    worse residual counts."""
    names = [n for n, _ in trace.order]
    at = {id(x): i for i, (_, x) in enumerate(trace.order)}
    by_name: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        by_name.setdefault(n, []).append(i)

    seen: dict[str, int] = {}
    placed = []                   # (place in execution order, stream index)
    for i, p in enumerate(trace.streams):
        # its tensor's place, else its module's output: the nth call for the nth point of a name
        k = seen[p.name] = seen.get(p.name, -1) + 1
        calls = by_name.get(p.name, [])
        w = at.get(id(p.x), calls[k] if k < len(calls) else None)
        if w is not None:
            placed.append((w, i))
    stream_at = [(w, trace.streams[i]) for w, i in sorted(placed)]
    for site, rec in trace.attention.items():
        first = next((i for i, n in enumerate(names) if n == site or n.startswith(site + ".")), None)
        if first is None:
            continue
        before = [p for i, p in stream_at if i < first]
        src = before[-1] if before else None
        # v only: q and k may be recorded after a rotation (RoPE), which no per-position affine
        # map gives, and a cross-attention's memory is not always a stream point; v is W_V x at
        # each position in every code that splits its heads per position
        for role in ("v",) if rec.kind != "cross" else ():
            x, where = getattr(rec, role), src
            if x is None or x.dim() != 4 or where is None:
                continue
            B, h, T, dk = x.shape
            if where.x.shape[:2] == (B, T):
                r = _affine_residual(where.x.reshape(B * T, -1), x.transpose(1, 2).reshape(B * T, h * dk))
                if r is not None:
                    out[site] = max(out.get(site, 0.0), r)
                    side = sides.setdefault(site, {})
                    side["split"] = max(side.get("split", 0.0), r)
        z, o = rec.z, rec.out
        if z is not None and o is not None and z.dim() == 4 and o.dim() == 3:
            B, h, T, dk = z.shape
            if o.shape[:2] == (B, T):
                r = _affine_residual(z.transpose(1, 2).reshape(B * T, h * dk), o.reshape(B * T, -1),
                                     raw_only=True)
                if r is not None:
                    out[site] = max(out.get(site, 0.0), r)
                    sides.setdefault(site, {})["merge"] = r
