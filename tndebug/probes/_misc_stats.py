"""Small helpers shared by the positional-encoding, gradient-flow, loss-health, lr-schedule and
label-smoothing probes. Nothing here knows tndebug's module names: layers are found from
parameter names, the way any `nn.Module` spells them.
"""
from __future__ import annotations

import re
import statistics
from collections import deque

import torch
from torch import nn

from tndebug import tags

# The first `<container>.<index>.` in a parameter path: `encoder.layers.3.ffn.w_1.weight`,
# `model.encoder.layer.3...` (BERT), `encoder.block.3...` (T5), `h.3...` (GPT-2).
_INDEXED = re.compile(r"^(?:(.*?)\.)?([A-Za-z_]\w*)\.(\d+)\.")


def layer_group(param_name: str) -> tuple[str, str, int | None]:
    """(group path, stack, layer) for one parameter name.

    `encoder.layers.0.self_attn.w_q.weight` -> ("encoder.layers.0", "encoder", 0);
    a parameter outside any indexed list groups by its module path:
    `generator.proj.weight` -> ("generator.proj", "generator.proj", None).
    """
    m = _INDEXED.match(param_name)
    if m:
        outer, container, idx = m.group(1), m.group(2), int(m.group(3))
        group = f"{outer + '.' if outer else ''}{container}.{idx}"
        return group, outer or container, idx
    module = param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    return module, module, None


def group_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters grouped by layer, in the model's definition order (shared ones once)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():   # named_parameters() already drops duplicates
        if p.requires_grad:
            groups.setdefault(layer_group(name)[0], []).append((name, p))
    return groups


def metric_tag(name: str, family: str = "grad", leaf: str = "norm") -> str:
    """`grad/encoder/layer0/norm` for anything inside `encoder.layers.0`; `grad/generator.proj/norm`
    for a module outside the indexed layers."""
    _, stack, layer = layer_group(name + ".")
    if layer is None:
        return (tags.GRAD_OUTSIDE.build(module=name) if (family, leaf) == ("grad", "norm")
                else f"{family}/{name}/{leaf}")
    fam = {("grad", "norm"): tags.GRAD, ("relu", "dead_fraction"): tags.RELU}.get((family, leaf))
    return fam.build(stack=stack, layer=layer) if fam else f"{family}/{stack}/layer{layer}/{leaf}"


def rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean().sqrt()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 on the host (one sync; used by setup-time tests only)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class RunningMedian:
    """Median of the last `window` values (host floats)."""

    def __init__(self, window: int = 20) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        return statistics.median(self.values)

    def push(self, value: float) -> None:
        self.values.append(value)


def first_reason(exc: BaseException) -> str:
    """`ValueError: sequence length 512 exceeds ...` cut to one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:200]
