"""The user's line of one op while a probe's own forward runs: `input_line` (the op that made
what a module is called with: where an absolute position table is added before the first block)
and `random_op_line` (the first op that draws random numbers: a dropout left on in eval mode).
Frames are sorted by origins.py's rule (`frame_kind`, `user_frame`).
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

from tndebug.capture.origins import OURS, WRAP, as_location, frame_kind, op_tensors, user_frame
from tndebug.capture.source import location


class _OpLines(TorchFunctionMode):
    """id(tensor) -> (weak ref, the user's line of the op that returned it), for one run."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if isinstance(out, torch.Tensor) and not any(out is a for a in op_tensors(args, kwargs)):
                frame = user_frame(sys._getframe(1))
                if frame is not None:
                    code = frame.f_code
                    self.made[id(out)] = (weakref.ref(out), (code.co_filename, frame.f_lineno,
                                          getattr(code, "co_qualname", code.co_name),
                                          frame_kind(code.co_filename)))
        except Exception:  # noqa: BLE001 - the notes never break the forward
            pass
        return out


def input_line(module, run) -> tuple[dict | None, tuple | None]:
    """The user's line of the op that made the first tensor `module` is called with (its
    first call) while `run()` runs, and that tensor's shape: for the first block of a stack,
    the line that made what enters the stack (`x = self.tok(ids)`, where an absolute position
    table is added). For a probe's own forward; the line is None when that op is not the
    user's, both are None when `run` raised or the module was not called."""
    mode, got = _OpLines(), {}

    def pre(mod, args, kwargs):
        if "x" not in got:
            got["x"] = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with mode:
            run()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None, None
    finally:
        handle.remove()
    x = got.get("x")
    if x is None:
        return None, None
    e = mode.made.get(id(x))
    return (as_location(e[1]) if e is not None and e[0]() is x else None), tuple(x.shape)


_RANDOM = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
                     "randperm", "bernoulli", "bernoulli_", "normal", "normal_", "uniform_",
                     "multinomial", "exponential_", "geometric_", "random_"})
_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                       "feature_alpha_dropout", "dropout_", "native_dropout"})


def _random(func, args, kwargs) -> bool:
    """An op that draws random numbers as called: a dropout with training on and p > 0, or a
    sampling op."""
    name = getattr(func, "__name__", "")
    if name in _RANDOM:
        return True
    if name not in _DROPOUTS:
        return False
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return bool(train) and isinstance(p, (int, float)) and p > 0


class _RandomOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            try:
                if _random(func, args, kwargs):
                    frame = sys._getframe(1)
                    while frame is not None and frame_kind(frame.f_code.co_filename) in (OURS, WRAP):
                        frame = frame.f_back
                    frame = user_frame(frame)
                    if frame is not None:
                        code = frame.f_code
                        self.found = location(code.co_filename, frame.f_lineno,
                                              getattr(code, "co_qualname", code.co_name),
                                              frame_kind(code.co_filename))
            except Exception:  # noqa: BLE001 - the search never breaks the call
                pass
        return func(*args, **kwargs)


def random_op_line(run) -> dict | None:
    """The user's line of the first op that draws random numbers while `run()` runs (a bare
    F.dropout(x, p) left on in eval mode), as a location; None when none is found in the user's
    code. For a finding that eval outputs are not repeatable; `run` is called once."""
    mode = _RandomOps()
    try:
        with mode:
            run()
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None
    return mode.found
