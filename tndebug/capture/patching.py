"""The torch primitives swapped for recording wrappers while a recording runs (and restored):
one table, with a TorchFunctionMode for the calls a model bound before the patch.
"""
from __future__ import annotations

import functools
import math
from contextlib import contextmanager

from torch.overrides import TorchFunctionMode
import torch
import torch.nn.functional as F

from typing import TYPE_CHECKING

if TYPE_CHECKING:                       # annotations only: no import circle
    from tndebug.capture.recording import State


# -- patching ------------------------------------------------------------------------------------
@contextmanager
def patched(state: State):
    """Swap torch's attention primitives for recording wrappers (`_PATCHES`, in this order);
    always restored."""
    originals = []
    try:
        for owner, name, make in _PATCHES:
            orig = getattr(owner, name)
            originals.append((owner, name, orig))
            setattr(owner, name, make(state, orig))
        wrapped = {orig: getattr(owner, name) for owner, name, orig in originals
                   if (owner, name) in ((torch, "einsum"), (F, "softmax"))}
        with _rebound(state, wrapped):
            yield
    finally:
        for owner, name, orig in reversed(originals):
            setattr(owner, name, orig)


# each wrapper factory `make(state, orig)`: the recording's view of one torch primitive
def _product(state: State, orig, kT=True):
    def wrapper(a, b, *args, **kwargs):
        if state.current() is None:
            return orig(a, b, *args, **kwargs)
        if state.kv_swap:
            b = state.swap_kv(b)
        state.busy = True
        try:
            out = orig(a, b, *args, **kwargs)
        finally:
            state.busy = False
        state.on_product(a, b, out, kT)
        return out
    return wrapper


def _add(state: State, orig, inplace=False):
    def wrapper(a, b, *args, **kwargs):
        if state.current() is None:
            return orig(a, b, *args, **kwargs)
        before = a.clone() if inplace and isinstance(a, torch.Tensor) else a
        state.busy = True
        try:
            out = orig(a, b, *args, **kwargs)
        finally:
            state.busy = False
        if args or kwargs:                   # add(a, b, alpha=...): not a plain sum
            return out
        state.on_add(before, b, out)
        return out
    return wrapper


def _linear(state: State, orig):
    def wrapper(x, *args, **kwargs):
        out = orig(x, *args, **kwargs)
        if state.calls:
            state.on_linear(x, out, args[0] if args else kwargs.get("weight"))
        return out
    return wrapper


def _addmm(state: State, orig):
    def wrapper(inp, x, w, *args, **kwargs):       # bias + x @ w: Hugging Face's Conv1D
        out = orig(inp, x, w, *args, **kwargs)
        if state.calls and isinstance(w, torch.Tensor) and w.dim() == 2:
            state.on_linear(x, out, w)
        return out
    return wrapper


def _baddbmm(state: State, orig):
    def wrapper(inp, b1=None, b2=None, *args, beta=1, alpha=1, batch1=None, batch2=None, **kwargs):
        b1, b2 = (batch1 if b1 is None else b1), (batch2 if b2 is None else b2)   # BLOOM's keywords
        if state.current() is None:
            return orig(inp, b1, b2, *args, beta=beta, alpha=alpha, **kwargs)
        state.busy = True
        try:
            out = orig(inp, b1, b2, *args, beta=beta, alpha=alpha, **kwargs)
            raw = torch.bmm(b1, b2)
        finally:
            state.busy = False
        state.on_product(b1, b2, raw)
        call = state.current()
        # out = alpha * q k^T + beta * inp: the scores, scaled, with inp added (a mask, ALiBi)
        # as `scores + mask` is; beta = 0 (GPT-2's reordered path): the scaled scores alone,
        # to be followed like a matmul's
        if call is not None and call.raw is raw and beta != 0 and isinstance(inp, torch.Tensor):
            state.busy = True
            try:
                call.add_pre, call.add_terms = (raw * alpha).detach(), [(inp * beta).detach()]
            finally:
                state.busy = False
            call.chain_out = out
        return out
    return wrapper


def _einsum(state: State, orig):
    def wrapper(eq, *operands, **kwargs):
        ops = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
        if state.current() is None or len(ops) != 2:
            return orig(eq, *operands, **kwargs)
        a, b = ops
        if state.kv_swap:                # k or v with its kv heads swapped: one product
            b = state.swap_kv(b)
        state.busy = True
        try:
            out = (orig(eq, *operands, **kwargs) if b is ops[1]
                   else orig(eq, a, b, **kwargs))
        finally:
            state.busy = False
        call = state.current()
        if call is not None and isinstance(b, torch.Tensor) and b.dim() == 2:
            if state.trace is not None:                  # "btd,de->bte": a projection
                call.linears.append((a.detach(), out.detach(), b))
        elif call is not None and out.dim() >= 3:
            if not call.softmaxed and call.raw is None and a.shape[-1] == b.shape[-1]:
                call.q, call.k, call.raw = a, b, out            # "...qd,...kd->...qk"
                state.locate(call, "scores")
                layout = einsum_scores_layout(eq, a, b, out)
                if layout:
                    call.extra["layout"] = layout
            elif call.softmaxed and call.z is None:
                call.v, call.z = b, out
                layout = einsum_values_layout(eq, call.extra.get("layout"), a, b, out)
                if layout:
                    call.extra["layout"] = {**call.extra["layout"], **layout}
        return out
    return wrapper


def _masked_fill(state: State, orig, inplace=False):
    def wrapper(x, mask, value, *args, **kwargs):
        if state.current() is None:
            return orig(x, mask, value, *args, **kwargs)
        before = x.clone() if inplace else x
        state.busy = True
        try:
            out = orig(x, mask, value, *args, **kwargs)
        finally:
            state.busy = False
        state.on_masked_fill(before, mask, out)
        return out
    return wrapper


def _softmax(state: State, orig):
    def wrapper(x, *args, **kwargs):
        if state.current() is None:
            return orig(x, *args, **kwargs)
        x_in = state.softmax_input(x)
        state.busy = True
        try:
            out = orig(x_in, *args, **kwargs)
        finally:
            state.busy = False
        state.on_softmax(x_in, out)
        return out
    return wrapper


def _sdpa(state: State, orig):
    def wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, **kwargs):
        call = state.current()
        if call is None:
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, **kwargs)
        use_scale = scale
        if state.kv_swap:
            key, value = state.swap_kv(key), state.swap_kv(value)
        if state.alpha is not None and not call.scaled:
            call.scaled = True
            use_scale = (scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])) * state.alpha
        state.busy = True
        try:
            out = orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                       is_causal=is_causal, scale=use_scale, **kwargs)
        finally:
            state.busy = False
        state.on_sdpa(query, key, value, attn_mask, is_causal, use_scale, out)
        return out
    return wrapper


_inplace_add = functools.partial(_add, inplace=True)
_inplace_masked_fill = functools.partial(_masked_fill, inplace=True)
# (owner, name, make): what `patched` swaps, in order (restored in the reverse order)
_PATCHES = [
    *((owner, name, make) for owner in (torch, torch.Tensor)
      for name, make in (("matmul", _product), ("bmm", _product), ("masked_fill", _masked_fill),
                         ("softmax", _softmax))),
    (torch.Tensor, "__matmul__", _product),
    (torch, "add", _add),
    (torch.Tensor, "add", _add),
    (torch.Tensor, "__add__", _add),
    (torch.Tensor, "__radd__", _add),
    (torch.Tensor, "add_", _inplace_add),
    (torch.Tensor, "__iadd__", _inplace_add),
    (F, "linear", _linear),
    (torch.Tensor, "masked_fill_", _inplace_masked_fill),
    (torch, "addmm", _addmm),
    (torch.Tensor, "addmm", _addmm),
    (torch, "baddbmm", _baddbmm),
    (torch.Tensor, "baddbmm", _baddbmm),        # `alibi.baddbmm(...)`: BLOOM
    (torch, "einsum", _einsum),
    (F, "softmax", _softmax),
    (F, "scaled_dot_product_attention", _sdpa),
]


class _Rebound(TorchFunctionMode):
    """Calls of torch functions the model bound before the patch (`from torch import einsum`,
    `functools.partial(F.softmax, dim=-1)`, as x-transformers does): torch hands every call of
    such a function to an active mode, whatever name it was called by, so they reach the same
    recording wrappers. A call made through the patched name reaches the mode from inside its
    wrapper, while `state.busy`, and passes through unrecorded a second time."""

    def __init__(self, state: "State", wrapped: dict) -> None:
        super().__init__()
        self.state, self.wrapped, self.hits = state, wrapped, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrapper = self.wrapped.get(func)
        if wrapper is not None and not self.state.busy and self.state.current() is not None:
            self.hits += 1
            return wrapper(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def _rebound(state: "State", wrapped: dict):
    """`_Rebound` for this recording, unless an earlier one of this capture saw attention and
    found every call through the patched names (then it costs nothing: most models)."""
    cap = state.cap
    if getattr(cap, "bound_elsewhere", None) is False or not wrapped:
        yield
        return
    mode = _Rebound(state, wrapped)
    with mode:
        yield
    if mode.hits:
        cap.bound_elsewhere = True
    elif state.calls_seen:
        cap.bound_elsewhere = False


def _subscripts(eq: str, *tensors) -> tuple[list[str], str] | None:
    """(input subscripts, output subscripts) of an explicit two-operand equation whose letters
    match the operands' dims; None for an ellipsis, an implicit output or a mismatch."""
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.split("->")
    ins = ins.split(",")
    if len(ins) != 2 or any(len(set(s)) != len(s) for s in (*ins, out)):
        return None
    if any(len(s) != t.dim() for s, t in zip((*ins, out), tensors)):
        return None
    return ins, out


def einsum_scores_layout(eq: str, q, k, scores) -> dict[str, list[int]] | None:
    """The permutations that put an einsum's score product in the probes' layout, whatever the
    equation's axis order: q -> [B, h, T, d], k -> [B, h, S, d], scores (and what follows them:
    the masked scores, the probabilities) -> [B, h, T, S]. The roles are read off the equation:
    d is summed, T is q's alone, S is k's alone, B and h are in all three (in q's order).
    "ibhd,jbhd->ijbh" (sequence first) and "bqhd,bkhd->bhqk" both map; identity ones and
    equations of other shapes (no head axis, an ellipsis) give None."""
    parsed = _subscripts(eq, q, k, scores)
    if parsed is None:
        return None
    (A, B), O = parsed
    summed = [c for c in A if c in B and c not in O]
    batch = [c for c in A if c in B and c in O]
    qi = [c for c in A if c not in B and c in O]
    kj = [c for c in B if c not in A and c in O]
    if len(summed) != 1 or len(batch) != 2 or len(qi) != 1 or len(kj) != 1:
        return None
    perm = {"q": [A.index(c) for c in (*batch, *qi, *summed)],
            "k": [B.index(c) for c in (*batch, *kj, *summed)],
            "scores": [O.index(c) for c in (*batch, *qi, *kj)]}
    if all(p == sorted(p) for p in perm.values()):
        return None                                          # already [B, h, T, *]
    perm["masked_scores"] = perm["probs"] = perm["scores"]
    return perm


def einsum_values_layout(eq: str, layout: dict | None, probs, v, z) -> dict[str, list[int]] | None:
    """After `einsum_scores_layout`: v -> [B, h, S, d] and z -> [B, h, T, d] for the product of
    the probabilities (in the scores' layout) with the values."""
    if not layout or "scores" not in layout:
        return None
    parsed = _subscripts(eq, probs, v, z)
    if parsed is None:
        return None
    (A, B), O = parsed
    canon = [A[i] for i in layout["scores"]]                 # B, h, T, S in this equation's letters
    d = [c for c in B if c not in A]
    if len(d) != 1 or any(c not in B for c in (canon[0], canon[1], canon[3])) \
            or any(c not in O for c in (canon[0], canon[1], canon[2])):
        return None
    return {"v": [B.index(c) for c in (canon[0], canon[1], canon[3], d[0])],
            "z": [O.index(c) for c in (canon[0], canon[1], canon[2], d[0])]}
