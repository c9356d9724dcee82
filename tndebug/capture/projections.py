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
# A row whose every added term is this far below zero has every key removed (a query that may
# see nothing: Gemma-3's sliding window over a padded tail, bench/hf_unseen.py's batches): its
# largest term is fill too, so MASK_NATS, relative to it, finds nothing. -1e4 is the mildest
# fill in use (Hugging Face's old -10000.0); a bias is a few nats (T5, ALiBi: slope x distance,
# and a row's own key adds 0), so no row of a bias comes near it.
FILL = 1e4


def masked_by_addition(added, shape) -> torch.Tensor | None:
    """Where an additive term removes keys.  # bool, broadcast to `shape` [B, h, T, S]"""
    if not isinstance(added, torch.Tensor) or not added.is_floating_point() or added.dim() < 1:
        return None
    d = added.float()
    top = d.amax(-1, keepdim=True)
    removed = ~d.isfinite() | (d < top - MASK_NATS) | (top <= -FILL)
    try:
        return removed.expand(shape) if removed.any() else None
    except RuntimeError:
        return None


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def looks_like_probs(w) -> bool:
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


def same_map(a, b) -> bool:
    """Two (weight, columns) are one projection: the same columns of one weight."""
    (wa, ca), (wb, cb) = a, b
    if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor):
        return False
    if wa is wb or (wa.shape == wb.shape and wa.data_ptr() == wb.data_ptr()):
        return ca.shape == cb.shape and bool(torch.equal(ca, cb))
    return False


def _columns(width: int, n, j: int, layout: str, dk: int) -> torch.Tensor | None:
    """The output columns chunk j of a split reads, in head order.  # [c heads * dk]"""
    cols = _chunk(torch.arange(width).view(1, 1, width), n, j, layout, dk)
    return None if cols is None else cols[0, :, 0].flatten()


def _unequal(m: int, hq: int) -> list:
    """Fused q|k|v splits whose chunks differ in width, for an output of m head widths and hq
    query heads: k and v of g = (m - hq) / 2 heads each, g < hq dividing hq (multi-query:
    g = 1, Falcon, GPT-BigCode; grouped-query: Phi-3's qkv_proj), read as blocks
    ([q | k | v]) or per kv group ([q_1..q_r k v] for each of g groups, r = hq / g: Falcon's
    new decoder architecture). Told from the widths alone, never from a config."""
    if hq < 2 or (m - hq) % 2:
        return []
    g = (m - hq) // 2
    if not 0 < g < hq or hq % g:
        return []
    return [((hq, g, g), "blocks"), ((hq // g, 1, 1), "heads")]


def _candidates(pool: list, hint: tuple | None, dk: int = 0, hq: int = 0):
    """(position from the end, linear, n, chunk j, layout) in the search order: the most
    recent projection first, q alone / kv fused / qkv fused in equal chunks (n an int), each
    fused output read as blocks ([q | k | v]) or per head ([q_h k_h v_h] for each head h:
    GPT-NeoX, BLOOM), then the unequal q|k|v splits that fit `hq` query heads of width `dk`
    (`_unequal`; n the chunks' widths in heads); `hint` (where the last match was) before all."""
    if hint is not None and hint[0] < len(pool):
        yield hint[0], pool[-1 - hint[0]], hint[1], hint[2], hint[3]
    for back in range(len(pool)):
        splits = [(n, layout) for n in (1, 2, 3)
                  for layout in (("blocks",) if n == 1 else ("blocks", "heads"))]
        width = pool[-1 - back][1].shape[-1]
        if dk and hq and not width % dk:
            splits += _unequal(width // dk, hq)
        for n, layout in splits:
            for j in range(n if isinstance(n, int) else len(n)):
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


def _chunk(out: torch.Tensor, n, j: int, layout: str, dk: int):
    """Chunk j of `out` [B, T, width] split into its heads, or None when the widths do not fit.
    n: that many equal chunks, or the chunks' widths in heads (`_unequal`). "blocks": the
    chunks side by side ([q | k | v]); "heads": the output is groups of all chunks' heads
    ([q_h k_h v_h] per head for equal chunks, [q_1..q_r k v] per kv group).  # [B, c, T, dk]"""
    width = out.shape[-1]
    if not dk:
        return None
    if isinstance(n, int):
        if width % (n * dk):
            return None
        parts = (width // (n * dk),) * n if layout == "blocks" else (1,) * n
    else:
        parts = tuple(n)
    unit = sum(parts)
    if width % (unit * dk) or (layout == "blocks" and width != unit * dk):
        return None
    B, T = out.shape[:2]
    off = sum(parts[:j])
    if layout == "blocks":
        view = out[..., off * dk:(off + parts[j]) * dk].reshape(B, T, parts[j], dk)
    else:
        groups = width // (unit * dk)
        view = out.reshape(B, T, groups, unit, dk)[:, :, :, off:off + parts[j]]
        view = view.reshape(B, T, groups * parts[j], dk)
    return view.transpose(1, 2)                                               # [B, c, T, dk]


def _split_heads(out: torch.Tensor, n, j: int, layout: str, h: int, dk: int):
    """`_chunk` repeated to h heads (a grouped-query k/v: each of g heads serves h/g query
    heads), in each order the code may repeat them: `repeat_kv`'s (`repeat_interleave`: q head
    i reads kv head i // (h/g)) first, then tiled (`k.repeat(1, h/g, 1, 1)`: q head i reads kv
    head i % g); g = 1 (broadcast) or g = h as it is. Yields (view [B, h, T, dk], order:
    "interleaved" | "tiled" | ""); nothing when the widths do not fit."""
    view = _chunk(out, n, j, layout, dk)
    if view is None:
        return
    g = view.shape[1]                                                         # heads in the chunk
    if not g or h % g:
        return
    if g in (1, h):
        yield view.repeat_interleave(h // g, dim=1) if g != h else view, ""
        return
    yield view.repeat_interleave(h // g, dim=1), "interleaved"
    yield view.repeat(1, h // g, 1, 1), "tiled"


def _head_split_projection(operand: torch.Tensor, cands: list):
    """`find_projection` for an operand that is s * chunk.view(B, T, h, d_k).transpose(1, 2)
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
        for view, order in (() if rows is None else _split_heads(rows, n, j, layout, h, dk)):
            view = view.float()
            c_norm = view.norm()
            if not (c_norm > 0 and a_norm > 0):
                continue
            s = float(a_norm / c_norm)
            for sign in (1.0, -1.0):
                if float((a - sign * s * view).norm() / a_norm) <= tol:
                    return (sign * s, inp, (weight, _columns(rows.shape[-1], n, j, layout, dk)),
                            (back, n, j, layout, order, "values"))
    return None


def _norm_projection(operand: torch.Tensor, cands: list):
    """`find_projection` for an operand that is s * U(b, h, t) applied to each head vector of
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
        for view, order in (() if rows is None else _split_heads(rows, n, j, layout, h, dk)):
            c = view.float().norm(dim=-1)                                     # [B, h, T]
            c_norm = c.norm()
            if not c_norm > 0:
                continue
            s = float(a_norm / c_norm)
            if float((a - s * c).norm() / a_norm) <= tol:
                return (s, inp, (weight, _columns(rows.shape[-1], n, j, layout, dk)),
                        (back, n, j, layout, order, "norms"))
    return None


def _position0_projection(operand: torch.Tensor, cands: list):
    """`find_projection` for an operand that is s * P_t applied to each head vector of one
    linear map's output chunk, P_t any map that depends on the position t alone and is the
    identity at t = 0. Every rotary embedding is (cos 0 = 1, sin 0 = 0), also one whose cos/sin
    tables pair other features than its rotate function does (cos/sin laid out for interleaved
    pairs, rotate_half pairing i with i + D/2): that one is no rotation, so the vectors' norms
    change and `_norm_projection` cannot match it. At t = 0 the vectors match by values, which
    gives s with its sign; the fit then reads the scale between the operands' product and the
    softmax, as for a rotation. Needs the first position of every row to be position 0 (a
    batch from its start: a row whose positions are offset fails the match)."""
    if operand.dim() != 4 or operand.shape[2] < 2 or not operand.numel():
        return None
    B, h, T, dk = operand.shape
    a = operand[:, :, 0].detach().float()                                     # [B, h, dk]
    a_norm = a.norm()
    if not a_norm > 0:
        return None
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j, layout in cands:
        rows = _rows(out, B, T)
        for view, order in (() if rows is None else _split_heads(rows, n, j, layout, h, dk)):
            c = view[:, :, 0].float()                                         # [B, h, dk]
            cc = (c * c).sum()
            if not cc > 0:
                continue
            s = float((a * c).sum() / cc)
            if s == 0 or float((a - s * c).norm() / a_norm) > tol:
                continue
            # later positions: the norms' ratio must vary between the vectors of one position (a
            # map that mixes each vector's features); one ratio per position is a position factor
            # (log-n scaling: a scale that varies with position, which one fitted constant cannot
            # state) or a norm-preserving map that `_norm_projection` found no evidence for
            r = operand[:, :, 1:].detach().float().norm(dim=-1) / (
                abs(s) * view[:, :, 1:].float().norm(dim=-1)).clamp_min(1e-30)  # [B, h, T-1]
            spread = float((r / r.mean(dim=(0, 1), keepdim=True).clamp_min(1e-30) - 1).pow(2).mean().sqrt())
            if spread > NORM_EVIDENCE * tol:
                return (s, inp, (weight, _columns(rows.shape[-1], n, j, layout, dk)),
                        (back, n, j, layout, order, "position0"))
    return None


def _sorted_projection(operand: torch.Tensor, cands: list):
    """`find_projection` by sorted values: any rearrangement of s * a chunk matches."""
    a = operand.detach().float().flatten()
    if not a.numel():
        return None
    a_sorted = a.sort().values
    a_norm = a_sorted.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j, layout in cands:
        width = out.shape[-1]
        if layout != "blocks":
            continue
        # equal chunks: one chunk as one "head"; unequal ones are in the operand's head widths
        cols = _columns(width, n, j, layout, width // n if isinstance(n, int) else operand.shape[-1])
        if cols is None or out.numel() // width * cols.numel() != a.numel():
            continue
        chunk = out[..., cols].float().flatten().sort().values
        c_norm = chunk.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign, ref in ((1.0, chunk), (-1.0, chunk.flip(0))):
            if float((a_sorted - sign * s * ref).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, cols), (back, n, j, layout, "", "values")
    return None


def _batches(operand: torch.Tensor, pool: list) -> list[int]:
    """Batch sizes B under which a 3-D operand [B*h, T, d_k] (BLOOM's baddbmm, nn.MultiheadAttention's
    bmm; B*1 for a one-head module) reads as [B, h, T, d_k]: those of the pool's outputs."""
    T, out = operand.shape[-2], []
    for _, o, _ in pool:
        B = o.shape[0] if o.dim() >= 3 else (o.shape[0] // T if o.dim() == 2 and not o.shape[0] % T else 0)
        if B and not operand.shape[0] % B and B not in out:
            out.append(B)
    return out


def find_projection(operand: torch.Tensor, pool: list, hint=None, q_shape=None):
    """`_match` for an operand [B, h, T, d_k], or [B*h, T, d_k] read as one for each batch size
    the pool's outputs have (`_batches`; the operand itself is returned as it came); `q_shape`:
    the q operand's shape at the product, whose heads the fused splits are fitted to (the
    operand's own by default: the q role)."""
    q_shape = tuple(operand.shape if q_shape is None else q_shape)
    if operand.dim() == 3 and operand.numel():
        batches = _batches(operand, pool)
        for B in batches:
            hq = q_shape[0] // B if len(q_shape) == 3 and not q_shape[0] % B else 0
            hit = _match(operand.reshape(B, operand.shape[0] // B, *operand.shape[1:]), pool, hint, hq)
            if hit is not None:
                return hit
        if batches:                 # the sorted-value match, blind to the reshape, was tried
            return None
    return _match(operand, pool, hint, q_shape[1] if len(q_shape) == 4 else 0)


def _match(operand: torch.Tensor, pool: list, hint=None, hq: int = 0):
    """(s, input, (weight, columns), where) when `operand` is s * a chunk of one linear
    map's output, found by values or, failing that, by per-vector norms; else None. `where`
    (the candidate's place and how it matched: "values" or "norms") is the hint next time.

    By values: sorted values are compared, so any reshape/transpose/view of the projection
    matches and nothing else does. The usual head split ([B, T, h*d_k] -> [B, h, T, d_k]) is
    tried first, element by element (O(n); an element-wise match is a sorted-value match):
    sorting is 90% of a probed training step's cost under `tndebug.watch`.
    By norms (`_norm_projection`): a rotation between the projection and the product (RoPE),
    which no value match survives; s is exact, its sign is not known. By the first position
    (`_position0_projection`): a position-dependent map that is no rotation (rotary tables
    laid out for other pairs than the rotation's) but the identity at position 0.
    The hint (the same code runs each step) is checked first, by the test that found it.
    """
    cands = list(_candidates(pool, hint, operand.shape[-1] if operand.dim() else 0, hq))
    if hint is not None and hint[-1] in ("norms", "position0") and hint[0] < len(pool):
        first = cands[:1]                # still a rotation? (a value match would be found first)
        hit = (_head_split_projection(operand, first) or _norm_projection(operand, first)
               or _position0_projection(operand, first))
        if hit is not None:
            return hit
    return (_head_split_projection(operand, cands) or _sorted_projection(operand, cands)
            or _norm_projection(operand, cands) or _position0_projection(operand, cands))


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
