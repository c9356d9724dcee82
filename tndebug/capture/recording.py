"""What one recording has seen so far: the module hooks that follow the model's forward, the
attention calls in flight and the records they become, and the end of a recording. The attention
half is `attention_calls.AttentionEvents` (the patched primitives' events) and
`attention_sites.AttentionSites` (a finished call as a site); the stream half is `streams.Streams`.
"""
from __future__ import annotations

import torch

from tndebug.capture.attention_calls import AttentionEvents, AttnCall
from tndebug.capture.attention_sites import AttentionSites
from tndebug.capture.source import remember_made
from tndebug.capture.streams import Streams
from tndebug.capture.structure import owner_layer
from tndebug.capture.trace import AttentionRecord, HeadReached, StacksEntered, StreamPoint, Trace


def in_backward() -> bool:
    """Whether autograd's engine is running (a backward pass): a module called then is
    activation checkpointing re-running a forward the recording has already seen; recording it
    again would make every site of the checkpointed blocks a second one (`attn#1`)."""
    return torch._C._current_graph_task_id() != -1


class _Layout:
    """Batch-first or sequence-first, as far as the recording has seen (no model reference)."""

    def __init__(self, seq_first: bool | None, mha_seq_first: bool) -> None:
        self.seq_first, self.mha_seq_first = seq_first, mha_seq_first

    def bt(self, x: torch.Tensor) -> torch.Tensor:
        """[T, B, d] -> [B, T, d] for sequence-first models."""
        seq_first = self.seq_first if self.seq_first is not None else self.mha_seq_first
        return x.transpose(0, 1) if seq_first and x.dim() == 3 else x


class State(AttentionEvents, AttentionSites, Streams):
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
        self.calls: list[AttnCall] = []       # attention modules currently running
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
        self.last_add = self.normed = None      # post-norm streams (streams.Streams)
        self.post_norm_stacks: set[str] = set()
        self.norm_outs: list = []               # the last normalisation outputs, with (weight, bias)
        self.stream_norm: dict[int, tuple] = {}   # stream index -> its norm's (weight, bias)
        self.records: list[tuple[AttnCall, AttentionRecord]] = []
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
                self.calls.append(AttnCall(name, _t(query), _t(key)))
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
                        if self.finish_attention(call, module, output):
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
                owner = owner_layer(name, cap.layers)
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
        projection (`same_map`)."""
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

    def wants(self, read: str) -> bool:
        return read in self.reads or "all" in self.reads

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
            remember_made(self.cap.model, t.made)


def _t(x):
    return x if isinstance(x, torch.Tensor) else None
