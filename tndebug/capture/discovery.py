"""What one forward shows of a model, whatever its modules are called (`GenericCapture.discover`):
the modules in which a softmax follows a product of two activations (q k^T, not x W) or an SDPA
call happens, and for every module, per call, whether a [B, T, d] stream went in and out (a
block applied several times along depth). torch's primitives are wrapped only for that forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Watch:
    """One discovery forward: the modules running now, those that multiplied two activations,
    those where a softmax (or SDPA) followed, and each module's calls."""

    def __init__(self, modules: dict) -> None:
        self.modules = modules
        self.stack: list[str] = []
        self.producted: set[str] = set()          # modules that multiplied two activations
        self.found: set[str] = set()
        self.calls: dict[str, list[bool]] = {}    # module -> per call: a [B, T, d] stream in and out

    def innermost(self) -> str | None:
        for name in reversed(self.stack):
            m = self.modules[name]
            if not (isinstance(m, nn.Softmax) or "softmax" in type(m).__name__.lower()):
                return name or None
        return None

    def on_softmax(self, x, sdpa=False) -> None:
        name = self.innermost()
        if name and (sdpa or (isinstance(x, torch.Tensor) and x.dim() >= 3 and name in self.producted)):
            self.found.add(name)

    def on_product(self, a, b) -> None:
        name = self.innermost()
        if name and all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (a, b)):
            self.producted.add(name)

    def called(self, name, args, kwargs, out) -> None:
        self.stack.pop()
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        y = out[0] if isinstance(out, (tuple, list)) and out else out
        self.calls.setdefault(name, []).append(   # (nested tensors, nn.TransformerEncoder's fast path: no)
            isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not x.is_nested
            and not y.is_nested and x.dim() == 3 and x.is_floating_point() and y.shape == x.shape)


# each wrapper factory `make(watch, orig)`: the discovery's view of one torch primitive
def _softmax(watch: _Watch, orig):
    def wrapper(x, *args, **kwargs):
        watch.on_softmax(x)
        return orig(x, *args, **kwargs)
    return wrapper


def _sdpa(watch: _Watch, orig):
    def wrapper(*args, **kwargs):
        watch.on_softmax(None, sdpa=True)
        return orig(*args, **kwargs)
    return wrapper


def _product(watch: _Watch, orig):
    def wrapper(a, b, *args, **kwargs):
        watch.on_product(a, b)
        return orig(a, b, *args, **kwargs)
    return wrapper


def _einsum(watch: _Watch, orig):
    def wrapper(eq, *ops, **kwargs):
        flat = ops[0] if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else ops
        if len(flat) == 2:
            watch.on_product(*flat)
        return orig(eq, *ops, **kwargs)
    return wrapper


# (owner, name, make): what a discovery forward wraps, in order (restored in the reverse order)
_PATCHES = [(F, "softmax", _softmax), (torch, "softmax", _softmax), (torch.Tensor, "softmax", _softmax),
            (F, "scaled_dot_product_attention", _sdpa), (torch, "matmul", _product),
            (torch.Tensor, "matmul", _product), (torch.Tensor, "__matmul__", _product),
            (torch, "bmm", _product), (torch.Tensor, "bmm", _product), (torch, "einsum", _einsum)]


def watch_forward(modules: dict, run) -> tuple[set[str], dict[str, list[bool]]]:
    """Run `run()` (one forward, no grad) with every module of `modules` (its model's
    `named_modules()`) hooked and torch's products and softmaxes wrapped. Returns the innermost
    modules in which a softmax followed a product of two activations or an SDPA call happened
    (a softmax module stands for its parent), and per module, per call, whether a [B, T, d]
    stream went in and out."""
    watch = _Watch(modules)
    handles = []
    for name, m in modules.items():
        handles.append(m.register_forward_pre_hook(lambda mod, a, name=name: watch.stack.append(name)))
        handles.append(m.register_forward_hook(
            lambda mod, a, kw, o, name=name: watch.called(name, a, kw, o), with_kwargs=True))
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in _PATCHES]
    try:
        for (owner, attr, make), (_, _, orig) in zip(_PATCHES, originals):
            setattr(owner, attr, make(watch, orig))
        with torch.no_grad():
            run()
    finally:
        for owner, attr, orig in reversed(originals):
            setattr(owner, attr, orig)
        for h in handles:
            h.remove()
    return watch.found, watch.calls
