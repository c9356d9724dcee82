"""Matching what reaches the score product to the projections that made it, and telling an added
mask from an added bias: the q/k provenance the scale fit rests on.
"""
from __future__ import annotations


from torch import nn
import torch

from tndebug.capture.structure import is_attention


MASK_NATS = 50.0   # an added term this far below its row's largest scales a key's weight by e^-50
                   # (2e-22): the key is removed, whatever fill was used (-1e4, -1e9, -inf,
                   # finfo.min); a position bias spans a few nats and stays in the scores


def masked_by_addition(added, shape) -> torch.Tensor | None:
    """Where an additive term removes keys.  # bool, broadcast to `shape` [B, h, T, S]"""
    if not isinstance(added, torch.Tensor) or not added.is_floating_point() or added.dim() < 1:
        return None
    d = added.float()
    top = d.amax(-1, keepdim=True)
    removed = ~d.isfinite() | (d < top - MASK_NATS)
    try:
        return removed.expand(shape) if removed.any() else None
    except RuntimeError:
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def _looks_like_probs(w) -> bool:
    """Attention weights returned by a module: non-negative rows that sum to 1."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 3 or not w.numel():
        return False
    w = w.detach().float()
    rows = w.sum(-1)
    return bool((w >= 0).all()) and bool(((rows - 1).abs() < 1e-3).all())


FOLD_TOL = {False: 1e-4, True: 1e-2}   # relative error of a sorted-value match; True: 16-bit


def _same_map(a, b) -> bool:
    """Two (weight, n chunks, chunk j) are one projection: the same slice of one weight."""
    (wa, na, ja), (wb, nb, jb) = a, b
    if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor):
        return False
    if wa is wb or (wa.shape == wb.shape and wa.data_ptr() == wb.data_ptr()):
        return (na, ja) == (nb, jb)
    return False


def _candidates(pool: list, hint: tuple[int, int, int] | None):
    """(position from the end, linear, n chunks, chunk j) in the search order: the most recent
    projection first, q alone / kv fused / qkv fused; `hint` (the last match) before all."""
    if hint is not None and hint[0] < len(pool):
        yield hint[0], pool[-1 - hint[0]], hint[1], hint[2]
    for back in range(len(pool)):
        for n in (1, 2, 3):
            for j in range(n):
                if hint is None or (back, n, j) != hint:
                    yield back, pool[-1 - back], n, j


def _head_split_projection(operand: torch.Tensor, pool: list, hint=None):
    """`_find_projection` for an operand that is s * chunk.view(B, T, h, d_k).transpose(1, 2)
    of one linear map's output chunk [B, T, h*d_k], in the same candidate order; else None."""
    if operand.dim() != 4 or not operand.numel():
        return None
    B, h, T, dk = operand.shape
    a = operand.detach().float()
    a_norm = a.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j in _candidates(pool, hint):
        width = out.shape[-1]
        if width % n or width // n != h * dk or tuple(out.shape[:-1]) != (B, T):
            continue
        w = width // n
        view = out[..., j * w:(j + 1) * w].float().reshape(B, T, h, dk).transpose(1, 2)
        c_norm = view.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign in (1.0, -1.0):
            if float((a - sign * s * view).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j), (back, n, j)
    return None


def _find_projection(operand: torch.Tensor, pool: list, hint=None):
    """(s, input, (weight, n, j), where) when `operand` holds exactly the values of s * a chunk
    of one linear map's output, in any arrangement (a head split is a permutation of the
    entries); else None. `where` is the candidate's place, for `hint` next time.

    Sorted values are compared, so any reshape/transpose/view of the projection matches and
    nothing else does: a RoPE rotation, a per-head norm or an interleaved split fails the test,
    and the module then gets no fold correction (the fit sees the operands).
    The usual head split ([B, T, h*d_k] -> [B, h, T, d_k]) is tried first, element by element
    (O(n); an element-wise match is a sorted-value match): sorting is 90% of a probed training
    step's cost under `tndebug.watch`. The hint (where the last recording matched: the same
code runs each step) is checked first; it is accepted only by the same test.
    """
    hit = _head_split_projection(operand, pool, hint)
    if hit is not None:
        return hit
    a = operand.detach().float().flatten()
    if not a.numel():
        return None
    a_sorted = a.sort().values
    a_norm = a_sorted.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j in _candidates(pool, hint):
        width = out.shape[-1]
        if width % n or out.numel() // n != a.numel():
            continue
        w = width // n
        chunk = out[..., j * w:(j + 1) * w].float().flatten().sort().values
        c_norm = chunk.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign, ref in ((1.0, chunk), (-1.0, chunk.flip(0))):
            if float((a_sorted - sign * s * ref).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j), (back, n, j)
    return None


def projection_weights(model: nn.Module) -> list:
    """(path, W_Q, W_K, W_V, heads) for attention modules whose projections are recognisable."""
    out = []
    for name, m in model.named_modules():
        if not is_attention(m):
            continue
        h = next((getattr(m, a) for a in ("num_heads", "h", "n_heads", "nhead", "n_head")
                  if isinstance(getattr(m, a, None), int)), None)
        if h is None:
            continue
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            wq, wk, wv = m.in_proj_weight.detach().chunk(3)
        elif isinstance(getattr(m, "linears", None), nn.ModuleList) and len(m.linears) >= 3:
            wq, wk, wv = (m.linears[i].weight.detach() for i in range(3))
        elif all(isinstance(getattr(m, a, None), nn.Linear) for a in ("w_q", "w_k", "w_v")):
            wq, wk, wv = m.w_q.weight.detach(), m.w_k.weight.detach(), m.w_v.weight.detach()
        elif isinstance(getattr(m, "qkv", None), nn.Linear):
            wq, wk, wv = m.qkv.weight.detach().chunk(3)
        else:
            continue
        out.append((name, wq, wk, wv, h))
    return out
