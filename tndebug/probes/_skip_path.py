"""Does each block's output keep its input? The residual's skip path, tested by holding the weights.

A residual block computes y = x + f(x) (pre-LN), norm(x + f(x)) (post-LN) or a scaled form
(x + a f(x), a x + f(x)); the bug `x = self.attn(self.ln_1(x))` drops the x, so what reaches the
next block is only the sublayer's output. Tensor identity cannot see it (a block with no
residual around a sublayer simply has no residual there), so it is told from behaviour:

    move every block's input by δ (as large as x, random per feature and token), in one forward,
    while every module inside the block that holds a weight matrix (a >= 2-D parameter: the
    attention and FFN projections, nn.MultiheadAttention, a position-bias table) returns
    what it returned without δ.

What still moves the block's output can only reach it on a path through no weight: the
residual adds, and the norms after them. With a residual around every sublayer the output
moves by a δ (pre-LN) or by the norms' Jacobian applied to δ (post-LN); with one missing, the
output is a function of held tensors only and does not move at all (bit-identical where the
kernels are deterministic). The figure is the block's "skip share":

    share = median over tokens t of (|Δy_t| / |y_t|) / (|δ_t| / |x_t|)

the input's share of the output that the skip carries: |x_t| / |y_t| for a plain pre-LN
residual (the input's part of a stream the sublayers add to), |x_t| / |x_t + f_t| for post-LN,
a times that for a scaled skip (x + a f(x) keeps 1, DeepNet's a x + f(x) scales it up); 0 without
a residual.
Two more forwards name the sublayer once a block fails (sequential blocks): holding only one
attention module, the output stops moving iff that attention has no residual; holding every
weight outside the attention modules, iff a sublayer after them (the FFN) has none.
A block whose output does not move with δ even with nothing held (the tensor moved is not
what it reads), or with no weight module called inside it (a fused kernel), is no verdict.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from tndebug.capture.taken_lines import TakenLines
from tndebug.probes._residual import first_output

# A skip passes each token's input at its share of the token's output, |x_t| / |y_t| (pre-LN),
# |x_t| / |x_t + f_t| (post-LN); a missing skip passes exactly 0: the block's output is computed
# from held tensors alone, bit-identical (every broken block measured: 0.0). The threshold only
# absorbs rounding where kernels are not bit-reproducible: 1e-6 is 8 ulps of float32 (eps
# 1.2e-7), and a skip below it is lost in the sum's own rounding (x + f in float32 keeps nothing
# of an x 1e7 times smaller than f). Healthy blocks gave 0.14-0.99 at init and down to 1.9e-4
# after training (GPT-2 768 wide, 100 Adam steps at 3e-3: its first attention adds 5000x the
# embedding), so a share-of-the-stream rule (1e-2 or 1e-3) would have flagged a sound model.
# The median over tokens: a few tokens whose output is huge (massive activations) do not decide.
# Calibration: tndebug's tiny model and nanoGPT at init (bench/residual_skip.py's calibration
# set); the evaluation set is reported apart (bench/results/residual_skip.md).
MIN_SHARE = 1e-6
# The block's output must move with δ when nothing is held (its median share above this): else
# the tensor moved is not the one the block reads, and a 0 with the weights held says nothing.
MOVES = 1e-2
FUSED = "no module with a weight matrix ran inside it (a fused kernel) to hold"
NO_WEIGHTS = "it holds no weight matrix (the stream point is not a whole block: a residual add alone)"


def _matrix_modules(block: str, modules: dict[str, nn.Module]) -> list[str]:
    """Modules strictly inside `block` that own a weight matrix (a >= 2-D parameter)."""
    return [p for p, m in modules.items() if p.startswith(block + ".")
            and any(w.dim() >= 2 for w in m.parameters(recurse=False))]


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


def _stream_slot(args, kwargs):
    """Where the block's stream input is: ("arg", i) or ("kw", key), for the first 3-D float
    tensor among its arguments, or None."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() == 3 and a.is_floating_point():
            return ("arg", i)
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.dim() == 3 and a.is_floating_point():
            return ("kw", k)
    return None


@dataclass
class BlockSkip:
    where: str                    # the block's module path
    call: int                     # which call of that module (a shared block is called again)
    share: float | None = None    # the skip share with every weight held (None: not measured)
    moves: float | None = None    # the share with nothing held (the block reads what moved)
    held: int = 0                 # weight modules held inside the block
    reason: str = ""              # why there is no verdict
    by_part: dict = field(default_factory=dict)   # attention site or "rest" -> share
    lines: dict = field(default_factory=dict)     # attention site -> the user's line that takes
    #                                               its output (taken_lines.TakenLines)


class _Runs:
    """Forwards of one batch with hooks on the blocks and the weight modules inside them."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        modules = dict(model.named_modules())
        self.blocks = [b for b in dict.fromkeys(blocks) if b in modules]
        self.inside = {b: _matrix_modules(b, modules) for b in self.blocks}
        self.modules = modules
        self.base_in: dict = {}       # (block, call) -> (slot, x)
        self.base_out: dict = {}      # (block, call) -> y
        self.held_out: dict = {}      # (block, call, module, n) -> output
        self.moved_out: dict = {}
        self.delta: dict = {}
        self.mode, self.hold = "base", {}
        self.stack: list = []
        self.calls: dict = {}
        self.inner: dict = {}

    def _pre(self, block):
        def hook(mod, args, kwargs):
            n = self.calls.get(block, 0)
            self.calls[block] = n + 1
            key = (block, n)
            self.stack.append(key)
            self.inner[key] = {}
            if self.mode == "base":
                slot = _stream_slot(args, kwargs)
                if slot is not None:
                    x = args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]
                    self.base_in[key] = (slot, x.detach().clone())
                return None
            got = self.base_in.get(key)
            if got is None:
                return None
            slot, x = got
            if key not in self.delta:                  # each token moved by its own size
                g = torch.Generator().manual_seed(20260 + len(self.delta))   # any seed: exact test
                rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().cpu()    # [..., 1]
                self.delta[key] = (torch.randn(x.shape, generator=g) * rms).to(x.device, x.dtype)
            moved = x + self.delta[key]
            args = list(args)
            if slot[0] == "arg":
                args[slot[1]] = moved
            else:
                kwargs = {**kwargs, slot[1]: moved}
            return tuple(args), kwargs
        return hook

    def _post(self, block):
        def hook(mod, args, out):
            key = self.stack.pop() if self.stack else None
            y = first_output(out)
            if key is not None and y is not None:
                (self.base_out if self.mode == "base" else self.moved_out)[key] = y.detach().clone()
        return hook

    def _inner(self, path):
        def hook(mod, args, out):
            if not self.stack:
                return None
            key = self.stack[-1]
            if path not in self.inside.get(key[0], ()):
                return None
            n = self.inner[key].get(path, 0)
            self.inner[key][path] = n + 1
            if self.mode == "base":
                self.held_out[(key, path, n)] = _clone(out)
                return None
            if path in self.hold.get(key[0], ()) and (key, path, n) in self.held_out:
                return _clone(self.held_out[(key, path, n)])
            return None
        return hook

    def run(self, forward, mode: str, hold: dict | None = None) -> dict:
        """One forward; mode "base" records, "move" moves every block's input and holds the
        modules `hold` names per block. Returns (block, call) -> output."""
        self.mode, self.hold, self.stack, self.calls = mode, hold or {}, [], {}
        self.moved_out = {}
        handles = []
        try:
            for b in self.blocks:
                m = self.modules[b]
                handles.append(m.register_forward_pre_hook(self._pre(b), with_kwargs=True))
                handles.append(m.register_forward_hook(self._post(b)))
            for p in sorted({p for ps in self.inside.values() for p in ps}):
                handles.append(self.modules[p].register_forward_hook(self._inner(p)))
            forward()
        finally:
            for h in handles:
                h.remove()
        return self.base_out if mode == "base" else self.moved_out

    def share(self, key, moved: dict) -> float | None:
        """The median over tokens of (|Δy_t| / |y_t|) / (|δ_t| / |x_t|) (None: not comparable)."""
        if key not in moved or key not in self.base_out or key not in self.delta:
            return None
        y0, y1 = self.base_out[key].double(), moved[key].double()
        x, d = self.base_in[key][1].double(), self.delta[key].double()
        if y0.shape != y1.shape or y0.shape != x.shape or \
                not (torch.isfinite(y0).all() and torch.isfinite(y1).all()):
            return None
        n = x.shape[-1]
        y0, y1, x, d = (t.reshape(-1, n) for t in (y0, y1, x, d))            # [tokens, d]
        ny, nx, nd = y0.norm(dim=-1), x.norm(dim=-1), d.norm(dim=-1)
        ok = (ny > 0) & (nx > 0) & (nd > 0)
        if not bool(ok.any()):
            return None
        shares = ((y1 - y0).norm(dim=-1)[ok] / ny[ok]) / (nd[ok] / nx[ok])
        return float(shares.median())


def block_skips(model: nn.Module, forward, blocks: list[str], sites: list[str] | None = None,
                name_parts: bool = True) -> list[BlockSkip]:
    """The skip share of every block in `blocks` (module paths), in one base, one open and one
    held forward (eval mode and no grad are the caller's); for each block below MIN_SHARE, with
    `name_parts`, which part's residual is missing: an attention site in `sites` (module
    paths) or "rest" (a sublayer outside the attention modules, the FFN); with `sites`, each
    block's `lines`: where its attentions' outputs are taken in the user's code (the base run)."""
    runs = _Runs(model, blocks)
    # with `sites`: where each attention's output is taken, the line a lost residual was lost in
    owner = {s: next((b for b in runs.blocks if s.startswith(b + ".")), None) for s in sites or ()}
    taken = TakenLines(model, {s: b for s, b in owner.items() if b is not None})
    with taken if taken.watched else nullcontext():
        runs.run(forward, "base")
    keys = list(runs.base_out)
    out = {k: BlockSkip(k[0], k[1], held=len({p for (kk, p, _) in runs.held_out if kk == k}),
                        lines={s: taken.lines[s] for s, b in owner.items() if b == k[0] and s in taken.lines})
           for k in keys}
    for k, r in out.items():
        if k not in runs.base_in:
            r.reason = "no 3-D float tensor among its inputs to move"
        elif not r.held:
            r.reason = FUSED if runs.inside[k[0]] else NO_WEIGHTS
    opened = runs.run(forward, "move")
    held = runs.run(forward, "move", runs.inside)
    for k, r in out.items():
        if r.reason:
            continue
        r.moves, r.share = runs.share(k, opened), runs.share(k, held)
        if r.moves is None or r.share is None:
            r.reason, r.share = "its output is not finite, or changed shape, when its input moved", None
        elif r.moves < MOVES:
            r.reason, r.share = (f"its output does not move with its input (share {r.moves:.1e} with "
                                 f"nothing held): the tensor moved is not what it reads"), None
    failed = [k for k, r in out.items() if r.share is not None and r.share < MIN_SHARE]
    if failed and name_parts:
        _name_parts(runs, forward, failed, out, sites or [])
    return list(out.values())


def _name_parts(runs: _Runs, forward, failed: list, out: dict, sites: list[str]) -> None:
    """Which part of each failed block lost its residual: hold one attention module at a time
    (the i-th of every failed block in one forward), then every weight outside them."""
    blocks = {k[0] for k in failed}
    own = {b: [s for s in dict.fromkeys(sites) if s.startswith(b + ".")] for b in blocks}
    for i in range(max((len(v) for v in own.values()), default=0)):
        hold = {}
        for b, ss in own.items():
            if i < len(ss):
                hold[b] = [p for p in runs.inside[b] if p == ss[i] or p.startswith(ss[i] + ".")]
        moved = runs.run(forward, "move", hold)
        for k in failed:
            if i < len(own[k[0]]):
                out[k].by_part[own[k[0]][i]] = runs.share(k, moved)
    hold = {b: [p for p in runs.inside[b]
                if not any(p == s or p.startswith(s + ".") for s in own[b])] for b in blocks}
    moved = runs.run(forward, "move", hold)
    for k in failed:
        out[k].by_part["rest"] = runs.share(k, moved)
