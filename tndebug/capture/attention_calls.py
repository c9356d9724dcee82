"""Inside one attention call: what the recording has seen of it so far (`AttnCall`: q, k, the
scores, the probabilities, ...) and the events of the patched torch primitives that fill it
(`AttentionEvents`, mixed into `recording.State`), with the user's lines that made each part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field

import torch

from tndebug.capture.kv_heads import kv_swapped
from tndebug.capture.projections import masked_by_addition
from tndebug.capture.source import user_line

MAX_RECOMPUTED = 1 << 25     # score entries recomputed for a fused SDPA call (128 MiB in fp32)


@dataclass
class AttnCall:
    path: str
    query: torch.Tensor | None
    key: torch.Tensor | None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    raw: torch.Tensor | None = None           # q k^T before any scale
    scores: torch.Tensor | None = None
    masked_scores: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    z: torch.Tensor | None = None
    softmaxed: bool = False
    scaled: bool = False                      # the temperature was applied in this call
    add_pre: torch.Tensor | None = None       # the scores before the first addition (bias, mask)
    add_terms: list = field(default_factory=list)   # what was added to them, in order
    chain_out: torch.Tensor | None = None     # the result of the last such addition
    nested: bool = False                      # an attention module inside this one was recorded
    linears: list = field(default_factory=list)     # (input, output) of every linear map run
    extra: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)     # op role -> the user's line (capture/source.py)


class AttentionEvents:
    """The attention half of a recording's state (mixed into `recording.State`): the patched
    primitives report each product, addition, mask, softmax and SDPA call here, and the current
    call (`calls[-1]`) keeps what it saw."""

    def current(self) -> AttnCall | None:
        """The attention module whose insides are being recorded (or scaled), if any."""
        if self.busy or not self.calls or not (self.intercept or self.alpha is not None
                                               or self.kv_swap):
            return None
        return self.calls[-1]

    def swap_kv(self, x):
        """`kv_heads.kv_swapped(x)`, the order it found kept in `kv_orders`."""
        self.busy = True
        try:
            out, order = kv_swapped(x)
        finally:
            self.busy = False
        if order:
            self.kv_orders.append(order)
        return out

    def on_product(self, a, b, out, b_is_kT: bool = True) -> None:
        call = self.current()
        if call is None or not isinstance(out, torch.Tensor) or out.dim() < 3:
            return
        if isinstance(b, torch.Tensor) and b.dim() == 2:     # x @ W: a projection, not q k^T
            if self.trace is not None:
                call.linears.append((a.detach(), out.detach(), b))
            return
        if not call.softmaxed and call.raw is None:
            call.q, call.k, call.raw = a, (b.transpose(-2, -1) if b_is_kT else b), out
            self.locate(call, "scores")
            self.made_line(call, "q_made", a)
        elif call.softmaxed and call.z is None:
            call.v, call.z = b, out

    def on_add(self, a, b, out) -> None:
        """`scores + mask` / `scores + bias`: remember what was added to the scores."""
        call = self.current()
        if call is None or call.raw is None or call.softmaxed or call.masked_scores is not None:
            return
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 3:
            return
        if call.chain_out is not None and (a is call.chain_out or b is call.chain_out):
            term = b if a is call.chain_out else a
        else:                                    # a new chain: the full-shape operand is the scores
            if isinstance(a, torch.Tensor) and a.shape == out.shape:
                chain, term = a, b
            elif isinstance(b, torch.Tensor) and b.shape == out.shape:
                chain, term = b, a
            else:
                return
            call.add_pre, call.add_terms = chain.detach(), []
        call.add_terms.append(term)
        call.chain_out = out
        self.locate(call, "add")
        if self.origins is not None:             # each term's line: the mask's, if one masks
            call.extra.setdefault("add_lines", []).append((term, user_line()))

    def on_linear(self, x, out, weight=None) -> None:
        if self.trace is None or self.busy or not self.calls or not self.intercept:
            return
        if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
            self.calls[-1].linears.append((x.detach(), out.detach(), weight))
            if self.calls[-1].softmaxed:          # the output projection's input: heads merged
                self.made_line(self.calls[-1], "merged", x, last=True)

    def on_masked_fill(self, x, mask, out) -> None:
        call = self.current()
        if call is None:
            return
        if not call.softmaxed:
            if call.raw is not None and call.masked_scores is None and x.is_floating_point() \
                    and x.shape == call.raw.shape:   # not the fill that builds an additive mask
                call.scores, call.masked_scores = x, out
                self.locate(call, "mask")
                self.mask_built(call, mask)
        elif call.z is None:                  # a mask applied to the probabilities
            call.probs = out
            self.locate(call, "mask")
            self.mask_built(call, mask)

    def softmax_input(self, x):
        call = self.current()
        if call is None or call.softmaxed:
            return x
        if self.alpha is not None and not call.scaled:
            call.scaled = True
            return x * self.alpha
        return x

    def on_softmax(self, x, out) -> None:
        call = self.current()
        if call is None or call.softmaxed:
            return
        call.softmaxed = True
        call.probs = out
        self.locate(call, "softmax")
        if self.origins is not None:
            self._mask_lines(call, x)
        if call.masked_scores is None and call.chain_out is not None and x is call.chain_out:
            # the mask (and any position bias) was added to the scores: the mask is the part of
            # the added terms that removes keys; the rest (a bias) stays in the scores
            self.busy = True
            try:
                added = sum(t.detach() if isinstance(t, torch.Tensor) else t for t in call.add_terms)
                removed = masked_by_addition(added, x.shape)
                call.scores = x.where(~removed, call.add_pre) if removed is not None else x
                call.masked_scores = x
            finally:
                self.busy = False
        elif call.masked_scores is None:
            call.scores = call.masked_scores = x
        elif x is not call.masked_scores and x.shape == call.masked_scores.shape:
            # scaled (or otherwise changed) after the mask: keep what the softmax saw
            self.busy = True
            try:
                keep = (call.masked_scores == call.scores) & (call.masked_scores != 0)
                ratio = (x.detach() / call.masked_scores.detach())[keep]
                r = ratio.median() if ratio.numel() else 1.0
                call.scores, call.masked_scores = call.scores * r, x
            finally:
                self.busy = False

    def on_sdpa(self, q, k, v, attn_mask, is_causal, scale, out) -> None:
        call = self.current() if self.calls else None
        if self.trace is None:
            return
        if call is None or call.raw is not None:
            return
        self.locate(call, "sdpa")
        if attn_mask is not None:
            self.mask_built(call, attn_mask)
        elif not is_causal:
            self.mask_none(call)
        if q.shape[:-1].numel() * k.shape[-2] > MAX_RECOMPUTED:   # too big to materialise: q, k, v, z only
            call.q, call.k, call.v, call.z, call.softmaxed = q.detach(), k.detach(), v.detach(), out.detach(), True
            return
        self.busy = True
        try:
            s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            qd, kd = q.detach(), k.detach()
            if kd.shape[-3] != qd.shape[-3] and qd.dim() == 4:       # grouped-query attention
                kd = kd.repeat_interleave(qd.shape[-3] // kd.shape[-3], dim=-3)
            raw = qd @ kd.transpose(-2, -1)                            # [B, h, T, S]
            scores = raw * s
            masked = scores
            if is_causal:
                T, S = scores.shape[-2:]
                keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
                masked = masked.masked_fill(~keep, float("-inf"))
            if attn_mask is not None:
                m = attn_mask.detach()
                if m.dtype == torch.bool:
                    masked = masked.masked_fill(~m, float("-inf"))
                else:       # a float mask may carry a bias too: only what removes keys is mask
                    removed = masked_by_addition(m, masked.shape)
                    masked = masked + m
                    scores = masked if removed is None else masked.where(~removed, scores)
            call.q, call.k, call.v, call.raw = qd, kd, v.detach(), raw
            call.scores, call.masked_scores = scores, masked
            call.probs, call.z, call.softmaxed = masked.softmax(-1), out.detach(), True
        finally:
            self.busy = False

    def locate(self, call: AttnCall, role: str) -> None:
        """Remember the user's line that made `role` of `call` (the first such op)."""
        if self.trace is not None and role not in call.sources:
            loc = user_line()
            if loc is not None:
                call.sources[role] = loc

    def made_line(self, call: AttnCall, role: str, x, last: bool = False) -> None:
        """sources[role] := the user's line that made `x` (origins.py), when known; with
        `last`, the latest such tensor's."""
        if self.origins is not None and (last or role not in call.sources):
            loc = self.origins.line(x)
            if loc is not None:
                call.sources[role] = loc

    def _mask_lines(self, call: AttnCall, x) -> None:
        """At the softmax: the added term that removes keys (not a position bias) is the mask:
        sources["mask_add"] its line, "mask_built" where it was built; with no mask seen, the
        line that made the softmax's input ("softmax_in": scores masked by an op not followed)
        or the call that passed None for the mask ("mask_none")."""
        if call.masked_scores is None and call.chain_out is not None and x is call.chain_out:
            self.busy = True
            try:
                hit = next(((t, loc) for t, loc in call.extra.get("add_lines", ())
                            if masked_by_addition(t, x.shape) is not None), None)
            finally:
                self.busy = False
            if hit is not None:
                if hit[1] is not None:
                    call.sources.setdefault("mask_add", hit[1])
                self.mask_built(call, hit[0])
        if not {"mask", "mask_add"} & set(call.sources):
            self.made_line(call, "softmax_in", x)
            if "softmax_in" not in call.sources or call.sources["softmax_in"] == call.sources.get("scores"):
                self.mask_none(call)

    def mask_built(self, call: AttnCall, mask) -> None:
        """sources["mask_built"] := where the mask applied in `call` was built (origins.py)."""
        if self.origins is not None and "mask_built" not in call.sources \
                and isinstance(mask, torch.Tensor):
            loc = self.origins.mask_origin(mask, call)
            if loc is not None:
                call.sources["mask_built"] = loc

    def mask_none(self, call: AttnCall) -> None:
        """sources["mask_none"] := the call that passed None for this attention's mask."""
        if self.origins is not None and "mask_none" not in call.sources:
            loc = self.origins.none_passed()
            if loc is not None:
                call.sources["mask_none"] = loc
