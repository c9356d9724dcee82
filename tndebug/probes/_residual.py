"""What the residual of an attention sublayer carries: its input, or its input normalised.

A Pre-LN sublayer computes x + f(norm(x)); the bug `x = norm(x); x = x + f(x)` computes
norm(x) + f(norm(x)): the skip path carries the normalised stream, so nothing reaches the next
block unnormalised and the identity path of Pre-LN is gone. From one trace (eval mode) with the
residual stream at every sublayer output and the attention module's output (`attn.out`, after
W_O), for each attention sublayer with its input `x` (the stream point before it) and output `y`:

    d = y - attn_out          # what the residual added the sublayer's output to
    d == x                    # the residual carries the input (Pre-LN, rel < CARRY_TOL)
    d == g * norm(x) + b      # ... the input normalised: LayerNorm (centred) or RMSNorm, per-
                              # feature g, b fitted by least squares over the real tokens
                              # (relative residual < NORM_TOL)

Post-LN (y = norm(x + f(x))) fits neither and is not judged here (ln-placement names it).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tndebug.probes import _depth_stats as ds
from tndebug.capture.trace import Trace

# Both identities are exact up to float32 rounding (relative ~1e-7 on a d=32..512 stream; the
# norm's eps of 1e-5..1e-6 against a unit variance moves z by ~1e-6 relative): 1e-4 leaves two
# orders of margin, and a residual that carries anything else misses both by O(1).
CARRY_TOL = 1e-4
NORM_TOL = 1e-4
_KINDS = {"encoder": ("enc_self",), "decoder": ("dec_self", "cross")}
# y - attn_out this small against y is no residual term at all: the attention record's output is
# the sublayer's output itself (seen on bugs that make the capture place the site at the
# residual wrapper, bench/realbugs.py's softmax_dim0 / scale_after_softmax: |d| = 0 exactly)
# Set on bench/realbugs.py's runs (8c02423): realbugs is not held out for this gate.
DEGENERATE = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _norm_fit(d: torch.Tensor, x: torch.Tensor, centred: bool) -> float:
    """Relative residual of d ≈ g ⊙ norm(x) + b (per feature g, b), over tokens [N, D]."""
    z = x - x.mean(-1, keepdim=True) if centred else x
    z = z / z.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()                 # [N, D]
    if centred:                                  # per feature: least squares on [z, 1]
        zc, dc = z - z.mean(0), d - d.mean(0)
        g = (zc * dc).sum(0) / zc.pow(2).sum(0).clamp_min(1e-30)
        fit = g * zc + d.mean(0)
    else:                                        # RMSNorm: no bias
        g = (z * d).sum(0) / z.pow(2).sum(0).clamp_min(1e-30)
        fit = g * z
    return _rel(fit, d)


def residual_carries(trace: Trace) -> list[dict]:
    """One entry per attention sublayer whose residual fits one of the identities: {"where",
    "stack", "layer", "attention", "carries": "input" | "normalised input", "rel_input",
    "rel_norm"}; sublayers that fit neither (Post-LN, FFN sublayers) are left out."""
    out = []
    for stack, points in ds.stack_groups(trace):
        recs = [r for r in trace.records() if r.kind in _KINDS.get(stack, ()) and r.out is not None]
        for prev, cur in zip(points, points[1:]):
            if cur.kind != "sublayer" or cur.layer is None or prev.x.shape != cur.x.shape:
                continue
            cands = [r for r in recs if r.layer == cur.layer and r.out.shape == cur.x.shape]
            if not cands:
                continue                          # an FFN sublayer: its output is not captured
            keep = ds.token_keep(trace, stack, cur.x)                            # [B, T]
            x = prev.x.detach().double()[keep]                                   # [N, D]
            best = None
            for r in cands:
                d = (cur.x.detach().double() - r.out.detach().double())[keep]    # [N, D]
                if not torch.isfinite(d).all() or not torch.isfinite(x).all():
                    continue
                y = cur.x.detach().double()[keep]
                if float(d.norm()) <= DEGENERATE * float(y.norm()):
                    continue              # the record's "out" is the sublayer's own output (an
                    #                       attention site found at the residual wrapper): d = 0
                    #                       fits every identity, so nothing can be judged
                rel_in = _rel(d, x)
                rel_norm = min(_norm_fit(d, x, True), _norm_fit(d, x, False))
                carries = ("input" if rel_in < CARRY_TOL else
                           "normalised input" if rel_norm < NORM_TOL else None)
                entry = {"where": ds.module_path(cur.name), "stack": stack, "layer": cur.layer,
                         "attention": r.site, "carries": carries,
                         "rel_input": rel_in, "rel_norm": rel_norm}
                if best is None or carries == "input" or (carries and best["carries"] is None):
                    best = entry
            if best is not None and best["carries"] is not None:   # an FFN or Post-LN: untested
                out.append(best)
    return out


def first_output(x):
    """A module's output tensor: the output, or the first item of a tuple/list output."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or \
        "norm" in type(module).__name__.lower()


class _Adds(TorchFunctionMode):
    """Every addition whose one operand is a watched tensor (by identity): (watched, other)."""

    OPS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
           torch.Tensor.add_, torch.Tensor.__iadd__}

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.seen = watched, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS and len(args) >= 2 and not kwargs:
            a, b = args[0], args[1]
            for mine, other in ((a, b), (b, a)):
                if isinstance(mine, torch.Tensor) and id(mine) in self.watched \
                        and isinstance(other, torch.Tensor):
                    self.seen.append((self.watched[id(mine)], other))
                    break
        return func(*args, **kwargs)


def normalised_residuals(subject, src, tgt, sites: list[str]) -> list[dict]:
    """Attention sublayers whose residual is the very tensor a norm just produced and the
    attention read: `x = norm(x); x = x + attn(x)`, seen by tensor identity in one forward.
    For code whose sublayers are no modules of their own (so the stream has no sublayer points
    for `residual_carries`). [{"where": attention site, "norm": the norm module}], [] if none."""
    modules = dict(subject.model.named_modules())
    norm_out: dict[int, str] = {}            # id(norm output) -> the norm's path
    attn_in: dict[str, int] = {}             # site -> id of its first tensor input
    attn_out: dict[int, str] = {}            # id(attention output) -> site
    held: list[torch.Tensor] = []            # every tensor whose id is kept: no id is reused
    handles = []

    def on_norm(path):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                norm_out[id(out)] = path
                held.append(out)
        return hook

    def on_attn(site):
        def pre(mod, args, kwargs):
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None and site not in attn_in:
                attn_in[site] = id(first)
                held.append(first)

        def post(mod, args, out):
            t = first_output(out)
            if t is not None:
                attn_out[id(t)] = site
                held.append(t)
        return pre, post

    for path, mod in modules.items():
        if path and _is_norm(mod):
            handles.append(mod.register_forward_hook(on_norm(path)))
    for site in sites:
        mod = modules.get(site.split("#")[0])
        if mod is not None:
            pre, post = on_attn(site)
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post))
    adds = _Adds(attn_out)
    try:
        with subject.evaluating(), adds:
            subject.logits(src, tgt)
    finally:
        for h in handles:
            h.remove()
    found = []
    for site, other in adds.seen:
        if id(other) in norm_out and attn_in.get(site) == id(other) \
                and _beside(norm_out[id(other)], site.split("#")[0]):
            found.append({"where": site, "norm": norm_out[id(other)]})
    return found


def _beside(norm: str, site: str) -> bool:
    """The norm sits in the module that holds the attention (its block, or the model itself):
    there `x = norm(x)` replaced the stream the block's residual should carry. A norm in
    another branch (ModernBERT's `embeddings.norm`, whose output starts the stream and whose
    first block reads it through an Identity) makes the stream's first value, not the bug."""
    parent = norm.rpartition(".")[0]
    return not parent or site.startswith(parent + ".")
