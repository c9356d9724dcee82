"""Matching what reaches the score product to the projections that made it, and telling an added
mask from an added bias: the q/k provenance the scale fit rests on.
"""
from __future__ import annotations


from torch import nn
import torch

from tndebug.capture.structure import is_attention


# Set with foreign's mask_fills and relbias styles (0915f8f); held out: realbugs (additive -1e4, float tril).
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


# FOLD_TOL: float rounding; NORM_EVIDENCE: set with x-transformers rotary and HF RoPE (d4698d1), not held out.
FOLD_TOL = {False: 1e-4, True: 1e-2}   # relative error of a sorted-value match; True: 16-bit
NORM_EVIDENCE = 10.0   # a norm match must fit 10x better than one constant norm for every vector
                       # does: otherwise the norms hardly vary and any tensor of the size passes


def _same_map(a, b) -> bool:
    """Two (weight, n chunks, chunk j, layout) are one projection: the same slice of one weight."""
    (wa, *ia), (wb, *ib) = a, b
    if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor):
        return False
    if wa is wb or (wa.shape == wb.shape and wa.data_ptr() == wb.data_ptr()):
        return ia == ib
    return False


def _candidates(pool: list, hint: tuple | None):
    """(position from the end, linear, n chunks, chunk j, layout) in the search order: the most
    recent projection first, q alone / kv fused / qkv fused, each fused output read as blocks
    ([q | k | v]) or per head ([q_h k_h v_h] for each head h: GPT-NeoX, BLOOM); `hint` (where
    the last match was) before all."""
    if hint is not None and hint[0] < len(pool):
        yield hint[0], pool[-1 - hint[0]], hint[1], hint[2], hint[3]
    for back in range(len(pool)):
        for n in (1, 2, 3):
            for layout in (("blocks",) if n == 1 else ("blocks", "heads")):
                for j in range(n):
                    if hint is None or (back, n, j, layout) != tuple(hint[:4]):
                        yield back, pool[-1 - back], n, j, layout


def _rows(out: torch.Tensor, B: int, T: int) -> torch.Tensor | None:
    """A linear map's output as [B, T, width]: as the map returned it, or from [B*T, width]
    (`torch.addmm` on the flattened input, as Hugging Face's Conv1D computes it)."""
    if out.dim() >= 2 and tuple(out.shape[:-1]) == (B, T):
        return out
    if out.dim() == 2 and out.shape[0] == B * T:
        return out.reshape(B, T, out.shape[-1])
    return None


def _split_heads(out: torch.Tensor, n: int, j: int, layout: str, h: int, dk: int):
    """Chunk j of n chunks of `out` [B, T, width] split into heads and repeated to h heads (a
    grouped-query k/v: each of g heads serves h/g query heads, as `repeat_kv` lays them out);
    None when the widths do not fit.  # [B, h, T, dk]"""
    width = out.shape[-1]
    if width % (n * dk):
        return None
    g = width // (n * dk)                                   # heads in the chunk
    if not g or h % g:
        return None
    B, T = out.shape[:2]
    if layout == "blocks":
        w = width // n
        view = out[..., j * w:(j + 1) * w].reshape(B, T, g, dk)
    else:
        view = out.reshape(B, T, g, n * dk)[..., j * dk:(j + 1) * dk]
    view = view.transpose(1, 2)                                                # [B, g, T, dk]
    return view.repeat_interleave(h // g, dim=1) if g != h else view


def _head_split_projection(operand: torch.Tensor, cands: list):
    """`_find_projection` for an operand that is s * chunk.view(B, T, h, d_k).transpose(1, 2)
    of one linear map's output chunk (its heads repeated for grouped-query attention), in
    the order of `cands`; else None."""
    if operand.dim() != 4 or not operand.numel():
        return None
    B, h, T, dk = operand.shape
    a = operand.detach().float()
    a_norm = a.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j, layout in cands:
        rows = _rows(out, B, T)
        view = None if rows is None else _split_heads(rows, n, j, layout, h, dk)
        if view is None:
            continue
        view = view.float()
        c_norm = view.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign in (1.0, -1.0):
            if float((a - sign * s * view).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j, layout), (back, n, j, layout, "values")
    return None


def _norm_projection(operand: torch.Tensor, cands: list):
    """`_find_projection` for an operand that is s * U(b, h, t) applied to each head vector of
    one linear map's output chunk, U norm-preserving (a rotation: RoPE, partial or full; a
    permutation of the head's dimensions): each vector's norm is s times its projection's.

    s is what the fit needs: U does not change q.k's size, so the scale between the
    projections and the softmax is s_q * s_k times the one between the operands and the
    softmax. A sign of s (a reflection is norm-preserving too) cannot be told from norms.
    A per-head norm (QK-norm), a position-dependent factor (log-n scaling) or an interleaved
    head split changes the norms' ratio from vector to vector and fails the test. Accepted
    when the norms fit s times the chunk's to FOLD_TOL and NORM_EVIDENCE times better than a
    constant does (the norms must vary for the test to tell anything).
    """
    if operand.dim() != 4 or not operand.numel():
        return None
    B, h, T, dk = operand.shape
    a = operand.detach().float().norm(dim=-1)                                 # [B, h, T]
    a_norm = a.norm()
    flat = float((a - a.mean()).norm() / a_norm) if a_norm > 0 else 0.0        # a constant's fit
    tol = min(FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)], flat / NORM_EVIDENCE)
    if not tol > 0:
        return None
    for back, (inp, out, weight), n, j, layout in cands:
        rows = _rows(out, B, T)
        view = None if rows is None else _split_heads(rows, n, j, layout, h, dk)
        if view is None:
            continue
        c = view.float().norm(dim=-1)                                         # [B, h, T]
        c_norm = c.norm()
        if not c_norm > 0:
            continue
        s = float(a_norm / c_norm)
        if float((a - s * c).norm() / a_norm) <= tol:
            return s, inp, (weight, n, j, layout), (back, n, j, layout, "norms")
    return None


def _sorted_projection(operand: torch.Tensor, cands: list):
    """`_find_projection` by sorted values: any rearrangement of s * a chunk matches."""
    a = operand.detach().float().flatten()
    if not a.numel():
        return None
    a_sorted = a.sort().values
    a_norm = a_sorted.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j, layout in cands:
        width = out.shape[-1]
        if layout != "blocks" or width % n or out.numel() // n != a.numel():
            continue
        w = width // n
        chunk = out[..., j * w:(j + 1) * w].float().flatten().sort().values
        c_norm = chunk.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign, ref in ((1.0, chunk), (-1.0, chunk.flip(0))):
            if float((a_sorted - sign * s * ref).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j, layout), (back, n, j, layout, "values")
    return None


def _find_projection(operand: torch.Tensor, pool: list, hint=None):
    """(s, input, (weight, n, j, layout), where) when `operand` is s * a chunk of one linear
    map's output, found by values or, failing that, by per-vector norms; else None. `where`
    (the candidate's place and how it matched: "values" or "norms") is the hint next time.

    By values: sorted values are compared, so any reshape/transpose/view of the projection
    matches and nothing else does. The usual head split ([B, T, h*d_k] -> [B, h, T, d_k]) is
    tried first, element by element (O(n); an element-wise match is a sorted-value match):
    sorting is 90% of a probed training step's cost under `tndebug.watch`.
    By norms (`_norm_projection`): a rotation between the projection and the product (RoPE),
    which no value match survives; s is exact, its sign is not known.
    The hint (the same code runs each step) is checked first, by the test that found it.
    """
    cands = list(_candidates(pool, hint))
    if hint is not None and hint[-1] == "norms" and hint[0] < len(pool):
        first = cands[:1]                # still a rotation? (a value match would be found first)
        hit = _head_split_projection(operand, first) or _norm_projection(operand, first)
        if hit is not None:
            return hit
    return (_head_split_projection(operand, cands) or _sorted_projection(operand, cands)
            or _norm_projection(operand, cands))


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
