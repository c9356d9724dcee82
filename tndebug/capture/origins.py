"""Where the tensors of a probed pass were made: the user's line of the op that returned each.

A finding's evidence is often read on one line and caused on another: a mask built in the
model's forward (or a `tril` buffer registered in `__init__`) and filled into the scores in a
helper, heads split in one method and multiplied in another, a residual added in a module the
probe reads as a block output. `Origins` is a TorchFunctionMode made for a recording with a
Trace (`generic._installed`: probed passes only, the unprobed steps never enter it,
tests/capture/test_origins.py) and on while the model's own forward runs (its root module's
hooks); it notes, for every tensor an op returns, the innermost frame of the user's code
(source.py's rule) and the tensors it was made from.
The recording then asks, at the ops the probes read:

* `line(t)`: the line that made `t` (a module's output, q at the score product, the softmax's
  input);
* `mask_origin(mask, call)`: the line that built the mask the scores were filled with, followed
  back through the ops inside the attention call (`~mask`, `mask == 0`, a slice) to the tensor
  made outside it, or to the `register_buffer` / `self.x =` line of a buffer;
* `none_passed()`: for an attention that got no mask, the call that passed `None` for it.

Only weak references and ids are held; the notes die with the recording.

The frame rule here (`frame_kind`, `user_frame`) is shared by the lines a probe finds in its own
forwards: taken_lines.py (where a module's output is taken), op_lines.py (the op that made a
module's input, the first random op) and cache_divergence.py (where a cached step leaves the
full forward); assignments.py reads the source for lines no op ran (a buffer's, a table's).
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from tndebug.capture.assignments import attribute_line
from tndebug.capture.source import file_kind, location

_HERE = os.path.dirname(os.path.realpath(__file__)) + os.sep
_TNDEBUG = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_PATCHING = _HERE + "patching.py"
SKIP, OURS, WRAP = "skip", "ours", "wrap"      # a frame's kind (`frame_kind`)
_FILES: dict[str, object] = {}


def frame_kind(filename: str):
    """OURS (tndebug's code), WRAP (a recording wrapper: called on the user's behalf),
    "user" or a package name (source.file_kind), or SKIP (torch, the standard library)."""
    k = _FILES.get(filename)
    if k is None:
        path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
        if path == _PATCHING:
            k = WRAP
        elif path.startswith(_TNDEBUG):
            k = OURS
        else:
            k = file_kind(filename) or SKIP
        _FILES[filename] = k
    return k


def user_frame(frame):
    """The innermost frame of the user's (or transformers') code above `frame`, or None when
    the op was tndebug's own work (a hook, a statistic) or tndebug's model's."""
    while frame is not None:
        k = frame_kind(frame.f_code.co_filename)
        if k == OURS:
            return None
        if k not in (SKIP, WRAP):
            return frame
        frame = frame.f_back
    return None


def op_tensors(args, kwargs):
    """The tensors an op is called with (in lists and tuples too)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


class Origins(TorchFunctionMode):
    """The notes of one recording: id(tensor) -> (weak ref, (file, line, function, kind), id of
    the attention call it was made in (0: none), parents). A parent is (weak ref, its own note
    as it was then or None, numel): temporaries (`self.tril[:T, :T]` before `== 0`) are freed
    long before a probe asks, their notes are not."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.made: dict[int, tuple] = {}
        self.active = False

    def open(self) -> None:
        """Note from here on (the model's forward begins: a module hook, outside any op)."""
        if not self.active:
            self.__enter__()
            self.active = True

    def close(self) -> None:
        """Stop noting: the mode leaves torch's stack, if it is on top of it (a hook runs
        outside any op); the notes stay readable."""
        if self.active and _get_current_function_mode_stack()[-1:] == [self]:
            self.__exit__(None, None, None)
            self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _FILES.get(sys._getframe(1).f_code.co_filename) == OURS:
            return out                            # tndebug's own statistics: nothing to note
        try:
            self._note(out, args, kwargs, getattr(func, "__name__", ""))
        except Exception:       # noqa: BLE001 - the notes never break the user's forward
            pass
        return out

    def _note(self, out, args, kwargs, name: str = "") -> None:
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = tuple(o for o in out if isinstance(o, torch.Tensor))
            if not outs:
                return
        else:
            return
        frame = user_frame(sys._getframe(2))
        if frame is None:
            return
        code = frame.f_code
        where = (code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                 frame_kind(code.co_filename))
        parents = tuple(op_tensors(args, kwargs))
        calls = self.state.calls
        cid = id(calls[-1]) if calls else 0
        made = self.made
        refs = tuple((weakref.ref(p), made.get(id(p)), p.numel()) for p in parents)
        for o in outs:
            if any(o is p for p in parents):       # in place: the tensor was made before
                continue
            made[id(o)] = (weakref.ref(o), where, cid, refs, name)

    # -- questions -------------------------------------------------------------------------
    def entry(self, t) -> tuple | None:
        e = self.made.get(id(t)) if isinstance(t, torch.Tensor) else None
        return e if e is not None and e[0]() is t else None

    def line(self, t) -> dict | None:
        """The user's line that made `t`, as a location (source.location)."""
        e = self.entry(t)
        return as_location(e[1]) if e is not None else None

    def mask_origin(self, mask, call) -> dict | None:
        """Where the mask applied in `call` was built: `mask` followed back through the ops made
        inside that call to the first tensor made outside it (the model's forward, a mask
        helper), or to the line that assigned the buffer or attribute it was read from. An op on
        the way that moves the mask's entries (a transpose, a flip, a tril: `GEOMETRIC`) is where
        the mask became what it is: its line."""
        cid = id(call)
        e = self.entry(mask)
        if e is None:
            return attribute_line(self.state.cap.model, mask)
        for _ in range(32):
            if e[2] != cid:
                return as_location(e[1])
            if not e[3] or e[4] in GEOMETRIC:
                return as_location(e[1])                 # built (or rearranged) inside the attention
            ref, note, _ = min(e[3], key=lambda p: p[2])   # a mask broadcasts: the smaller operand
            if note is None or note[0]() is not None and note[0]() is not ref():
                return attribute_line(self.state.cap.model, ref()) or as_location(e[1])
            e = note
        return None

    def none_passed(self) -> dict | None:
        """For an attention that applied no mask: the call that passed `None` for one. From the
        innermost user frame outwards, while a function's own parameter named like a mask
        (`mask`, `attn_mask`, `attention_mask`: a hint for the line, not a verdict) is None, the
        next user frame out is its caller; the line there passed it (`layer(h, freqs, None)`).
        None when the innermost frame takes no such parameter."""
        frame = sys._getframe(1)
        while frame is not None and frame_kind(frame.f_code.co_filename) in (OURS, WRAP):
            frame = frame.f_back                  # the recording's own frames
        frame = user_frame(frame)
        found = None
        while frame is not None:
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount
            names = [v for v in code.co_varnames[:n] if "mask" in v.lower()]
            if not names or any(frame.f_locals.get(v, 0) is not None for v in names):
                break
            found = frame
            frame = user_frame(frame.f_back)
        if found is None or frame is None:
            return None
        code = frame.f_code
        return location(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                        frame_kind(code.co_filename))


# ops that move a mask's entries to other positions (not a slice, a comparison, a negation)
GEOMETRIC = frozenset({"transpose", "transpose_", "permute", "flip", "fliplr", "flipud", "roll",
                       "rot90", "swapaxes", "swapdims", "movedim", "moveaxis", "tril", "triu", "t"})


def as_location(where) -> dict | None:
    """A noted (file, line, function, kind) as a location (source.location)."""
    if where is None:
        return None
    file, line, function, kind = where
    return location(file, line, function, kind)
