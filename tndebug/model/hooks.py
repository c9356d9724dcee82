"""Tap points: identity modules at every activation, named by their module path.

Forward observation uses the ordinary `register_forward_hook`; backward observation uses
`HookPoint.add_grad_hook`, which attaches a tensor hook to the activation as it passes.
`HookPoint.active` lets the model skip work (and take a fused path) when nothing listens.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

GradFn = Callable[[str, torch.Tensor], None]


class HookPoint(nn.Module):
    """Identity; `name` is its path in the model, e.g. `encoder.layers.0.self_attn.hook_scores`."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""
        self._grad_fns: dict[int, GradFn] = OrderedDict()   # RemovableHandle needs a weak-referenceable dict
        self._next_id = 0

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks or self._forward_pre_hooks or self._grad_fns)

    def add_grad_hook(self, fn: GradFn) -> RemovableHandle:
        """Call `fn(name, grad)` with d(loss)/d(activation) on every backward pass."""
        handle = RemovableHandle(self._grad_fns)
        self._grad_fns[handle.id] = fn
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._grad_fns and x.requires_grad:
            name = self.name
            for fn in list(self._grad_fns.values()):
                x.register_hook(lambda g, fn=fn: fn(name, g))
        return x


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Give every HookPoint its module path, once, and return them in definition order."""
    points = {}
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = name
            points[name] = module
    return points


def tap(point: HookPoint, x: torch.Tensor) -> torch.Tensor:
    """Pass `x` through `point` only when something observes it (saves a module call)."""
    return point(x) if point.active else x
