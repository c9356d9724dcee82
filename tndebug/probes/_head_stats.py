"""Statistics and weight helpers of `head-collapse`: per-head entropy and similarity (JS),
flat scores, and the per-head slices of Q/K/V projections, in a user's module or ours."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from tndebug.capture.trace import AttentionRecord, Trace
from tndebug.sharded import full, local

# FLAT: rounding-level variation, a no-verdict gate; set on no run (21e95ee).
FLAT = 1e-3           # scores varying less than this over the keys (relative): tokens all alike
JS_MAX_SEQ, JS_MAX_ROWS = 8, 64
LN2 = math.log(2.0)


# -- statistics (device tensors) -------------------------------------------------------------
def query_keep(trace: Trace, rec: AttentionRecord, B: int, T: int, device) -> torch.Tensor:
    """Non-pad query rows [B, T]: source tokens for encoder self-attention, target otherwise."""
    ids = trace.src if rec.kind == "enc_self" else trace.tgt
    if ids is not None and tuple(ids.shape) == (B, T):
        return (ids != trace.pad_id).to(device)
    return torch.ones(B, T, dtype=torch.bool, device=device)


def head_stats(P: torch.Tensor, keys: torch.Tensor | None, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (entropy/ln n, max prob, similarity = 1 − mean JS to the others) and JS [h, h].

    P [B, h, T, S] probabilities; keys [B, h|1, T, S] allowed keys (None: P > 0);
    rows [B, T] valid queries. Returns stats [h, 3] and js [h, h] in bits.
    """
    P = P.float()
    keys = (P > 0) if keys is None else keys.expand_as(P)
    n = keys.sum(-1)                                                    # [B, h, T]
    H = -(P * P.clamp_min(1e-30).log()).sum(-1)                         # [B, h, T]
    valid = rows[:, None, :] & (n >= 2)                                 # [B, h, T]
    w = valid.float()
    cnt = w.sum((0, 2)).clamp(min=1)                                    # [h]
    ent = (H / n.clamp(min=2).float().log() * w).sum((0, 2)) / cnt      # [h]
    maxp = (P.amax(-1) * w).sum((0, 2)) / cnt                           # [h]
    js = pairwise_js(P[:JS_MAX_SEQ, :, :JS_MAX_ROWS], valid[:JS_MAX_SEQ, 0, :JS_MAX_ROWS])
    h = P.shape[1]
    off = ~torch.eye(h, dtype=torch.bool, device=P.device)
    sim = 1.0 - (js * off).sum(-1) / max(h - 1, 1)                      # [h]
    return torch.stack([ent, maxp, sim], dim=-1), js


def uniform_js(P: torch.Tensor, keys: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Per head, the mean JS divergence in bits of its rows from the uniform distribution over
    the keys each row may attend to.  P [B, h, T, S], keys [B, h|1, T, S] | None, rows [B, T] -> [h]"""
    P = P.float()
    keys = (P > 0) if keys is None else keys.expand_as(P)
    n = keys.sum(-1, keepdim=True)                                      # [B, h, T, 1]
    U = keys.float() / n.clamp(min=1).float()                           # [B, h, T, S]
    m = (P + U) / 2
    logm = m.clamp_min(1e-30).log()
    kl_p = (P * (P.clamp_min(1e-30).log() - logm)).sum(-1)              # [B, h, T]
    kl_u = (U * (U.clamp_min(1e-30).log() - logm)).sum(-1)
    js = ((kl_p + kl_u) / (2 * LN2)).clamp(min=0)                       # [B, h, T]
    w = (rows[:, None, :] & (n[..., 0] >= 2) & P.isfinite().all(-1)).float()
    return (js * w).sum((0, 2)) / w.sum((0, 2)).clamp(min=1)           # [h]


def pairwise_js(P: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean Jensen-Shannon divergence in bits between heads' rows.  P [B, h, T, S] -> [h, h]"""
    h = P.shape[1]
    w = valid.float()                                                   # [B, T]
    logP = P.clamp_min(1e-30).log()
    out = torch.zeros(h, h, device=P.device)
    for a in range(h):
        m = (P[:, a:a + 1] + P) / 2                                     # [B, h, T, S]
        logm = m.clamp_min(1e-30).log()
        kl_a = (P[:, a:a + 1] * (logP[:, a:a + 1] - logm)).sum(-1)      # [B, h, T]
        kl_b = (P * (logP - logm)).sum(-1)
        js = (kl_a + kl_b) / (2 * LN2)
        out[a] = (js * w[:, None]).sum((0, 2)) / w.sum().clamp(min=1)
    return out


# -- weights and records ---------------------------------------------------------------------------------
def flat_scores(rec: AttentionRecord) -> bool:
    """Scores that do not vary over the keys: every token alike (e.g. a rank-collapsed stream,
    see variance-drift), so symmetric scores and identical maps say nothing about the heads."""
    S = rec.scores if rec.scores is not None else rec.probs
    if S is None:
        return False
    keys = rec.key_keep()
    S = S.float()
    if keys is not None:
        S = torch.where(keys.expand_as(S), S, S.new_zeros(()))
        n = keys.expand_as(S).sum(-1, keepdim=True).clamp(min=1)
        mean = S.sum(-1, keepdim=True) / n
        dev = torch.where(keys.expand_as(S), S - mean, S.new_zeros(()))
    else:
        dev = S - S.mean(-1, keepdim=True)
    return bool(dev.norm() <= FLAT * S.norm().clamp(min=1e-30))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return bool((a - b).norm() <= 1e-4 * b.norm().clamp(min=1e-30) + 1e-6)


@dataclass(frozen=True)
class Proj:
    """The Linear that produced one of q, k, v: its module path and, for a fused output (qkv,
    kv), which of its `parts` equal slices (`part`); `weight` is that slice's rows."""
    name: str
    part: int = 0
    parts: int = 1
    weight: torch.Tensor | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.part

    def label(self) -> str:
        return self.name if self.parts == 1 else f"{self.name} (part {self.part + 1} of {self.parts} of its output)"


def match_projections(site: str, rec: AttentionRecord, calls, modules: dict[str, nn.Module]) -> dict[str, Proj]:
    """role ("q", "k", "v") -> the Linear call whose output, split into heads, equals it.

    Searched in the whole model, nearest to `site` first: the projections may sit beside the
    module that holds the softmax (a wrapper's w_qs feeding its `.attention`). Outputs may be
    batch-first [B, T, m·h·d_k] or sequence-first [T, B, ...], fused (m = 2, 3 equal parts)."""
    ranked = sorted(calls, key=lambda c: -len(os.path.commonprefix([c[0], site])))
    roles: dict[str, Proj] = {}
    gathered: dict[int, torch.Tensor] = {}
    for role in ("q", "k", "v"):
        t = getattr(rec, role)
        if t is None or t.dim() != 4:
            continue
        B, h, T, dk = t.shape
        w = h * dk
        for name, y in ranked:
            if y.dim() != 3 or y.shape[-1] % w or not 1 <= y.shape[-1] // w <= 3:
                continue
            parts = y.shape[-1] // w
            for p in range(parts):
                z = y[..., p * w:(p + 1) * w]
                hit = ((tuple(z.shape[:2]) == (B, T)
                        and (close(z.reshape(B, T, h, dk).transpose(1, 2), t)
                             or (parts == 1 and close(z.reshape(B, h, T, dk), t))))
                       or (tuple(z.shape[:2]) == (T, B)
                           and close(z.reshape(T, B, h, dk).permute(1, 2, 0, 3), t)))
                if hit:
                    W = getattr(modules.get(name), "weight", None)
                    if isinstance(W, torch.Tensor) and W.dim() == 2 and W.shape[0] == parts * w:
                        # FSDP2: gathered once per weight (a collective at setup), so a weight
                        # used twice still gives one tensor (same_weight)
                        if id(W) not in gathered:
                            gathered[id(W)] = full(W)
                        W = gathered[id(W)][p * w:(p + 1) * w]
                    else:
                        W = None
                    roles[role] = Proj(name, p, parts, W)
                    break
            if role in roles:
                break
    return roles


def same_weight(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same parameter memory (a tied weight, or one Linear reused), not merely equal
    (FSDP2: the same memory of this rank's shards)."""
    if a is None or b is None or a.shape != b.shape:
        return False
    a, b = local(a), local(b)
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def weight_of(module: nn.Module | None, path: str, site: str) -> torch.Tensor | None:
    if module is None:
        return None
    try:
        sub = module.get_submodule(path[len(site) + 1:])
    except AttributeError:
        return None
    return getattr(sub, "weight", None)


def packed_slices(module: nn.Module | None):
    """(W_q, W_k, W_v) from a packed in_proj weight [3E, E] (nn.MultiheadAttention), else None."""
    W = getattr(module, "in_proj_weight", None) if module is not None else None
    if isinstance(W, torch.Tensor) and W.dim() == 2 and W.shape[0] % 3 == 0:
        return full(W.detach()).chunk(3, dim=0)              # FSDP2: gathered (a collective)
    return None


def n_heads(rec: AttentionRecord, module: nn.Module | None) -> int | None:
    for t in (rec.q, rec.scores, rec.probs):
        if t is not None and t.dim() == 4 and not (t is rec.probs and rec.head_averaged):
            return t.shape[1]
    h = getattr(module, "num_heads", None)     # nn.MultiheadAttention
    return h if isinstance(h, int) else None


def fmt_heads(pairs) -> str:
    heads = sorted({i for p in pairs for i in p})
    return ",".join(map(str, heads))


def token_constant(t: torch.Tensor | None, same: float) -> bool:
    """t [..., T, d_k] the same at every position to `same` of its scale (0 included): a tensor
    made from an input with no token in it."""
    if t is None or t.dim() < 2 or t.shape[-2] < 2:
        return False
    t = t.detach().float()
    spread = (t.amax(-2) - t.amin(-2)).abs().max()
    return bool(spread <= same * t.abs().max())


def score_symmetry(rec: AttentionRecord, trace: Trace) -> dict | None:
    """How symmetric the scores S [B, h, T, T] are over the real tokens (head-collapse's shared
    Q/K test): {"asymmetry": ‖Sc − Scᵀ‖/‖Sc‖ of the double-centred scores, "self_argmax": the
    share of queries attending most to themselves, "self_masked"}; None when S is not square or
    does not depend on the pair."""
    S = rec.scores
    if S is None or S.dim() != 4 or S.shape[-1] != S.shape[-2]:
        return None
    B, h, T, _ = S.shape
    rows = query_keep(trace, rec, B, T, S.device)                        # [B, T]
    pair = (rows[:, :, None] & rows[:, None, :])[:, None].expand_as(S)    # [B, h, T, T]
    # double-centred over the real tokens: row and column offsets (which the softmax
    # ignores, and which dominate when the tokens are nearly alike) drop out, while
    # S = Sᵀ stays symmetric
    w = pair.float()
    n = rows.sum(-1).clamp(min=1).float()[:, None, None, None]            # [B, 1, 1, 1]
    S0 = S.float() * w
    Sc = (S0 - S0.sum(-1, keepdim=True) / n - S0.sum(-2, keepdim=True) / n
          + S0.sum((-1, -2), keepdim=True) / n ** 2) * w
    if float(Sc.norm()) <= FLAT * float(S0.norm()):
        return None                          # scores do not depend on the pair: nothing to test
    asym = float((Sc - Sc.transpose(-1, -2)).norm() / Sc.norm().clamp(min=1e-30))
    keys = rec.key_keep()
    allowed = pair if keys is None else pair & keys.expand_as(S)
    diag = torch.eye(T, dtype=torch.bool, device=S.device)
    self_masked = bool((~allowed[..., diag] | ~rows[:, None, :]).all()) and bool(rows.any())
    top = S.float().masked_fill(~allowed, float("-inf")).argmax(-1)        # [B, h, T]
    ok = rows[:, None, :].expand(B, h, T) & allowed.any(-1)
    hits = (top == torch.arange(T, device=S.device)) & ok
    frac = float(hits.sum() / ok.sum().clamp(min=1))
    return {"asymmetry": round(asym, 5), "self_argmax": round(frac, 4), "self_masked": self_masked}
