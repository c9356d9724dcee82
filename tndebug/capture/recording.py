"""What one recording has seen so far: the attention calls in flight, the tensors of each (q, k,
scores, probabilities, ...) and the records they become; the stream half is `streams._Streams`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field

import torch

from tndebug.capture.kv_heads import kv_swapped
from tndebug.capture.trace import AttentionRecord, HeadReached, StacksEntered, StreamPoint, Trace
from tndebug.capture.projections import _find_projection, _looks_like_probs, _same, _same_map, masked_by_addition
from tndebug.capture.streams import _Streams
from tndebug.capture.structure import _CROSS_NAME, _layer_index, _owner_layer, _stack_of
MAX_RECOMPUTED = 1 << 25     # score entries recomputed for a fused SDPA call (128 MiB in fp32)


def in_backward() -> bool:
    """Whether autograd's engine is running (a backward pass): a module called then is
    activation checkpointing re-running a forward the recording has already seen; recording it
    again would make every site of the checkpointed blocks a second one (`attn#1`)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _AttnCall:
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


class _Layout:
    """Batch-first or sequence-first, as far as the recording has seen (no model reference)."""

    def __init__(self, seq_first: bool | None, mha_seq_first: bool) -> None:
        self.seq_first, self.mha_seq_first = seq_first, mha_seq_first

    def bt(self, x: torch.Tensor) -> torch.Tensor:
        """[T, B, d] -> [B, T, d] for sequence-first models."""
        seq_first = self.seq_first if self.seq_first is not None else self.mha_seq_first
        return x.transpose(0, 1) if seq_first and x.dim() == 3 else x


class _State(_Streams):
    """What one recording has seen so far."""

    def __init__(self, cap, trace: Trace | None, reads: frozenset) -> None:
        """`cap`: the `generic.GenericCapture` that records (its modules, stacks and wrappers)."""
        self.cap, self.trace, self.reads = cap, trace, reads
        # every module's output, in order (NaN provenance, head-split fit): only for readers of
        # the stream; holding them all costs ~1 GB per 64x32 batch on a 512-wide model
        self.keep_order = bool(reads & {"stream", "all", "attn.out"})
        # attention modules are followed only for readers of attention, and their insides (the
        # patched matmul/softmax/SDPA, which may recompute the scores) only for readers of them
        self.follow_attention = "all" in reads or any(r.startswith("attn.") for r in reads)
        self.intercept = "all" in reads or any(r.startswith("attn.") and r != "attn.out" for r in reads)
        self.alpha: float | None = None
        self.kv_swap = False                   # swapping_kv: grouped-query heads in the other order
        self.kv_orders: list[str] = []          # the orders swapped, one per operand
        self.calls: list[_AttnCall] = []       # attention modules currently running
        self.calls_seen = 0                     # attention calls this recording entered
        self.busy = False                      # inside our own tensor work: no interception
        self.layout = _Layout(cap.seq_first_hint, cap.mha_seq_first)
        self.tok: dict[str, torch.Tensor] = {}        # "src"/"tgt" -> token part (raw layout)
        self.tok_site: dict[str, str] = {}
        self.pos_calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []   # (path, in, out)
        self.stack_in: dict[str, torch.Tensor] = {}   # "encoder"/"decoder" -> input (raw layout)
        self.until_stacks = False               # raise StacksEntered once every stack is entered
        self.stop_before: str | None = None     # raise HeadReached as this module is called
        self.streams: list[tuple[str, str, int | None, str, torch.Tensor]] = []
        self.last_add = self.normed = None      # post-norm streams (streams._Streams)
        self.post_norm_stacks: set[str] = set()
        self.norm_outs: list = []               # the last normalisation outputs, with (weight, bias)
        self.stream_norm: dict[int, tuple] = {}   # stream index -> its norm's (weight, bias)
        self.records: list[tuple[_AttnCall, AttentionRecord]] = []
        self.seen_sites: dict[str, int] = {}
        self.depth: dict[str, int] = {}         # stack -> calls of its repeated blocks so far
        self.block_call: dict[str, tuple[int, str]] = {}   # repeated block -> (layer, stream name)
        self.block_seen: dict[str, int] = {}    # repeated block -> its calls so far
        self.origins = None                     # origins.Origins: the lines that made tensors

    def _all_entered(self) -> bool:
        """Every stack the capture found (a named stack module, or numbered blocks) has an input."""
        known = set(self.cap.stacks.values()) | {stack for stack, _ in self.cap.layers.values()}
        return bool(known) and known <= set(self.stack_in)

    # -- module hooks ------------------------------------------------------------------------
    def pre_hook(self, name: str):
        cap = self.cap

        def hook(module, args, kwargs):
            if in_backward():            # activation checkpointing's recompute: seen once already
                return None
            if self.origins is not None and name == "":
                self.origins.open()              # the model's forward begins
            if name == self.stop_before:
                raise HeadReached
            if name in cap.attention and (self.follow_attention or self.alpha is not None
                                          or self.kv_swap):
                query = args[0] if args else kwargs.get("query", kwargs.get("x"))
                key = args[1] if len(args) > 1 else kwargs.get("key")
                self.calls.append(_AttnCall(name, _t(query), _t(key)))
                self.calls_seen += 1
            if name in cap.repeated:              # one more application along depth
                self._block_called(name)
            if self.trace is None:
                return None
            stack = cap.stacks.get(name)
            if stack is None and name in cap.layers and cap.layers[name][1] == 0:
                stack = cap.layers[name][0]            # a ModuleList of layers is never called
            if stack is not None and stack not in self.stack_in:     # what enters the stack
                x = args[0] if args else next(iter(kwargs.values()), None)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    self.stack_in[stack] = x.detach()
                    if self.until_stacks and self._all_entered():
                        raise StacksEntered
            if name in cap.sublayers:
                self._add_called(args, kwargs)
            if name in cap.ffn_out and args and isinstance(args[0], torch.Tensor):
                self.trace.ffn_hidden[cap.ffn_out[name]] = args[0].detach()
            return None
        return hook

    def post_hook(self, name: str):
        cap = self.cap

        def hook(module, args, kwargs, output):
            if in_backward():
                return None
            if self.origins is not None and name == "":
                self.origins.close()             # the model's forward is over
            if name in cap.attention and self.calls and self.calls[-1].path == name:
                call = self.calls.pop()
                if self.trace is not None:
                    self.busy = True
                    try:
                        if self._finish_attention(call, module, output):
                            for outer in self.calls:       # wrappers around a site are not sites
                                outer.nested = True
                    finally:
                        self.busy = False
            if self.trace is None:
                return None
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(out, torch.Tensor):
                return None
            x = out.detach()
            if self.origins is not None and name not in self.trace.made and (
                    name in cap.layers or name in cap.sublayers or name in cap.stacks
                    or name in cap.positional):     # a stream point's op: the residual add
                made = self.origins.line(out)
                if made is not None:
                    self.trace.made[name] = made
            if self.keep_order:
                self.trace.order.append((name, x))
            if name in cap.tok_wrappers:
                self._token_embedding(name, args, kwargs, x)
            if name in cap.positional and args and isinstance(args[0], torch.Tensor) \
                    and args[0].is_floating_point() and args[0].shape == x.shape:
                self.pos_calls.append((name, args[0].detach(), x))
            if name in cap.norms:
                inside = bool(self.calls) and name.startswith(self.calls[-1].path + ".")
                if inside and self.intercept:
                    self._norm_in_attention(args, kwargs, out)
                # the stream's norms, as before QK-norms were hooked for the maps alone
                if not inside or self.keep_order or self.reads & {"grad.stream", "all"}:
                    self._norm_output(module, out)
                    if args and self.last_add is not None:
                        self._norm_called(args[0], out)
            if name in cap.layers:
                stack, i = cap.layers[name]
                i, shown = self.block_call.get(name, (i, name))
                self._stream(shown, stack, i, "layer", out)
            elif name in cap.sublayers:
                owner = _owner_layer(name, cap.layers)
                stack, i = cap.layers[owner]
                i, shown = self.block_call.get(owner, (i, owner))
                self._stream(name + shown[len(owner):], stack, i, "sublayer", out)
            elif name in cap.stacks:
                self._stream(name, cap.stacks[name], None, "stack", out)
            return None
        return hook

    def _block_called(self, name: str) -> None:
        """A repeated block is entered: its layer is the count of such calls in its stack so far,
        its stream point `name`, then `name#1`, ... (as attention sites called again)."""
        stack = self.cap.layers[name][0]
        i = self.depth.get(stack, 0)
        self.depth[stack] = i + 1
        n = self.block_seen.get(name, 0)
        self.block_seen[name] = n + 1
        self.block_call[name] = (i, f"{name}#{n}" if n else name)

    def _norm_in_attention(self, args, kwargs, out: torch.Tensor) -> None:
        """A normalisation inside an attention module of a projection's output (QK-norm: Qwen3,
        OLMo-2, Gemma-3 normalise q and k, per head or across heads, before RoPE and the
        product): its output joins the call's maps, so that q and k at the product are traced
        to it and the fitted scale is the one between the norm and the softmax, as the model's
        code applies it. Only a norm whose input is (a view of) a map's output already run in
        this call; the map's input stays the entry's input (what q and k were fed, which
        tells self- from cross-attention). No weight: a norm's output never counts as a shared
        projection (`_same_map`)."""
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(x, torch.Tensor) or x.shape != out.shape or out.dim() not in (3, 4):
            return
        call = self.calls[-1]
        ptr = x.untyped_storage().data_ptr()
        fed = next((i for i, o, _ in reversed(call.linears)
                    if o.untyped_storage().data_ptr() == ptr), None)
        if fed is None:
            return
        rows = out.detach()
        if rows.dim() == 4:                     # per head: [B, T, h, d] or [B, h, T, d]
            if fed.dim() != 3:                  # the map's input: [B, T, d_in]
                return
            if rows.shape[:2] == fed.shape[:2]:
                rows = rows.flatten(-2)
            elif rows.shape[0] == fed.shape[0] and rows.shape[2] == fed.shape[1]:
                rows = rows.transpose(1, 2).flatten(-2)
            else:
                return
        call.linears.append((fed, rows, None))

    # -- attention events ----------------------------------------------------------------------
    def current(self) -> _AttnCall | None:
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
            from tndebug.capture.source import user_line
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

    def _finish_attention(self, call: _AttnCall, module, output) -> bool:
        """Record `call` as an attention site; False when it is only a wrapper around one (the
        softmax or SDPA call happened in an attention module inside it, or nowhere)."""
        t = self.trace
        if call.raw is None and not call.softmaxed:
            weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
            if call.nested or not _looks_like_probs(weights):
                return False
        self._link_projections(call)
        kind, layer = self._classify(call)
        site = call.path
        n = self.seen_sites.get(site, 0)
        self.seen_sites[site] = n + 1
        if n:
            site = f"{site}#{n}"
        rec = AttentionRecord(site, kind, layer)
        layout = call.extra.get("layout") or {}          # an einsum in another axis order
        for f in ("q", "k", "v", "scores", "masked_scores", "probs", "z"):
            val = getattr(call, f)
            if isinstance(val, torch.Tensor) and self.wants(f"attn.{f}"):   # as the taps do
                perm = layout.get(f)
                setattr(rec, f, val.detach().permute(perm) if perm and len(perm) == val.dim()
                        else val.detach())
        rec.qk_source = call.extra.get("qk_source", "operands")
        rec.shared_projection = bool(call.extra.get("shared_projection", False))
        rec.qk_match = call.extra.get("qk_match", "values")
        rec.sources = dict(call.sources) or _forward_source(module)
        out = output[0] if isinstance(output, (tuple, list)) else output
        rec.out = out.detach() if isinstance(out, torch.Tensor) and self.wants("attn.out") else None
        if rec.probs is None and isinstance(output, (tuple, list)) and len(output) > 1 \
                and isinstance(output[1], torch.Tensor) and self.wants("attn.probs"):
            w = output[1].detach()
            rec.probs, rec.head_averaged = (w, True) if w.dim() == 3 else (w, False)
        self.records.append((call, rec))
        t.attention[site] = rec
        return True

    def _link_projections(self, call: _AttnCall) -> None:
        """Trace q and k at the product back to the linear maps that made them.

        The scale that matters is the one between the projections' outputs and the softmax
        input; a model may fold it into q or k before the product (`q * self.scaling`,
        `(q / temperature) @ k.T`, nn.MultiheadAttention's `q_scaled`). An operand that is a
        rearrangement of s * (a chunk of a linear map's output) is divided by s, so that q and k
        are recorded as projected and the fitted scale is the whole scale applied. An operand
        rotated per vector after the projection (RoPE) is matched by its vectors' norms
        (`_norm_projection`) and divided by s the same way: q.k keeps its size under the
        rotation, so the fit still sees the whole scale.
        """
        if call.q is None or call.k is None:
            return
        pool = call.linears + [lin for outer in reversed(self.calls) for lin in outer.linears]
        found = []
        hints = self.cap.projection_hints
        for role, operand in (("q", call.q), ("k", call.k)):
            hit = _find_projection(operand, pool, hints.get((call.path, role)), q_shape=call.q.shape)
            if hit is None:
                return
            hints[(call.path, role)] = hit[3]
            found.append(hit)
        (sq, q_in, q_map, q_at), (sk, k_in, k_map, k_at) = found
        call.q, call.k = call.q / sq, call.k / sk
        call.extra.update(qk_source="projection", shared_projection=_same_map(q_map, k_map),
                          kv_from_other_input=not _same(q_in, k_in),
                          qk_match=next((m for m in ("norms", "position0") if m in (q_at[-1], k_at[-1])),
                                        "values"),
                          kv_order=k_at[-2])        # grouped-query k: "interleaved" | "tiled" | ""

    def locate(self, call: _AttnCall, role: str) -> None:
        """Remember the user's line that made `role` of `call` (the first such op)."""
        if self.trace is not None and role not in call.sources:
            from tndebug.capture.source import user_line
            loc = user_line()
            if loc is not None:
                call.sources[role] = loc

    def made_line(self, call: _AttnCall, role: str, x, last: bool = False) -> None:
        """sources[role] := the user's line that made `x` (origins.py), when known; with
        `last`, the latest such tensor's."""
        if self.origins is not None and (last or role not in call.sources):
            loc = self.origins.line(x)
            if loc is not None:
                call.sources[role] = loc

    def _mask_lines(self, call: _AttnCall, x) -> None:
        """At the softmax: the added term that removes keys (not a position bias) is the mask:
        sources["mask_add"] its line, "mask_built" where it was built; with no mask seen, the
        line that made the softmax's input ("softmax_in": scores masked by an op not followed)
        or the call that passed None for the mask ("mask_none")."""
        from tndebug.capture.projections import masked_by_addition
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

    def mask_built(self, call: _AttnCall, mask) -> None:
        """sources["mask_built"] := where the mask applied in `call` was built (origins.py)."""
        if self.origins is not None and "mask_built" not in call.sources \
                and isinstance(mask, torch.Tensor):
            loc = self.origins.mask_origin(mask, call)
            if loc is not None:
                call.sources["mask_built"] = loc

    def mask_none(self, call: _AttnCall) -> None:
        """sources["mask_none"] := the call that passed None for this attention's mask."""
        if self.origins is not None and "mask_none" not in call.sources:
            loc = self.origins.none_passed()
            if loc is not None:
                call.sources["mask_none"] = loc

    def wants(self, read: str) -> bool:
        return read in self.reads or "all" in self.reads

    def _classify(self, call: _AttnCall) -> tuple[str, int | None]:
        layer = _layer_index(call.path)
        owner = _owner_layer(call.path, self.cap.layers) if self.block_call else None
        if owner in self.block_call:                 # inside a repeated block: its call's layer
            layer = self.block_call[owner][0]
        q, k = call.query, call.key
        comparable = (q is not None and k is not None and q.is_floating_point()
                      and k.is_floating_point() and k.dim() == q.dim() and k.shape[-1] == q.shape[-1])
        differ = comparable and k is not q and (k.shape != q.shape or not torch.equal(k, q))
        if "kv_from_other_input" in call.extra:      # behaviour: what the key projection was fed
            if call.extra["kv_from_other_input"]:
                return "cross", layer
        elif differ or _CROSS_NAME.search(call.path.rpartition(".")[2]):
            return "cross", layer
        stack = _stack_of(call.path)
        if stack == "decoder":
            return "dec_self", layer
        if stack == "encoder":
            return "enc_self", layer
        t = self.trace
        perm = (call.extra.get("layout") or {}).get("q")         # an einsum's axis order
        q_len = None if call.q is None else call.q.shape[perm[2] if perm else -2]
        if call.q is not None and t.tgt is not None and t.src is not None \
                and t.tgt.shape[1] != t.src.shape[1] and q_len == t.tgt.shape[1]:
            return "dec_self", layer
        return "enc_self", layer

    # -- the end ----------------------------------------------------------------------------------
    def _bt(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.bt(x)

    def _heads(self, x: torch.Tensor | None, B: int | None) -> torch.Tensor | None:
        """[B*h, T, S] -> [B, h, T, S] (nn.MultiheadAttention's bmm path); [B, T, S] of a
        one-head module (a `Head` of its own) -> [B, 1, T, S]."""
        if x is None or B is None or x.dim() != 3 or x.shape[0] % B:
            return x
        if x.shape[0] == B:
            return x.unsqueeze(1)
        return x.reshape(B, x.shape[0] // B, *x.shape[1:])

    def release(self) -> None:
        """Drop every tensor the recording held. The gradient hooks on stream tensors keep this
        object alive until backward; holding graph tensors (q, k, scores) here would make a
        cycle through autograd that Python's collector cannot see (1.5 GB per base run)."""
        self.calls, self.records, self.pos_calls, self.streams = [], [], [], []
        self.tok, self.tok_site, self.stack_in = {}, {}, {}
        self.last_add = self.normed = None
        self.norm_outs, self.stream_norm = [], {}
        if self.origins is not None:
            self.origins.made = {}

    def finalise(self) -> None:
        t = self.trace
        if t is None:
            return
        B = t.src.shape[0] if t.src is not None else None
        for call, rec in self.records:
            for f in ("q", "k", "v", "scores", "masked_scores", "probs", "z"):
                if not (f == "probs" and rec.head_averaged):
                    setattr(rec, f, self._heads(getattr(rec, f), B))
            if rec.out is not None:
                rec.out = self._bt(rec.out)
            if rec.head_averaged and rec.probs is not None and rec.probs.dim() == 3:
                rec.probs = rec.probs
        t.order = [(n, self._bt(x) if x.dim() == 3 and x.is_floating_point() else x) for n, x in t.order]
        self._renorm_ends()
        for i, (name, stack, layer, kind, x) in enumerate(self.streams):
            t.streams.append(StreamPoint(name, stack, layer, kind, self._bt(x), norm=self.stream_norm.get(i)))
        for name, x in list(t.ffn_hidden.items()):
            t.ffn_hidden[name] = self._bt(x)
        if self.reads & {"embed", "stream", "grad.stream", "all"}:
            for role, stack in (("src", "encoder"), ("tgt", "decoder")):
                self._embedding_parts(role, stack)
        if t.made:
            from tndebug.capture.source import remember_made
            remember_made(self.cap.model, t.made)


def _forward_source(module) -> dict:
    """{"forward": the module's forward def}, where no op's line was seen."""
    from tndebug.capture.source import forward_def
    loc = forward_def(module)
    return {"forward": loc} if loc else {}


def _t(x):
    return x if isinstance(x, torch.Tensor) else None
