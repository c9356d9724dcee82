"""A model's floating-point weights and buffers in float64 for the length of a `with` block, then
back to the dtypes they had (float32 -> float64 -> float32 is exact, so the model is unchanged).

Used where a setup-time test's fp32 result sits at the rounding floor and must be told from it:
an exact invariance holds in float64 to ~1e-15, a real but weak effect keeps its size.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def in_float64(model: nn.Module):
    """Each parameter's and buffer's `.data` cast in place (the same tensor objects, so tied
    weights stay tied and hooks stay attached), restored on exit, also after an exception."""
    from tndebug.sharded import any_sharded
    if any_sharded(model.parameters()):
        # FSDP2 keeps its own views of each shard's memory: a new `.data` would detach them
        # (its all-gathers read the old memory, and a later step crashed in torch); the
        # callers take this as "cannot run in float64" and keep their float32 result
        raise ValueError("a sharded (FSDP2) model is not cast to float64 in place")
    saved = []
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or not t.is_floating_point():
            continue
        seen.add(id(t))
        saved.append((t, t.dtype))
        t.data = t.data.to(torch.float64)
    try:
        yield model
    finally:
        for t, dtype in saved:
            t.data = t.data.to(dtype)
