"""lm-decoding's rotary test: are positions applied consistently, so that only the distance
between a query and a key reaches the attention (RoPE, ALiBi, relative biases)?

Two exact tests (eval, fp32 as the model runs):

* `periodic` (any decoder-only model with a trace): BOS, then a pattern of P tokens repeated.
  Where nothing positional is added at the embedding (its output at j equals that at j + P), the
  first attention's input repeats too, and with relative positions its scores must repeat along
  the diagonal: S[i, j] - S[i, k] = S[i+P, j+P] - S[i+P, k+P] (row differences, so that what is
  added per query row cancels), and its values must repeat (v_j = v_{j+P}). A score that depends
  on the query's own position (rotary on q alone), on a pairing of features that differs between
  q and k, or on positions that restart per chunk breaks the first; rotary applied to v breaks
  the second. Where the embedding output moves with the position (GPT-2's learned wpe, a
  sinusoidal table added at the input), positions are absolute by design: not applicable.
* `shift` (where the adapter can move the positions: Hugging Face `position_ids`): every
  position + c must leave the logits unchanged. It sees every layer, not only the first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tndebug.probes._mask_tests import Check, compare
from tndebug.subject import Subject

PLACE = "rotary"       # coverage place when no attention can be named

ROPE_FIX = ("Rotate q and k alike, with the same positions and the same pairing of features "
            "(rotate_half on both, or interleaved pairs on both: the pairing the weights were "
            "trained with), positions counted over the whole sequence; leave v unrotated.")
V_FIX = ("Apply the rotary embedding to q and k only: a rotated v makes each value depend on "
         "its key's absolute position, so the attention's output is no longer shift invariant.")


@dataclass
class Verdict:
    status: str                    # "checked" | "no verdict" | "not applicable"
    reason: str = ""
    where: str = ""
    code: str = ""                 # "" (no finding), "rotary-shift", "rotary-values"
    message: str = ""
    fix: str = ""
    evidence: dict = field(default_factory=dict)


def periodic_ids(s: Subject, period: int, repeats: int, seed: int) -> torch.Tensor:
    """BOS, then `period` distinct content tokens repeated `repeats` times.  # [2, 1 + P*R]"""
    g = torch.Generator().manual_seed(seed)
    n = s.tgt_vocab - s.first_content
    rows = [s.first_content + torch.randperm(n, generator=g)[:period] for _ in range(2)]
    ids = torch.stack([r.repeat(repeats) for r in rows])
    return torch.cat([torch.full((2, 1), s.bos_id), ids], 1).to(s.device)


def _diagonal(S: torch.Tensor, P: int, lo: int = 1):
    """Row differences S[i, j] - S[i, lo] for lo <= j <= i, and the same at (i+P, j+P):
    two tensors [B, h, n] that relative positions make equal."""
    T = S.shape[-1]
    a = [S[..., i, lo:i + 1] - S[..., i, lo:lo + 1] for i in range(lo, T - P)]
    b = [S[..., i + P, lo + P:i + P + 1] - S[..., i + P, lo + P:lo + P + 1] for i in range(lo, T - P)]
    return torch.cat(a, -1), torch.cat(b, -1)


def _reach(S: torch.Tensor, P: int, lo: int = 1):
    """S[i, j] and S[i, j+P] for one query and two copies of the same key: equal where no
    position reaches the scores.  # [B, h, n] each"""
    T = S.shape[-1]
    a = [S[..., i, lo:i + 1 - P] for i in range(lo + P, T)]
    b = [S[..., i, lo + P:i + 1] for i in range(lo + P, T)]
    return torch.cat(a, -1), torch.cat(b, -1)


def periodic(s: Subject, reads, period: int = 3, repeats: int = 4) -> Verdict:
    """The one-forward test on the first attention (see the module docstring)."""
    T = 1 + period * repeats
    if s.fit(T) < T:
        return Verdict("no verdict", f"the model takes fewer than {T} positions")
    ids = periodic_ids(s, period, repeats, seed=5)
    try:
        tr = s.trace(ids[:, :0], ids, reads=reads)
    except Exception as e:  # noqa: BLE001 - other tests name what the model raises on
        return Verdict("no verdict", f"the model raised {type(e).__name__} on a traced batch")
    embed = [p for p in tr.streams if p.kind == "embed" and p.x.dim() == 3 and p.x.shape[1] == T]
    recs = [r for r in tr.records("dec_self") if r.probs is not None and r.probs.dim() == 4
            and r.probs.shape[-2:] == (T, T)]
    if not embed or not recs:
        return Verdict("no verdict", "the trace shows no embedding output or no self-attention "
                       "probabilities [B, h, T, T] to test")
    x = embed[0].x.float()
    moved = compare(x[:, 1:T - period], x[:, 1 + period:])
    if moved.failed:
        return Verdict("not applicable", f"positions are added at the embedding ({embed[0].name}: "
                       f"the same token {period} positions later differs by {moved.delta:.3g}): "
                       f"absolute positions, not meant to be shift invariant",
                       evidence={"embedding_moves": vars(moved)})
    rec = min(recs, key=lambda r: r.layer if r.layer is not None else 1 << 30)
    if rec.scores is not None and rec.scores.shape == rec.probs.shape:
        S, from_ = rec.scores.float(), "scores"
    elif not rec.head_averaged:
        S, from_ = rec.probs.float().clamp_min(1e-30).log(), "log-probabilities"   # underflow floor
    else:
        return Verdict("no verdict", "the first attention exposes only head-averaged "
                       "probabilities, whose ratios are not the scores'", where=rec.site)
    rel = compare(*_diagonal(S, period))
    reach = compare(*_reach(S, period))
    ev = {"site": rec.site, "from": from_, "period": period, "relative": vars(rel),
          "position_reaches_scores": vars(reach)}
    if not (rel.finite and reach.finite):
        return Verdict("no verdict", "non-finite attention scores", where=rec.site, evidence=ev)
    if rel.failed:
        return Verdict("checked", where=rec.site, code="rotary-shift", evidence=ev, fix=ROPE_FIX,
                       message=f"the first attention's {from_} depend on absolute positions, not "
                       f"only on the distance between query and key: the same tokens {period} "
                       f"positions later change its row differences by {rel.delta:.3g} "
                       f"(tolerance {rel.tol:.2g}), though nothing positional is added at the "
                       f"embedding. Rotary applied to q but not k, with the features paired "
                       f"differently in q and k, or with positions that restart per chunk")
    if rec.v is not None and rec.v.dim() == 4 and rec.v.shape[-2] == T:
        v = rec.v.float()
        vm = compare(v[..., 1:T - period, :].transpose(1, 2), v[..., 1 + period:, :].transpose(1, 2))
        ev["values_move"] = vars(vm)
        if vm.failed:
            return Verdict("checked", where=rec.site, code="rotary-values", evidence=ev, fix=V_FIX,
                           message=f"the first attention's values depend on position: the same "
                           f"token {period} positions later gets a value differing by "
                           f"{vm.delta:.3g} (tolerance {vm.tol:.2g}) while its input and the "
                           f"scores are relative. Rotary applied to v")
    if not reach.failed:
        return Verdict("not applicable", "no position reaches the first attention (its scores "
                       "for two copies of a key are equal): nothing to shift", where=rec.site,
                       evidence=ev)
    return Verdict("checked", where=rec.site, evidence=ev)


def shift(s: Subject, shifted, offset: int = 5) -> Check | None:
    """max |change| of the logits when every position moves by `offset`, through the adapter's
    `shifted(model, ids, pad_id, offset)`; None when the model takes too few positions."""
    T = s.fit(12 + offset) - offset
    if T < 4:
        return None
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(s.first_content, s.tgt_vocab, (3, T), generator=g).to(s.device)
    ids[:, 0] = s.bos_id
    ref = s.logits(ids[:, :0], ids)
    return compare(ref, shifted(s.model, ids, s.pad_id, offset))
