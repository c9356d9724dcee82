"""`cache_divergence`: the user's line where a KV-cached decoding step first computes something
the full forward does not (positions restarted, values concatenated from the keys, a mask not
offset by the cache's length), found by running both in a probe's own forwards and comparing
their ops' outputs line by line. Frames are sorted by origins.py's rule (`user_frame`).
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from tndebug.capture.origins import as_location, frame_kind, user_frame


class _PassOps(TorchFunctionMode):
    """Per forward of `root` (a pass): [(where, a copy of the output)] for every op the user's
    code ran, in order; at most `budget` elements copied in all (a large model: the rest is not
    noted)."""

    def __init__(self, root, budget: int = 20_000_000) -> None:
        super().__init__()
        self.passes: list[list] = []
        self.budget, self.root, self.handles, self.open = budget, root, [], False

    def _begin(self, mod, args) -> None:
        self.passes.append([])
        self.open = True

    def _end(self, mod, args, out) -> None:
        self.open = False                          # the adapter's own ops after the forward

    def __enter__(self):
        self.handles = [self.root.register_forward_pre_hook(self._begin),
                        self.root.register_forward_hook(self._end)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if self.open and isinstance(out, torch.Tensor) and self.budget > out.numel():
                frame = user_frame(sys._getframe(1))
                if frame is not None:
                    code = frame.f_code
                    self.budget -= out.numel()
                    self.passes[-1].append(((code.co_filename, frame.f_lineno,
                                             getattr(code, "co_qualname", code.co_name),
                                             frame_kind(code.co_filename)), out.detach().clone()))
        except Exception:  # noqa: BLE001 - the notes never break the forward
            pass
        return out


def _aligned(full: torch.Tensor, step: torch.Tensor, pos: int):
    """`full`'s part that a cached step at position `pos` computes: along each axis where the
    step's is shorter (c), positions pos - c + 1 .. pos (the new token's row: c = 1; the keys
    0..pos: c = pos + 1); None when the shapes cannot correspond."""
    if full.dim() != step.dim() or full.dtype.is_complex or step.dtype.is_complex:
        return None
    for i, (f, c) in enumerate(zip(full.shape, step.shape)):
        if c > f or (c < f and (pos + 1 > f or pos - c + 1 < 0)):
            return None
        if c < f:
            full = full.narrow(i, pos - c + 1, c)
    return full


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        a, b = a.double(), b.double()
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):   # -inf where masked
            return False
        if not bool(fa.any()):
            return True
        # 1e-4 of the tensor's size: a cached step reruns the same ops on fewer rows, equal to
        # float32 rounding (~1e-7 relative); a wrong position, key or mask moves it by O(1)
        return float((a[fa] - b[fa]).abs().max()) <= 1e-4 * (1 + float(a[fa].abs().max()))
    return bool(torch.equal(a, b))


def cache_divergence(model, full, cached, pos: int, step: int = 1) -> dict | None:
    """The user's line where a KV-cached step first computes something the full forward does
    not: `full()` runs the whole rows once, `cached()` decodes them through the cache (its
    `step`-th forward of `model` decodes position `pos`). The step's ops are taken in order,
    each matched to the full pass's op of the same line and the same occurrence, and its output
    compared with the full output's part at that position (`_aligned`); an op only the cached
    step runs (`torch.cat((past_k, k))`) is matched to any full-pass op of its file. The
    first op that matches nothing is where the cache's computation leaves the full forward's:
    positions restarted, the values concatenated from the keys, a mask not offset by the
    cache's length. For a probe's own forwards, once a cache finding is made; None when every
    op matches or nothing was noted."""
    a, b = _PassOps(model), _PassOps(model)
    try:
        with a:
            full()
        with b:
            cached()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None
    if not a.passes or len(b.passes) <= step:
        return None
    by_line: dict = {}
    for where, out in a.passes[0]:
        by_line.setdefault(where[:2], []).append(out)
    by_file: dict = {}
    for where, out in a.passes[0]:
        by_file.setdefault(where[0], []).append(out)
    seen: dict = {}
    for where, out in b.passes[step]:
        n = seen.get(where[:2], 0)
        seen[where[:2]] = n + 1
        same_line = by_line.get(where[:2], [])
        cands = [same_line[n]] if n < len(same_line) else by_file.get(where[0], [])
        parts = [p for p in (_aligned(f, out, pos) for f in cands) if p is not None and p.shape == out.shape]
        if parts and not any(_same(p, out) for p in parts):
            return as_location(where)
    return None
