"""positional-encoding's second looks at an "order ignored" result, before it is an error:
the permutation difference again in float64 (rounding, or a weak but real order signal?), and
whether every encoder self-attention ignores its keys (then the mask, not the positions, is
what the test saw)."""
from __future__ import annotations

import torch

from tndebug.probes._float64 import in_float64
from tndebug.probes._misc_stats import rel_diff
from tndebug.subject import Subject


def rel_in_float64(subject, src, src_p, gather, keep, tgt, what: str) -> float | None:
    """The permutation difference again with the model in float64; None when it cannot run
    there (code that builds float32 tensors of its own, say). Only on the would-be error path."""
    try:
        with in_float64(subject.model), subject.evaluating():
            if what == "encoder output":
                enc = subject.encode(src)
                out = subject.encode(src_p)[keep]
                ref = enc.gather(1, gather[..., None].expand_as(enc))[keep]
            else:
                out, ref = subject.logits(src_p, tgt), subject.logits(src, tgt)
    except Exception:  # noqa: BLE001 - the fp32 verdict stands
        return None
    return rel_diff(out, ref) if out.dtype == torch.float64 else None


def attention_blind(subject: Subject, src: torch.Tensor, tgt: torch.Tensor) -> str:
    """Why order cannot be judged, when every encoder self-attention ignores its keys: real
    queries put no mass on real keys, or spread it uniformly over all of them. Position
    information that comes only through attention (a relative bias, as in T5) is then lost
    to the mask, not missing: mask-broadcast names that. "" when attention reads the keys."""
    if subject.capture is None:
        return ""
    try:
        with subject.evaluating():
            trace = subject.trace(src, tgt, reads=("attn.probs",))
    except Exception:  # noqa: BLE001 - the test above ran; this is only a confound check
        return ""
    keep = src != subject.pad_id                                          # [B, S]
    recs = [r for r in trace.records() if r.kind == "enc_self" and r.probs is not None
            and r.probs.shape[0] == keep.shape[0] and r.probs.shape[-1] == keep.shape[1]]
    if not recs:
        return ""
    for rec in recs:
        p = rec.probs.float()
        p = p.unsqueeze(1) if p.dim() == 3 else p                          # [B, h, T, S]
        rows = keep[:, None, :].expand(p.shape[:3])                        # real queries
        on_real = (p * keep[:, None, None, :]).sum(-1)                     # [B, h, T]
        uniform = (p.amax(-1) - p.amin(-1)) < 1e-6
        blind = ((on_real < 1e-3) | uniform)[rows]
        if not blind.numel() or float(blind.float().mean()) < 0.99:
            return ""
    return ("every encoder self-attention ignores its keys (real queries attend only to pads, "
            "or uniformly): the order test is confounded by the mask (see mask-broadcast)")


def tokens_unmixed(subject: Subject, src: torch.Tensor, keep: torch.Tensor, tol: float,
                   generator: torch.Generator) -> str:
    """Why order cannot be judged, when the encoder mixes no tokens: each real position's
    output depends on its own token alone (resampling every other real token moves it by less
    than `tol`, relative). Positions that reach the output only through attention (rotary, a
    relative bias) are then lost with the mixing, not missing: the mask or attention that reads
    nothing is the cause, and mask-broadcast names a mask. A behavioural twin of
    `attention_blind` for attention whose probabilities are not captured (a fused kernel whose
    fully masked rows the code zeroes after it). "" when the tokens mix, or the test cannot run."""
    col = torch.arange(src.shape[1], device=src.device)[None, :].expand_as(src)
    held = keep & (col % 2 == 0)                 # [B, S] real positions kept as they are
    moved = keep & ~held                         # the other real positions, resampled
    if not bool(held.any()) or not bool(moved.any()):
        return ""
    other = src.clone()
    other[moved] = torch.randint(subject.first_content, subject.src_vocab, (int(moved.sum()),),
                                 generator=generator).to(src.device)
    try:
        with subject.evaluating():
            a, b = subject.encode(src), subject.encode(other)
    except Exception:  # noqa: BLE001 - the permutation test ran; this is only a confound check
        return ""
    if a is None or b is None or a.shape != b.shape:
        return ""
    change = rel_diff(b[held], a[held])
    if not change < tol:
        return ""
    return (f"the encoder mixes no tokens: resampling the other real tokens moves a position's "
            f"output by {change:.1e} (< {tol:g}), so nothing reaches it from its neighbours and "
            f"token order cannot either (a mask that hides every real key: see mask-broadcast)")
