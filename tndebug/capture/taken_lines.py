"""`TakenLines`: in a probe's own forward (the residual test's), where the user's code takes a
module's output: the frame a residual lost around an attention was lost in. Frames are sorted
by origins.py's rule (`frame_kind`, `user_frame`).
"""
from __future__ import annotations

import inspect
import sys

import torch
from torch.overrides import TorchFunctionMode

from tndebug.capture.origins import OURS, SKIP, WRAP, frame_kind, op_tensors, user_frame
from tndebug.capture.source import location


class TakenLines(TorchFunctionMode):
    """Where the output of each watched module is taken: for a module (an attention) called
    inside a block, the frame of the user's code, between the module's call and the block's own
    forward, that is still running when the output is first used by an op. A residual lost
    around the attention was lost there: the block's line `x = self.attn(self.ln_1(x))` when the
    output is next used in the block's forward (nanoGPT), the sublayer-connection's line
    `x = self.dropout(sublayer(self.norm(x)))` when that class's forward uses it first (the
    Annotated Transformer's SublayerConnection; the lambda passed to it has returned by then).
    The line given is the one that frame was at when it called the module.

    `watched`: module path -> the path of the block that holds it. For the probe's own forwards
    only (`with TakenLines(model, watched) as t: forward()`); `t.lines`: path -> location."""

    def __init__(self, model, watched: dict[str, str]) -> None:
        super().__init__()
        modules = dict(model.named_modules())
        self.watched = {p: modules[b] for p, b in watched.items() if p in modules and b in modules}
        self.modules = {p: modules[p] for p in self.watched}
        self.chains: dict[str, list] = {}          # path -> [(frame, line at the call)], inner first
        self.outputs: dict[int, tuple] = {}        # id(output) -> (path, the output: held)
        self.lines: dict[str, dict] = {}
        self.handles: list = []

    def __enter__(self):
        for path, mod in self.modules.items():
            self.handles.append(mod.register_forward_pre_hook(self._pre(path)))
            self.handles.append(mod.register_forward_hook(self._post(path)))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles, self.chains, self.outputs = [], {}, {}     # no frame outlives the forward
        return super().__exit__(*exc)

    def _pre(self, path):
        block = self.watched[path]
        code = getattr(inspect.unwrap(type(block).forward), "__code__", None)

        def hook(mod, args):
            if path in self.chains or path in self.lines:
                return None                       # a module called again: its first call decides
            chain, frame = [], sys._getframe(1)
            while frame is not None:
                k = frame_kind(frame.f_code.co_filename)
                if k == OURS:
                    return None                   # back in tndebug before the block's forward
                if k not in (SKIP, WRAP):
                    chain.append((frame, frame.f_lineno))
                    if frame.f_code is code:
                        self.chains[path] = chain
                        return None
                frame = frame.f_back
            return None
        return hook

    def _post(self, path):
        def hook(mod, args, out):
            t = out if isinstance(out, torch.Tensor) else \
                out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else None
            if t is not None and path in self.chains and path not in self.lines:
                self.outputs[id(t)] = (path, t)
            return None
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.outputs:
            try:
                self._taken(args, kwargs)
            except Exception:  # noqa: BLE001 - the line is a help, never breaks the forward
                pass
        return func(*args, **kwargs)

    def _taken(self, args, kwargs) -> None:
        for a in op_tensors(args, kwargs):
            got = self.outputs.get(id(a))
            if got is None or got[1] is not a:
                continue
            caller = sys._getframe(2)
            if user_frame(caller) is None:
                continue                          # tndebug's own op (a hook's copy)
            path = got[0]
            del self.outputs[id(a)]
            chain = self.chains.pop(path, [])
            live = set()
            frame = caller
            while frame is not None:
                live.add(id(frame))
                frame = frame.f_back
            frame, line = next(((f, n) for f, n in chain if id(f) in live), chain[-1] if chain else (None, 0))
            if frame is not None:
                code = frame.f_code
                self.lines[path] = location(code.co_filename, line,
                                            getattr(code, "co_qualname", code.co_name),
                                            frame_kind(code.co_filename))
