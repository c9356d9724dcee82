"""A model's floating-point weights and buffers in float64 for the length of a `with` block, then
back to the dtypes they had (float32 -> float64 -> float32 is exact, so the model is unchanged).

Used where a setup-time test's fp32 result sits at the rounding floor and must be told from it:
an exact invariance holds in float64 to ~1e-15, a real but weak effect keeps its size.

The model's own casts follow: inside the block a `.float()`, `.half()`, `.to(torch.float32)`, a
`dtype=torch.float32` (softmax, arange, zeros...) gives float64 (complex64: complex128). Code
that computes its scores in float32 on purpose (GPT-J's `query.float()`, Llama's softmax in
float32) would otherwise round there again, and a swap or permutation effect that is float32
rounding would keep its float32 size (5.8e-08 beside 1.1e-07 in the user-style corpus's GPT-J
with rotary never applied: read as a weak real signal, bench/results/foreign_styles at 103777c).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tndebug.sharded import any_sharded

# what a cast to a narrower floating type becomes inside the block
_WIDE = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
         torch.complex64: torch.complex128, torch.complex32: torch.complex128}
# methods that are casts by name; Tensor.view(dtype) is left alone (it reinterprets the bytes)
_METHODS = {torch.Tensor.float: torch.Tensor.double, torch.Tensor.half: torch.Tensor.double,
            torch.Tensor.bfloat16: torch.Tensor.double, torch.Tensor.cfloat: torch.Tensor.cdouble}
_AS_IS = {torch.Tensor.view}


def _wide(x):
    return _WIDE.get(x, x) if isinstance(x, torch.dtype) else x


class _Float64Casts(TorchFunctionMode):
    """Every torch call inside: a narrower floating dtype argument reads as float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AS_IS:
            return func(*args, **kwargs)
        func = _METHODS.get(func, func)
        return func(*(_wide(a) for a in args), **{k: _wide(v) for k, v in kwargs.items()})


@contextmanager
def in_float64(model: nn.Module):
    """Each parameter's and buffer's `.data` cast in place (the same tensor objects, so tied
    weights stay tied and hooks stay attached; complex ones to complex128), restored on exit, also
    after an exception; the code's own casts to float32 or narrower give float64 meanwhile."""
    if any_sharded(model.parameters()):
        # FSDP2 keeps its own views of each shard's memory: a new `.data` would detach them
        # (its all-gathers read the old memory, and a later step crashed in torch); the
        # callers take this as "cannot run in float64" and keep their float32 result
        raise ValueError("a sharded (FSDP2) model is not cast to float64 in place")
    saved = []
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or not (t.is_floating_point() or t.is_complex()):
            continue
        seen.add(id(t))
        saved.append((t, t.dtype))
        t.data = t.data.to(torch.complex128 if t.is_complex() else torch.float64)
    try:
        with _Float64Casts():
            yield model
    finally:
        for t, dtype in saved:
            t.data = t.data.to(dtype)
