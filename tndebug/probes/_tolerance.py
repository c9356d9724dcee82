"""The exact tests' tolerances follow the dtype the model computes in.

Each exact test's tolerance was set for float32, about two orders of magnitude above its rounding
(eps 1.2e-7) and far below the effects it looks for (1e-2..1). In float16 (eps 9.8e-4) or
bfloat16 (eps 7.8e-3) one rounding of a stored value is already larger than those tolerances:
a healthy half-precision softmax row sums to 1 +- eps (each probability is rounded to eps/2 of
itself, and the normalisation adds as much), so the float32 tolerance called it "masked after
softmax". `tol(base)` is the float32 tolerance or EPS_MARGIN units of the compute dtype's eps,
whichever is larger: float32 keeps its tolerances exactly; a 16-bit model gets a bound twice the
worst case of one rounding. The effects stay above it: a masked key's share of a row, a causal
leak's change of the logits, a view-without-transpose fit residual are 1e-2..1, so a bfloat16
model's mask-after-softmax is still seen where the masked keys held more than 2 eps (1.6%) of a
row.

The engine sets the dtype for each probe moment (`computing_in(run.compute_dtype)`); a tensor
passed to `tol` counts too (probabilities stored in half precision under float32 weights).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

EPS_MARGIN = 2.0        # units of eps: twice the worst case of one rounding (see above)

_DTYPE: ContextVar[torch.dtype] = ContextVar("tndebug_compute_dtype", default=torch.float32)


@contextlib.contextmanager
def computing_in(dtype: torch.dtype | None):
    """The exact tests inside judge at `dtype`'s precision (None or a non-float dtype: float32)."""
    token = _DTYPE.set(dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point
                       else torch.float32)
    try:
        yield
    finally:
        _DTYPE.reset(token)


def coarsest(*tensors: torch.Tensor) -> torch.dtype:
    """The least precise of the compute dtype and the given tensors' floating dtypes."""
    dtypes = [_DTYPE.get()] + [t.dtype for t in tensors
                               if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def tol(base: float, *tensors: torch.Tensor) -> float:
    """`base` (the float32 tolerance) or EPS_MARGIN eps of the coarsest dtype, the larger."""
    return max(base, EPS_MARGIN * torch.finfo(coarsest(*tensors)).eps)
