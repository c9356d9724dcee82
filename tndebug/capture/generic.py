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
  (sublayer) and the stacks (`encoder`, `decoder`, `transformer.encoder`, ...); a module called
  several times in one forward (a block shared across depth, ALBERT's) is one layer per call,
  found by `discover` (`_repeated_blocks`).
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

import re
from contextlib import contextmanager
from contextlib import nullcontext

from torch import nn
import torch
import torch.nn.functional as F

from tndebug.capture.trace import Trace
from tndebug.capture.patching import _patched
from tndebug.capture.recording import _State
from tndebug.capture.streams import is_norm
from tndebug.capture.structure import _FFN, _FFN_OUT, _LAYER, _STACK, _is_positional, _owner_layer, _stack_of, is_attention


_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|blocks|block|h)\.(?P<i>\d+)$")


def _blocks(modules: dict, stack: str = "decoder") -> dict[str, tuple[str, int]]:
    """The numbered blocks of a one-stack model -> (stack, index): children of a
    ModuleList named layers/blocks/h that are not inside another such block."""
    found = {n: int(m.group("i")) for n in modules for m in [_BLOCK.search(n)] if m}
    outer = {n: i for n, i in found.items()
             if not any(n.startswith(o + ".") for o in found if o != n)}
    return {n: (stack, i) for n, i in outer.items()}


def _stacked_blocks(modules: dict) -> dict[str, tuple[str, int]]:
    """The numbered blocks of an encoder-decoder whose block paths name no stack, the stack
    named by an ancestor instead (x-transformers: `encoder.attn_layers.layers.3`,
    `decoder.net.attn_layers.layers.3`) -> (stack, index); blocks under no named stack are
    left out. Such a block may be one sublayer (x-transformers numbers attention and FFN
    apart); its residual-add module gives the stream points."""
    return {n: (stack, i) for n, (_, i) in _blocks(modules).items()
            for stack in [_stack_of(n)] if stack is not None}


def _called_stacks(modules: dict, layers: dict) -> dict[str, str]:
    """Where a stack is entered when its numbered blocks are containers that are never called
    (x-transformers: `attn_layers.layers.0` is a ModuleList of norm, block and residual, run
    by `attn_layers.forward`): the module that owns the list -> the stack. Its input is what
    enters the stack (the embedding output), its output what leaves it."""
    out = {}
    for path, (stack, i) in layers.items():
        owner = path.rpartition(".")[0].rpartition(".")[0]
        if i == 0 and owner and isinstance(modules[path], (nn.ModuleList, nn.ModuleDict)):
            out[owner] = stack
    return out


class GenericCapture:
    """Fills a Trace from any nn.Module; module paths are the model's own.

    Args:
        model: the user's module.
        seq_first: True for [T, B, ...] activations; None detects it from the ids the
            embeddings receive (then from nn.MultiheadAttention.batch_first).
        kind: the Subject's kind. For "decoder" (one causal stack) the layers are the numbered
            blocks whatever their path says (`transformer.h.3`, `model.layers.3`, `blocks.3`),
            all in the stack "decoder"; for "encoder" (one bidirectional stack, BERT-style)
            the same blocks, in the stack "encoder" (`bert.encoder.layer.3`,
            `distilbert.transformer.layer.3`).
    """

    def __init__(self, model: nn.Module, *, seq_first: bool | None = None,
                 kind: str = "seq2seq") -> None:
        self.model = model
        self.seq_first_hint = seq_first
        self.paths = {id(m): n for n, m in model.named_modules()}
        modules = dict(model.named_modules())
        self.attention = {n for n, m in modules.items() if n and is_attention(m)}
        self.kind = kind
        self.layers = {n: (_stack_of(n) or "encoder", int(m.group("i")))
                       for n in modules for m in [_LAYER.search(n)] if m}
        if kind in ("decoder", "encoder"):
            self.layers = _blocks(modules, kind)
        elif not self.layers:
            self.layers = _stacked_blocks(modules)
        self.stacks = {n: _stack_of(n) for n in modules if n and _STACK.search(n)
                       and any(c.startswith(n + ".") for c in self.layers)}
        self.stacks.update(_called_stacks(modules, self.layers))
        self.sublayers = {n for n, m in modules.items()
                          if re.search(r"sublayer|residual", type(m).__name__, re.I)
                          and _owner_layer(n, self.layers) is not None}
        self.repeated: set[str] = set()       # blocks counted by calls (`_repeated_blocks`)
        self.positional = {n for n, m in modules.items() if n and _is_positional(n, m)}
        self.norms = {n for n, m in modules.items() if n and is_norm(m)}   # told once, not per call
        self.tok_wrappers = self._token_embedding_modules(modules)
        self.ffn_out = self._ffn_outputs(modules)
        mhas = [m for m in modules.values() if isinstance(m, nn.MultiheadAttention)]
        self.mha_seq_first = bool(mhas) and not any(m.batch_first for m in mhas)
        self.alpha: float | None = None
        self._active = False
        # (site, "q"/"k") -> where its projection was last found (position in the pool counted
        # from the end, chunks, chunk, layout, "values"/"norms"): tried first next time, one
        # check instead of a search
        self.projection_hints: dict[tuple[str, str], tuple] = {}

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
        in a gated FFN such as T5's wi_0/wi_1/wo, or a gated FFN's two fused into d -> 2f, as
        Phi-3's gate_up_proj; Hugging Face's Conv1D counts as a Linear, see
        `affine_dims`) is a feed-forward block; the contraction's
        input is the hidden. When f == d the two cannot be told apart by shape, and the one
        registered second is taken (every implementation we know defines w_1 before w_2).
        The usual names (`w_2`, `linear2`, `fc2`, ...) count too.
        """
        out = {}
        for owner, m in modules.items():
            if any(owner == a or owner.startswith(a + ".") for a in self.attention):
                continue
            linears = [(n, c, affine_dims(c)) for n, c in m.named_children()]
            linears = [(n, c, dims) for n, c, dims in linears if dims is not None]
            for i, (n2, l2, (in2, out2)) in enumerate(linears):
                # an expansion d -> f before it, or d -> 2f: a gated FFN's gate and up maps
                # fused into one (Phi-3's and GLM's gate_up_proj, chunked in two)
                pairs = [l1 for n1, l1, (in1, out1) in linears if l1 is not l2
                         and out1 in (in2, 2 * in2) and in1 == out2]
                contraction = in2 > out2 or (
                    in2 == out2 and any(l1 is c for _, c, _ in linears[:i] for l1 in pairs))
                named = n2 in _FFN_OUT and (owner in self.layers or _FFN.search(owner.rpartition(".")[2])
                                            or _FFN.search(type(m).__name__))
                if not ((pairs and contraction) or named):
                    continue
                name = f"{owner}.{n2}" if owner else n2
                holds_attention = any(c.startswith(owner + ".") for c in self.attention) if owner else True
                block = owner and owner not in self.layers and not holds_attention
                out[name] = owner if block else name
        out.update(self._split_ffns(modules, out))
        return out

    def _split_ffns(self, modules: dict, found: dict[str, str]) -> dict[str, str]:
        """Feed-forwards split over two children of a layer, each holding one Linear: the
        expansion d -> f (f > d) in the first, the contraction f -> d in a later one (Hugging
        Face's BERT family: `intermediate.dense`, then `output.dense`, whose module also adds
        the residual and norms). The contraction's input is the hidden, keyed by its path.
        Only in layers where no FFN was found within one module."""
        out = {}
        for layer in self.layers:
            if any(n.startswith(layer + ".") for n in found):
                continue
            kids = []
            for n, c in modules[layer].named_children():
                path = f"{layer}.{n}"
                if any(a == path or a.startswith(path + ".") for a in self.attention):
                    continue
                affine = [(f"{path}.{k}", d) for k, x in c.named_children()
                          for d in [affine_dims(x)] if d is not None]
                if len(affine) == 1:
                    kids.append(affine[0])
            for i, (_, (d_in, f)) in enumerate(kids):
                later = [p for p, (f_in, d_out) in kids[i + 1:] if f > d_in and (f_in, d_out) == (f, d_in)]
                if later:
                    out[later[0]] = later[0]
                    break
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

        calls: dict[str, list[bool]] = {}        # module -> per call: a [B, T, d] stream in and out

        def called(name, args, kwargs, out) -> None:
            stack.pop()
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            y = out[0] if isinstance(out, (tuple, list)) and out else out
            calls.setdefault(name, []).append(   # (nested tensors, nn.TransformerEncoder's fast path: no)
                isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not x.is_nested
                and not y.is_nested and x.dim() == 3 and x.is_floating_point() and y.shape == x.shape)

        handles = []
        for name, m in modules.items():
            handles.append(m.register_forward_pre_hook(lambda mod, a, name=name: stack.append(name)))
            handles.append(m.register_forward_hook(
                lambda mod, a, kw, o, name=name: called(name, a, kw, o), with_kwargs=True))

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
        if self._repeated_blocks(modules, calls) or new:
            self.ffn_out = self._ffn_outputs(modules)
        return new

    def _repeated_blocks(self, modules: dict, calls: dict[str, list[bool]]) -> bool:
        """Blocks from behaviour: a module called several times in one forward, a [B, T, d]
        stream in and out each time, is applied several times along depth (ALBERT's shared
        layer, a Universal-Transformer-style `for _ in range(n): x = self.block(x)`): each call
        is a block. Numbered blocks called again make their stack counted by calls; with no
        numbered blocks, the outermost such modules that hold attention (not inside one) are
        the blocks. Sets `repeated` (and `layers`, `stacks`, `sublayers`); True if any."""
        again = {n for n, seen in calls.items() if len(seen) > 1 and all(seen)}
        if self.layers:
            stacks = {s for n, (s, _) in self.layers.items() if n in again}
            self.repeated = {n for n, (s, _) in self.layers.items() if s in stacks and n in calls}
            return bool(self.repeated)
        held = {n for n in again if n and n not in self.attention
                and not any(n.startswith(a + ".") for a in self.attention)
                and any(a.startswith(n + ".") for a in self.attention)}
        outer = {n for n in held if not any(n.startswith(o + ".") for o in held)}
        one_stack = self.kind if self.kind in ("decoder", "encoder") else None
        self.layers = {n: (one_stack or _stack_of(n) or "encoder", 0) for n in outer}
        self.repeated = set(outer)
        self.stacks.update({n: _stack_of(n) for n in modules if n and _STACK.search(n)
                            and any(c.startswith(n + ".") for c in self.layers)})
        self.sublayers = {n for n, m in modules.items()
                          if re.search(r"sublayer|residual", type(m).__name__, re.I)
                          and _owner_layer(n, self.layers) is not None}
        return bool(outer)

    # -- recording ---------------------------------------------------------------------------
    @contextmanager
    def recording(self, reads=("all",), trace: Trace | None = None, *, until_stacks: bool = False,
                  stop_before: str | None = None):
        """Record `reads` into `trace`; with `until_stacks`, the forward stops (StacksEntered)
        once every stack has been entered; with `stop_before` (a module path), as that module
        is called (HeadReached)."""
        trace = trace if trace is not None else Trace()
        state = _State(self, trace, frozenset(reads))
        state.until_stacks = until_stacks
        state.stop_before = stop_before
        paths = self._paths_for(state)
        if stop_before is not None and stop_before not in paths:
            paths.append(stop_before)
        try:
            with self._installed(state, paths):
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

    @contextmanager
    def swapping_kv(self):
        """Every attention's grouped-query key/value heads in the other order (interleaved <->
        tiled) at the score and value products and SDPA (nothing recorded); yields the list of
        the orders found, one per operand swapped (empty: no grouped-query heads repeated in
        the model's code)."""
        state = _State(self, None, frozenset())
        state.kv_swap = True
        with self._installed(state, sorted(self.attention)):
            yield state.kv_orders

    def _paths_for(self, state: "_State") -> list[str]:
        """The modules whose hooks fill what `state.reads` asks for, in the model's order: a
        recording of FFN activations hooks the FFNs, not every Linear and LayerNorm (hooks on
        every module cost a probed step ~2 ms on a 3-layer model)."""
        reads = state.reads
        if "all" in reads or state.keep_order:          # every module's output, in order
            return [n for n, _ in self.model.named_modules()]
        paths = set(self.tok_wrappers)                  # the layout: the ids they are fed
        if state.follow_attention:
            paths |= self.attention | self.repeated     # a shared block's call: its depth
        if state.intercept:             # QK-norm: norms inside attention (_norm_in_attention)
            paths |= self._attention_norms()
        if "ffn.hidden" in reads:
            paths |= set(self.ffn_out)
        if reads & {"embed", "grad.stream"}:            # what enters each stack, and from where
            paths |= self.positional | set(self.stacks)
            paths |= {n for n, (_, i) in self.layers.items() if i == 0}
        if "grad.stream" in reads:      # the norms: a Post-LN stream point may be one's output
            paths |= set(self.layers) | self.sublayers | self.norms
        return [n for n, _ in self.model.named_modules() if n in paths]

    def _attention_norms(self) -> set[str]:
        """The norms inside attention modules, found once per set of attention modules (it
        grows only when `discover` adds one), not on every probed step."""
        key = frozenset(self.attention)
        if getattr(self, "_attn_norms_key", None) != key:
            self._attn_norms_key = key
            self._attn_norms = {n for n in self.norms if any(n.startswith(a + ".") for a in key)}
        return self._attn_norms

    @contextmanager
    def _installed(self, state: "_State", paths: list[str]):
        """Hooks on `paths`; torch's attention primitives patched when an attention's insides
        are recorded or scaled; MHA fast path off (it runs a layer as one call, past the hooks
        inside it); all undone."""
        # the lines that made each tensor (origins.py): on recordings with a Trace only (probed
        # passes), never on tndebug's own model, whose lines are not the user's. The notes run
        # while the model's own forward runs (its root's hooks open and close them), not through
        # a backward that a step's recording may stay open into
        if state.trace is not None and not type(self.model).__module__.startswith("tndebug."):
            from tndebug.capture.origins import Origins
            state.origins = Origins(state)
            paths = paths if "" in paths else ["", *paths]
        handles = []
        for name in paths:
            module = self.model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(state.pre_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(state.post_hook(name), with_kwargs=True))
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        patching = _patched(state) if state.intercept or state.alpha is not None \
            or state.kv_swap else nullcontext()
        try:
            with patching:
                yield
        finally:
            if state.origins is not None:
                state.origins.close()            # a forward that raised (StacksEntered) ends here
            torch.backends.mha.set_fastpath_enabled(fastpath)
            for h in handles:
                h.remove()


def affine_dims(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a module that is one weight matrix applied to the last dimension: an
    nn.Linear (weight [out, in]), or a leaf whose 2-d weight is [in, out] with `nf` = out, as
    Hugging Face's Conv1D (GPT-2: x @ W + b through torch.addmm); else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and getattr(m, "nf", None) == w.shape[1] \
            and not any(True for _ in m.children()):
        return int(w.shape[0]), int(w.shape[1])
    return None
