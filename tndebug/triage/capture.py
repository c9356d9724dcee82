"""A generic capture: fill a `Trace` from any PyTorch model, in the model's own naming.

    capture = GenericCapture(model)
    with capture.recording(("all",), trace):      # hooks and patches live only inside
        logits = forward(model, src, tgt, pad_id)

How each part of the trace is found:

* attention: inside the forward of every module whose class name contains "Attention"/"Attn"
  (and nn.MultiheadAttention), `torch.matmul`/`@`/`bmm`/`einsum`, `masked_fill` and
  `softmax` are intercepted: the first product before the softmax gives q, k and the raw
  scores, `masked_fill` gives scores and masked scores, the softmax the probabilities, the
  product after it v and the per-head outputs z. `F.scaled_dot_product_attention` never
  materialises the probabilities, so its q, k, v and mask are recorded and the scores and
  probabilities recomputed here (cheap at probe sizes). nn.MultiheadAttention goes through one
  of these two paths (its fast path is switched off while recording); if only its returned
  weights are seen they are recorded with `head_averaged=True`.
* kind: "cross" when the module's query and key inputs differ (or its name says so);
  otherwise "dec_self"/"enc_self" from the path, else from the query length.
* residual stream: outputs of `<enc|dec>*.layers.N` (layer), their Sublayer/Residual children
  (sublayer) and the stacks (`encoder`, `decoder`, `transformer.encoder`, ...).
* embeddings: `tok` is the output of the outermost module around an nn.Embedding that is fed
  the source or target ids (without a positional part inside); `out` is what enters the
  encoder or decoder stack; the PE part is `out - tok`.
* FFN hidden: the input of the second Linear of a feed-forward module (`w_2`, `linear2`, ...).

Sequence-first models (nn.Transformer's default) are detected from the ids fed to the
embedding and every [T, B, d] activation is transposed to [B, T, d].

`scaling(alpha)` multiplies every attention's pre-softmax scores by alpha (the temperature
sweep) through the same interception.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tndebug.trace import AttentionRecord, StreamPoint, Trace

_ATTN_CLASS = re.compile(r"attention|attn", re.I)
_CROSS_NAME = re.compile(r"cross|src_attn|enc_dec|encdec|multihead_attn|memory|inter_attn", re.I)
_LAYER = re.compile(r"(?:^|\.)(?P<stack>enc\w*|dec\w*)(?:[._](?:layers|layer|blocks|block|h))?\.(?P<i>\d+)$",
                    re.I)
_STACK = re.compile(r"(?:^|\.)(?P<stack>enc\w*|dec\w*)$", re.I)
_POS = re.compile(r"position|pos_?enc|pos_?emb|^w?pe$|^pos$", re.I)
_FFN = re.compile(r"feed_?forward|ffn|mlp|positionwise", re.I)
_FFN_OUT = ("w_2", "linear2", "fc2", "lin2", "w2", "out_proj", "dense_2", "c_proj")
_LAYER_INDEX = re.compile(r"(?:layers|layer|blocks|block|h)\.(\d+)")
MAX_RECOMPUTED = 1 << 25     # score entries recomputed for a fused SDPA call (128 MiB in fp32)


def is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or bool(_ATTN_CLASS.search(type(module).__name__))


def _stack_of(path: str) -> str | None:
    for part in reversed(path.split(".")):
        low = part.lower()
        if low.startswith("dec"):
            return "decoder"
        if low.startswith("enc"):
            return "encoder"
    return None


def _layer_index(path: str) -> int | None:
    m = _LAYER_INDEX.search(path)
    if m:
        return int(m.group(1))
    nums = re.findall(r"\.(\d+)(?=\.|$)", path)
    return int(nums[0]) if nums else None


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


class GenericCapture:
    """Fills a Trace from any nn.Module; module paths are the model's own.

    Args:
        model: the user's module.
        seq_first: True for [T, B, ...] activations; None detects it from the ids the
            embeddings receive (then from nn.MultiheadAttention.batch_first).
    """

    def __init__(self, model: nn.Module, *, seq_first: bool | None = None) -> None:
        self.model = model
        self.seq_first_hint = seq_first
        self.paths = {id(m): n for n, m in model.named_modules()}
        modules = dict(model.named_modules())
        self.attention = {n for n, m in modules.items() if n and is_attention(m)}
        self.layers = {n: (_stack_of(n) or "encoder", int(m.group("i")))
                       for n in modules for m in [_LAYER.search(n)] if m}
        self.stacks = {n: _stack_of(n) for n in modules if n and _STACK.search(n)
                       and any(c.startswith(n + ".") for c in self.layers)}
        self.sublayers = {n for n, m in modules.items()
                          if re.search(r"sublayer|residual", type(m).__name__, re.I)
                          and _owner_layer(n, self.layers) is not None}
        self.positional = {n for n, m in modules.items() if n and _is_positional(n, m)}
        self.tok_wrappers = self._token_embedding_modules(modules)
        self.ffn_out = self._ffn_outputs(modules)
        mhas = [m for m in modules.values() if isinstance(m, nn.MultiheadAttention)]
        self.mha_seq_first = bool(mhas) and not any(m.batch_first for m in mhas)
        self.alpha: float | None = None
        self._active = False
        # (site, "q"/"k") -> where its projection was last found (position in the pool counted
        # from the end, chunks, chunk): tried first next time, one check instead of a search
        self.projection_hints: dict[tuple[str, str], tuple[int, int, int]] = {}

    # -- static structure ------------------------------------------------------------------
    def _token_embedding_modules(self, modules: dict) -> dict[str, bool]:
        """Token-embedding wrappers: the outermost module around an nn.Embedding that holds no
        positional part -> whether its output is the token part alone (False when the PE is
        added inside the same module, so the two cannot be told apart)."""
        out = {}
        for name, m in modules.items():
            if not isinstance(m, nn.Embedding) or name in self.positional:
                continue
            best, parent = name, name.rpartition(".")[0]
            clean = True
            while parent:
                subtree = list(modules[parent].named_modules(prefix=parent))
                if any(n in self.positional for n, _ in subtree):
                    if parent in self.positional:    # the PE is added in the same module
                        best, clean = parent, False
                    break
                if (any(is_attention(x) for _, x in subtree)
                        or sum(isinstance(x, nn.Embedding) for _, x in subtree) > 1
                        or parent in self.layers or parent in self.stacks):
                    break
                best, parent = parent, parent.rpartition(".")[0]
            out[best] = clean
        return out

    def _ffn_outputs(self, modules: dict) -> dict[str, str]:
        """Second-Linear path -> the key its input (the FFN hidden) is stored under.

        From structure, not names: outside attention, a module whose own Linear children include
        an expansion d -> f and a contraction f -> d (two Linears around an activation, or three
        in a gated FFN such as T5's wi_0/wi_1/wo) is a feed-forward block; the contraction's
        input is the hidden. When f == d the two cannot be told apart by shape, and the one
        registered second is taken (every implementation we know defines w_1 before w_2).
        The usual names (`w_2`, `linear2`, `fc2`, ...) count too.
        """
        out = {}
        for owner, m in modules.items():
            if any(owner == a or owner.startswith(a + ".") for a in self.attention):
                continue
            linears = [(n, c) for n, c in m.named_children() if isinstance(c, nn.Linear)]
            for i, (n2, l2) in enumerate(linears):
                pairs = [l1 for n1, l1 in linears if l1 is not l2
                         and l1.out_features == l2.in_features and l1.in_features == l2.out_features]
                contraction = l2.in_features > l2.out_features or (
                    l2.in_features == l2.out_features and any(l1 is c for _, c in linears[:i]
                                                              for l1 in pairs))
                named = n2 in _FFN_OUT and (owner in self.layers or _FFN.search(owner.rpartition(".")[2])
                                            or _FFN.search(type(m).__name__))
                if not ((pairs and contraction) or named):
                    continue
                name = f"{owner}.{n2}" if owner else n2
                holds_attention = any(c.startswith(owner + ".") for c in self.attention) if owner else True
                block = owner and owner not in self.layers and not holds_attention
                out[name] = owner if block else name
        return out

    # -- discovery ---------------------------------------------------------------------------
    def discover(self, run) -> set[str]:
        """Run `run()` (one forward) and add, as attention modules, the innermost modules in which
        a softmax follows a product of two activations (q k^T, not x W), or an SDPA call happens,
        whatever their class is called (`Head`, `Mixer`). A softmax module (`nn.Softmax`)
        stands for its parent. Returns the modules added."""
        stack: list[str] = []
        producted: set[str] = set()              # modules that multiplied two activations
        found: set[str] = set()
        modules = dict(self.model.named_modules())

        def innermost() -> str | None:
            for name in reversed(stack):
                m = modules[name]
                if not (isinstance(m, nn.Softmax) or "softmax" in type(m).__name__.lower()):
                    return name or None
            return None

        def on_softmax(x, sdpa=False) -> None:
            name = innermost()
            if name and (sdpa or (isinstance(x, torch.Tensor) and x.dim() >= 3 and name in producted)):
                found.add(name)

        def on_product(a, b) -> None:
            name = innermost()
            if name and all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (a, b)):
                producted.add(name)

        handles = []
        for name, m in modules.items():
            handles.append(m.register_forward_pre_hook(lambda mod, a, name=name: stack.append(name)))
            handles.append(m.register_forward_hook(lambda mod, a, o: (stack.pop(), None)[1]))

        def softmax(orig):
            def wrapper(x, *args, **kwargs):
                on_softmax(x)
                return orig(x, *args, **kwargs)
            return wrapper

        def sdpa(orig):
            def wrapper(*args, **kwargs):
                on_softmax(None, sdpa=True)
                return orig(*args, **kwargs)
            return wrapper

        def product(orig):
            def wrapper(a, b, *args, **kwargs):
                on_product(a, b)
                return orig(a, b, *args, **kwargs)
            return wrapper

        def einsum(orig):
            def wrapper(eq, *ops, **kwargs):
                flat = ops[0] if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else ops
                if len(flat) == 2:
                    on_product(*flat)
                return orig(eq, *ops, **kwargs)
            return wrapper

        patches = [(F, "softmax", softmax), (torch, "softmax", softmax), (torch.Tensor, "softmax", softmax),
                   (F, "scaled_dot_product_attention", sdpa), (torch, "matmul", product),
                   (torch.Tensor, "matmul", product), (torch.Tensor, "__matmul__", product),
                   (torch, "bmm", product), (torch.Tensor, "bmm", product), (torch, "einsum", einsum)]
        originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        try:
            for (owner, attr, make), (_, _, orig) in zip(patches, originals):
                setattr(owner, attr, make(orig))
            with torch.no_grad():
                run()
        finally:
            for owner, attr, orig in reversed(originals):
                setattr(owner, attr, orig)
            for h in handles:
                h.remove()
        new = {n for n in found if n not in self.attention
               and not any(n.startswith(a + ".") for a in self.attention)}
        self.attention |= new
        if new:
            self.ffn_out = self._ffn_outputs(modules)
        return new

    # -- recording ---------------------------------------------------------------------------
    @contextmanager
    def recording(self, reads=("all",), trace: Trace | None = None):
        trace = trace if trace is not None else Trace()
        state = _State(self, trace, frozenset(reads))
        try:
            with self._installed(state, self._paths_for(state)):
                yield trace
        finally:
            state.finalise()
            state.release()

    @contextmanager
    def scaling(self, alpha: float):
        """Scale every attention's pre-softmax scores by `alpha` (nothing recorded)."""
        state = _State(self, None, frozenset())
        state.alpha = alpha
        with self._installed(state, sorted(self.attention)):
            yield

    def _paths_for(self, state: "_State") -> list[str]:
        """The modules whose hooks fill what `state.reads` asks for, in the model's order: a
        recording of FFN activations hooks the FFNs, not every Linear and LayerNorm (hooks on
        every module cost a probed step ~2 ms on a 3-layer model)."""
        reads = state.reads
        if "all" in reads or state.keep_order:          # every module's output, in order
            return [n for n, _ in self.model.named_modules()]
        paths = set(self.tok_wrappers)                  # the layout: the ids they are fed
        if state.follow_attention:
            paths |= self.attention
        if "ffn.hidden" in reads:
            paths |= set(self.ffn_out)
        if reads & {"embed", "grad.stream"}:            # what enters each stack, and from where
            paths |= self.positional | set(self.stacks)
            paths |= {n for n, (_, i) in self.layers.items() if i == 0}
        if "grad.stream" in reads:
            paths |= set(self.layers) | self.sublayers
        return [n for n, _ in self.model.named_modules() if n in paths]

    @contextmanager
    def _installed(self, state: "_State", paths: list[str]):
        """Hooks on `paths`; torch's attention primitives patched when an attention's insides
        are recorded or scaled; MHA fast path off (it runs a layer as one call, past the hooks
        inside it); all undone."""
        handles = []
        for name in paths:
            module = self.model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(state.pre_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(state.post_hook(name), with_kwargs=True))
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        patching = _patched(state) if state.intercept or state.alpha is not None \
            else nullcontext()
        try:
            with patching:
                yield
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
            for h in handles:
                h.remove()


class _Layout:
    """Batch-first or sequence-first, as far as the recording has seen (no model reference)."""

    def __init__(self, seq_first: bool | None, mha_seq_first: bool) -> None:
        self.seq_first, self.mha_seq_first = seq_first, mha_seq_first

    def bt(self, x: torch.Tensor) -> torch.Tensor:
        """[T, B, d] -> [B, T, d] for sequence-first models."""
        seq_first = self.seq_first if self.seq_first is not None else self.mha_seq_first
        return x.transpose(0, 1) if seq_first and x.dim() == 3 else x


class _State:
    """What one recording has seen so far."""

    def __init__(self, cap: GenericCapture, trace: Trace | None, reads: frozenset) -> None:
        self.cap, self.trace, self.reads = cap, trace, reads
        # every module's output, in order (NaN provenance, head-split fit): only for readers of
        # the stream; holding them all costs ~1 GB per 64x32 batch on a 512-wide model
        self.keep_order = bool(reads & {"stream", "all", "attn.out"})
        # attention modules are followed only for readers of attention, and their insides (the
        # patched matmul/softmax/SDPA, which may recompute the scores) only for readers of them
        self.follow_attention = "all" in reads or any(r.startswith("attn.") for r in reads)
        self.intercept = "all" in reads or any(r.startswith("attn.") and r != "attn.out" for r in reads)
        self.alpha: float | None = None
        self.calls: list[_AttnCall] = []       # attention modules currently running
        self.calls_seen = 0                     # attention calls this recording entered
        self.busy = False                      # inside our own tensor work: no interception
        self.layout = _Layout(cap.seq_first_hint, cap.mha_seq_first)
        self.tok: dict[str, torch.Tensor] = {}        # "src"/"tgt" -> token part (raw layout)
        self.tok_site: dict[str, str] = {}
        self.pos_calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []   # (path, in, out)
        self.stack_in: dict[str, torch.Tensor] = {}   # "encoder"/"decoder" -> input (raw layout)
        self.streams: list[tuple[str, str, int | None, str, torch.Tensor]] = []
        self.records: list[tuple[_AttnCall, AttentionRecord]] = []
        self.seen_sites: dict[str, int] = {}

    # -- module hooks ------------------------------------------------------------------------
    def pre_hook(self, name: str):
        cap = self.cap

        def hook(module, args, kwargs):
            if name in cap.attention and (self.follow_attention or self.alpha is not None):
                query = args[0] if args else kwargs.get("query", kwargs.get("x"))
                key = args[1] if len(args) > 1 else kwargs.get("key")
                self.calls.append(_AttnCall(name, _t(query), _t(key)))
                self.calls_seen += 1
            if self.trace is None:
                return None
            stack = cap.stacks.get(name)
            if stack is None and name in cap.layers and cap.layers[name][1] == 0:
                stack = cap.layers[name][0]            # a ModuleList of layers is never called
            if stack is not None and stack not in self.stack_in:     # what enters the stack
                x = args[0] if args else next(iter(kwargs.values()), None)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    self.stack_in[stack] = x.detach()
            if name in cap.ffn_out and args and isinstance(args[0], torch.Tensor):
                self.trace.ffn_hidden[cap.ffn_out[name]] = args[0].detach()
            return None
        return hook

    def post_hook(self, name: str):
        cap = self.cap

        def hook(module, args, kwargs, output):
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
            if self.keep_order:
                self.trace.order.append((name, x))
            if name in cap.tok_wrappers:
                self._token_embedding(name, args, kwargs, x)
            if name in cap.positional and args and isinstance(args[0], torch.Tensor) \
                    and args[0].is_floating_point() and args[0].shape == x.shape:
                self.pos_calls.append((name, args[0].detach(), x))
            if name in cap.layers:
                stack, i = cap.layers[name]
                self._stream(name, stack, i, "layer", out)
            elif name in cap.sublayers:
                stack, i = cap.layers[_owner_layer(name, cap.layers)]
                self._stream(name, stack, i, "sublayer", out)
            elif name in cap.stacks:
                self._stream(name, cap.stacks[name], None, "stack", out)
            return None
        return hook

    def _token_embedding(self, name, args, kwargs, x) -> None:
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            return
        t = self.trace
        for role, ref in (("src", t.src), ("tgt", t.tgt)):
            if ref is None or role in self.tok:
                continue
            if ids.shape == ref.shape and torch.equal(ids, ref):
                first = False
            elif ids.dim() == 2 and ids.shape == ref.T.shape and torch.equal(ids, ref.T):
                first = True
            else:
                continue
            if self.layout.seq_first is None and ids.shape[0] != ids.shape[1]:
                self.layout.seq_first = first
            elif self.layout.seq_first is None:
                self.layout.seq_first = first and not torch.equal(ids, ref)
            self.tok[role], self.tok_site[role] = x, name
            return

    def _stream(self, name, stack, layer, kind, out: torch.Tensor) -> None:
        if out.dim() != 3 or not out.is_floating_point():
            return
        self.streams.append((name, stack, layer, kind, out.detach()))
        if "grad.stream" in self.reads and out.requires_grad:
            # The hook lives in the autograd graph, which the user's model may keep (The
            # Annotated Transformer stores `self.attn`): it must not reach the model, or the
            # model, graph and hook hold each other out of the collector's sight.
            trace, layout = self.trace, self.layout
            out.register_hook(lambda g, name=name: trace.grads.__setitem__(name, layout.bt(g.detach())))

    # -- attention events ----------------------------------------------------------------------
    def current(self) -> _AttnCall | None:
        """The attention module whose insides are being recorded (or scaled), if any."""
        if self.busy or not self.calls or not (self.intercept or self.alpha is not None):
            return None
        return self.calls[-1]

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

    def on_linear(self, x, out, weight=None) -> None:
        if self.trace is None or self.busy or not self.calls or not self.intercept:
            return
        if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
            self.calls[-1].linears.append((x.detach(), out.detach(), weight))

    def on_masked_fill(self, x, mask, out) -> None:
        call = self.current()
        if call is None:
            return
        if not call.softmaxed:
            if call.raw is not None and call.masked_scores is None and x.is_floating_point() \
                    and x.shape == call.raw.shape:   # not the fill that builds an additive mask
                call.scores, call.masked_scores = x, out
        elif call.z is None:                  # a mask applied to the probabilities
            call.probs = out

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
        for f in ("q", "k", "v", "scores", "masked_scores", "probs", "z"):
            val = getattr(call, f)
            if isinstance(val, torch.Tensor) and self.wants(f"attn.{f}"):   # as the taps do
                setattr(rec, f, val.detach())
        rec.qk_source = call.extra.get("qk_source", "operands")
        rec.shared_projection = bool(call.extra.get("shared_projection", False))
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
        are recorded as projected and the fitted scale is the whole scale applied.
        """
        if call.q is None or call.k is None:
            return
        pool = call.linears + [lin for outer in reversed(self.calls) for lin in outer.linears]
        found = []
        hints = self.cap.projection_hints
        for role, operand in (("q", call.q), ("k", call.k)):
            hit = _find_projection(operand, pool, hints.get((call.path, role)))
            if hit is None:
                return
            hints[(call.path, role)] = hit[3]
            found.append(hit[:3])
        (sq, q_in, q_map), (sk, k_in, k_map) = found
        call.q, call.k = call.q / sq, call.k / sk
        call.extra.update(qk_source="projection", shared_projection=_same_map(q_map, k_map),
                          kv_from_other_input=not _same(q_in, k_in))

    def wants(self, read: str) -> bool:
        return read in self.reads or "all" in self.reads

    def _classify(self, call: _AttnCall) -> tuple[str, int | None]:
        layer = _layer_index(call.path)
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
        if call.q is not None and t.tgt is not None and t.src is not None \
                and t.tgt.shape[1] != t.src.shape[1] and call.q.shape[-2] == t.tgt.shape[1]:
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
        for name, stack, layer, kind, x in self.streams:
            t.streams.append(StreamPoint(name, stack, layer, kind, self._bt(x)))
        for name, x in list(t.ffn_hidden.items()):
            t.ffn_hidden[name] = self._bt(x)
        if self.reads & {"embed", "stream", "grad.stream", "all"}:
            for role, stack in (("src", "encoder"), ("tgt", "decoder")):
                self._embedding_parts(role, stack)

    def _embedding_parts(self, role: str, stack: str) -> None:
        """tok: the input of the positional module whose output enters the stack, else a clean
        token-embedding wrapper's output; out: what enters the stack."""
        t = self.trace
        out = self.stack_in.get(stack)
        site = self.tok_site.get(role)
        tok = None
        if out is not None:
            for path, x_in, x_out in self.pos_calls:
                if x_out.shape == out.shape and (x_out is out or torch.equal(x_out, out)):
                    tok, site = x_in, site or path
                    break
        if tok is None and site is not None and self.cap.tok_wrappers.get(site):
            tok = self.tok.get(role)
        if site is None:
            if out is None:
                return
            site = next((n for n, s in self.cap.stacks.items() if s == stack), stack) + ".input"
        if self.tok_site.get("src") == self.tok_site.get("tgt"):   # one embedding for both sides
            site = f"{site}:{role}"
        parts = {}
        if tok is not None and out is not None and out.shape == tok.shape \
                and not _position_only(self._bt(out) - self._bt(tok)):
            tok = None      # out - tok depends on the tokens: `tok` is not the whole token part
        if tok is not None:
            parts["tok"] = self._bt(tok)
        if out is not None and (tok is None or out.shape == tok.shape):
            parts["out"] = self._bt(out)
            if tok is not None:
                parts["pe"] = parts["out"] - parts["tok"]
            first_dec = next((i for i, sp in enumerate(t.streams) if sp.stack == "decoder"), len(t.streams))
            t.streams.insert(0 if role == "src" else first_dec,
                             StreamPoint(site, "embed", None, "embed", parts["out"]))
        if parts:
            t.embed[site] = parts


def _t(x):
    return x if isinstance(x, torch.Tensor) else None


MASK_NATS = 50.0   # an added term this far below its row's largest scales a key's weight by e^-50
                   # (2e-22): the key is removed, whatever fill was used (-1e4, -1e9, -inf,
                   # finfo.min); a position bias spans a few nats and stays in the scores


def masked_by_addition(added, shape) -> torch.Tensor | None:
    """Where an additive term removes keys.  # bool, broadcast to `shape` [B, h, T, S]"""
    if not isinstance(added, torch.Tensor) or not added.is_floating_point() or added.dim() < 1:
        return None
    d = added.float()
    top = d.amax(-1, keepdim=True)
    removed = ~d.isfinite() | (d < top - MASK_NATS)
    try:
        return removed.expand(shape) if removed.any() else None
    except RuntimeError:
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def _looks_like_probs(w) -> bool:
    """Attention weights returned by a module: non-negative rows that sum to 1."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 3 or not w.numel():
        return False
    w = w.detach().float()
    rows = w.sum(-1)
    return bool((w >= 0).all()) and bool(((rows - 1).abs() < 1e-3).all())


FOLD_TOL = {False: 1e-4, True: 1e-2}   # relative error of a sorted-value match; True: 16-bit


def _same_map(a, b) -> bool:
    """Two (weight, n chunks, chunk j) are one projection: the same slice of one weight."""
    (wa, na, ja), (wb, nb, jb) = a, b
    if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor):
        return False
    if wa is wb or (wa.shape == wb.shape and wa.data_ptr() == wb.data_ptr()):
        return (na, ja) == (nb, jb)
    return False


def _candidates(pool: list, hint: tuple[int, int, int] | None):
    """(position from the end, linear, n chunks, chunk j) in the search order: the most recent
    projection first, q alone / kv fused / qkv fused; `hint` (the last match) before all."""
    if hint is not None and hint[0] < len(pool):
        yield hint[0], pool[-1 - hint[0]], hint[1], hint[2]
    for back in range(len(pool)):
        for n in (1, 2, 3):
            for j in range(n):
                if hint is None or (back, n, j) != hint:
                    yield back, pool[-1 - back], n, j


def _head_split_projection(operand: torch.Tensor, pool: list, hint=None):
    """`_find_projection` for an operand that is s * chunk.view(B, T, h, d_k).transpose(1, 2)
    of one linear map's output chunk [B, T, h*d_k], in the same candidate order; else None."""
    if operand.dim() != 4 or not operand.numel():
        return None
    B, h, T, dk = operand.shape
    a = operand.detach().float()
    a_norm = a.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j in _candidates(pool, hint):
        width = out.shape[-1]
        if width % n or width // n != h * dk or tuple(out.shape[:-1]) != (B, T):
            continue
        w = width // n
        view = out[..., j * w:(j + 1) * w].float().reshape(B, T, h, dk).transpose(1, 2)
        c_norm = view.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign in (1.0, -1.0):
            if float((a - sign * s * view).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j), (back, n, j)
    return None


def _find_projection(operand: torch.Tensor, pool: list, hint=None):
    """(s, input, (weight, n, j), where) when `operand` holds exactly the values of s * a chunk
    of one linear map's output, in any arrangement (a head split is a permutation of the
    entries); else None. `where` is the candidate's place, for `hint` next time.

    Sorted values are compared, so any reshape/transpose/view of the projection matches and
    nothing else does: a RoPE rotation, a per-head norm or an interleaved split fails the test,
    and the module then gets no fold correction (the fit sees the operands).
    The usual head split ([B, T, h*d_k] -> [B, h, T, d_k]) is tried first, element by element
    (O(n); an element-wise match is a sorted-value match): sorting is 90% of a probed training
    step's cost under `tndebug.watch`. The hint (where the last recording matched: the same
code runs each step) is checked first; it is accepted only by the same test.
    """
    hit = _head_split_projection(operand, pool, hint)
    if hit is not None:
        return hit
    a = operand.detach().float().flatten()
    if not a.numel():
        return None
    a_sorted = a.sort().values
    a_norm = a_sorted.norm()
    tol = FOLD_TOL[operand.dtype in (torch.float16, torch.bfloat16)]
    for back, (inp, out, weight), n, j in _candidates(pool, hint):
        width = out.shape[-1]
        if width % n or out.numel() // n != a.numel():
            continue
        w = width // n
        chunk = out[..., j * w:(j + 1) * w].float().flatten().sort().values
        c_norm = chunk.norm()
        if not (c_norm > 0 and a_norm > 0):
            continue
        s = float(a_norm / c_norm)
        for sign, ref in ((1.0, chunk), (-1.0, chunk.flip(0))):
            if float((a_sorted - sign * s * ref).norm() / a_norm) <= tol:
                return sign * s, inp, (weight, n, j), (back, n, j)
    return None


def _position_only(pe: torch.Tensor, rel: float = 1e-4) -> bool:
    """Is `out - tok` the same for every row of the batch (a function of position only)?"""
    if pe.dim() != 3 or pe.shape[0] < 2:
        return True
    scale = pe.abs().max().clamp_min(1e-12)
    return bool(((pe - pe[:1]).abs().max() / scale) <= rel)


def _owner_layer(path: str, layers: dict) -> str | None:
    parent = path.rpartition(".")[0]
    while parent:
        if parent in layers:
            return parent
        parent = parent.rpartition(".")[0]
    return None


def _is_positional(name: str, m: nn.Module) -> bool:
    """A positional-encoding module: by its name, its class, or a `pe`/`pos_*` tensor it owns."""
    own = [b for b, _ in m.named_buffers(recurse=False)] + [p for p, _ in m.named_parameters(recurse=False)]
    return bool(_POS.search(name.rpartition(".")[2]) or _POS.search(type(m).__name__)
                or any(_POS.search(b) for b in own))


# -- patching ------------------------------------------------------------------------------------
@contextmanager
def _patched(state: _State):
    """Swap torch's attention primitives for recording wrappers; always restored."""
    originals = []

    def patch(owner, name, make):
        orig = getattr(owner, name)
        originals.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def product(orig, kT=True):
        def wrapper(a, b, *args, **kwargs):
            if state.current() is None:
                return orig(a, b, *args, **kwargs)
            state.busy = True
            try:
                out = orig(a, b, *args, **kwargs)
            finally:
                state.busy = False
            state.on_product(a, b, out, kT)
            return out
        return wrapper

    def add(orig, inplace=False):
        def wrapper(a, b, *args, **kwargs):
            if state.current() is None:
                return orig(a, b, *args, **kwargs)
            before = a.clone() if inplace and isinstance(a, torch.Tensor) else a
            state.busy = True
            try:
                out = orig(a, b, *args, **kwargs)
            finally:
                state.busy = False
            if args or kwargs:                   # add(a, b, alpha=...): not a plain sum
                return out
            state.on_add(before, b, out)
            return out
        return wrapper

    def linear(orig):
        def wrapper(x, *args, **kwargs):
            out = orig(x, *args, **kwargs)
            if state.calls:
                state.on_linear(x, out, args[0] if args else kwargs.get("weight"))
            return out
        return wrapper

    def baddbmm(orig):
        def wrapper(inp, b1, b2, *args, **kwargs):
            if state.current() is None:
                return orig(inp, b1, b2, *args, **kwargs)
            state.busy = True
            try:
                out = orig(inp, b1, b2, *args, **kwargs)
                raw = torch.bmm(b1, b2)
            finally:
                state.busy = False
            state.on_product(b1, b2, raw)
            call = state.current()
            if call is not None and call.masked_scores is None:
                call.scores, call.masked_scores = raw, out
            return out
        return wrapper

    def einsum(orig):
        def wrapper(eq, *operands, **kwargs):
            ops = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
            if state.current() is None or len(ops) != 2:
                return orig(eq, *operands, **kwargs)
            state.busy = True
            try:
                out = orig(eq, *operands, **kwargs)
            finally:
                state.busy = False
            a, b = ops
            call = state.current()
            if call is not None and isinstance(b, torch.Tensor) and b.dim() == 2:
                if state.trace is not None:                  # "btd,de->bte": a projection
                    call.linears.append((a.detach(), out.detach(), b))
            elif call is not None and out.dim() >= 3:
                if not call.softmaxed and call.raw is None and a.shape[-1] == b.shape[-1]:
                    call.q, call.k, call.raw = a, b, out            # "...qd,...kd->...qk"
                elif call.softmaxed and call.z is None:
                    call.v, call.z = b, out
            return out
        return wrapper

    def masked_fill(orig, inplace=False):
        def wrapper(x, mask, value, *args, **kwargs):
            if state.current() is None:
                return orig(x, mask, value, *args, **kwargs)
            before = x.clone() if inplace else x
            state.busy = True
            try:
                out = orig(x, mask, value, *args, **kwargs)
            finally:
                state.busy = False
            state.on_masked_fill(before, mask, out)
            return out
        return wrapper

    def softmax(orig):
        def wrapper(x, *args, **kwargs):
            if state.current() is None:
                return orig(x, *args, **kwargs)
            x_in = state.softmax_input(x)
            state.busy = True
            try:
                out = orig(x_in, *args, **kwargs)
            finally:
                state.busy = False
            state.on_softmax(x_in, out)
            return out
        return wrapper

    def sdpa(orig):
        def wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, **kwargs):
            call = state.current()
            if call is None:
                return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, **kwargs)
            use_scale = scale
            if state.alpha is not None and not call.scaled:
                call.scaled = True
                use_scale = (scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])) * state.alpha
            state.busy = True
            try:
                out = orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=use_scale, **kwargs)
            finally:
                state.busy = False
            state.on_sdpa(query, key, value, attn_mask, is_causal, use_scale, out)
            return out
        return wrapper

    try:
        for owner in (torch, torch.Tensor):
            patch(owner, "matmul", product)
            patch(owner, "bmm", product)
            patch(owner, "masked_fill", masked_fill)
            patch(owner, "softmax", softmax)
        patch(torch.Tensor, "__matmul__", product)
        patch(torch, "add", add)
        patch(torch.Tensor, "add", add)
        patch(torch.Tensor, "__add__", add)
        patch(torch.Tensor, "__radd__", add)
        patch(torch.Tensor, "add_", lambda o: add(o, inplace=True))
        patch(torch.Tensor, "__iadd__", lambda o: add(o, inplace=True))
        patch(F, "linear", linear)
        patch(torch.Tensor, "masked_fill_", lambda o: masked_fill(o, inplace=True))
        patch(torch, "baddbmm", baddbmm)
        patch(torch, "einsum", einsum)
        patch(F, "softmax", softmax)
        patch(F, "scaled_dot_product_attention", sdpa)
        wrapped = {orig: getattr(owner, name) for owner, name, orig in originals
                   if (owner, name) in ((torch, "einsum"), (F, "softmax"))}
        with _rebound(state, wrapped):
            yield
    finally:
        for owner, name, orig in reversed(originals):
            setattr(owner, name, orig)


class _Rebound(TorchFunctionMode):
    """Calls of torch functions the model bound before the patch (`from torch import einsum`,
    `functools.partial(F.softmax, dim=-1)`, as x-transformers does): torch hands every call of
    such a function to an active mode, whatever name it was called by, so they reach the same
    recording wrappers. A call made through the patched name reaches the mode from inside its
    wrapper, while `state.busy`, and passes through unrecorded a second time."""

    def __init__(self, state: "_State", wrapped: dict) -> None:
        super().__init__()
        self.state, self.wrapped, self.hits = state, wrapped, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrapper = self.wrapped.get(func)
        if wrapper is not None and not self.state.busy and self.state.current() is not None:
            self.hits += 1
            return wrapper(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def _rebound(state: "_State", wrapped: dict):
    """`_Rebound` for this recording, unless an earlier one of this capture saw attention and
    found every call through the patched names (then it costs nothing: most models)."""
    cap = state.cap
    if getattr(cap, "bound_elsewhere", None) is False or not wrapped:
        yield
        return
    mode = _Rebound(state, wrapped)
    with mode:
        yield
    if mode.hits:
        cap.bound_elsewhere = True
    elif state.calls_seen:
        cap.bound_elsewhere = False


def projection_weights(model: nn.Module) -> list:
    """(path, W_Q, W_K, W_V, heads) for attention modules whose projections are recognisable."""
    out = []
    for name, m in model.named_modules():
        if not is_attention(m):
            continue
        h = next((getattr(m, a) for a in ("num_heads", "h", "n_heads", "nhead", "n_head")
                  if isinstance(getattr(m, a, None), int)), None)
        if h is None:
            continue
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            wq, wk, wv = m.in_proj_weight.detach().chunk(3)
        elif isinstance(getattr(m, "linears", None), nn.ModuleList) and len(m.linears) >= 3:
            wq, wk, wv = (m.linears[i].weight.detach() for i in range(3))
        elif all(isinstance(getattr(m, a, None), nn.Linear) for a in ("w_q", "w_k", "w_v")):
            wq, wk, wv = m.w_q.weight.detach(), m.w_k.weight.detach(), m.w_v.weight.detach()
        elif isinstance(getattr(m, "qkv", None), nn.Linear):
            wq, wk, wv = m.qkv.weight.detach().chunk(3)
        else:
            continue
        out.append((name, wq, wk, wv, h))
    return out
