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

from tndebug.capture.discovery import watch_forward
from tndebug.capture.model_parts import (called_stacks, ffn_outputs, numbered_blocks, stacked_blocks,
                                         token_embedding_modules)
from tndebug.capture.origins import Origins
from tndebug.capture.patching import patched
from tndebug.capture.recording import State
from tndebug.capture.streams import is_norm
from tndebug.capture.structure import LAYER, STACK, is_attention, is_positional, owner_layer, stack_of
from tndebug.capture.trace import Trace



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
        self.layers = {n: (stack_of(n) or "encoder", int(m.group("i")))
                       for n in modules for m in [LAYER.search(n)] if m}
        if kind in ("decoder", "encoder"):
            self.layers = numbered_blocks(modules, kind)
        elif not self.layers:
            self.layers = stacked_blocks(modules)
        self.stacks = {n: stack_of(n) for n in modules if n and STACK.search(n)
                       and any(c.startswith(n + ".") for c in self.layers)}
        self.stacks.update(called_stacks(modules, self.layers))
        self.sublayers = {n for n, m in modules.items()
                          if re.search(r"sublayer|residual", type(m).__name__, re.I)
                          and owner_layer(n, self.layers) is not None}
        self.repeated: set[str] = set()       # blocks counted by calls (`_repeated_blocks`)
        self.positional = {n for n, m in modules.items() if n and is_positional(n, m)}
        self.norms = {n for n, m in modules.items() if n and is_norm(m)}   # told once, not per call
        self.tok_wrappers = token_embedding_modules(modules, self.positional, self.layers, self.stacks)
        self.ffn_out = ffn_outputs(modules, self.attention, self.layers)
        mhas = [m for m in modules.values() if isinstance(m, nn.MultiheadAttention)]
        self.mha_seq_first = bool(mhas) and not any(m.batch_first for m in mhas)
        self.alpha: float | None = None
        self._active = False
        # (site, "q"/"k") -> where its projection was last found (position in the pool counted
        # from the end, chunks, chunk, layout, "values"/"norms"): tried first next time, one
        # check instead of a search
        self.projection_hints: dict[tuple[str, str], tuple] = {}

    # -- discovery ---------------------------------------------------------------------------
    def discover(self, run) -> set[str]:
        """Run `run()` (one forward) and add, as attention modules, the innermost modules in which
        a softmax follows a product of two activations (q k^T, not x W), or an SDPA call happens,
        whatever their class is called (`Head`, `Mixer`). A softmax module (`nn.Softmax`)
        stands for its parent. Returns the modules added."""
        modules = dict(self.model.named_modules())
        found, calls = watch_forward(modules, run)
        new = {n for n in found if n not in self.attention
               and not any(n.startswith(a + ".") for a in self.attention)}
        self.attention |= new
        if self._repeated_blocks(modules, calls) or new:
            self.ffn_out = ffn_outputs(modules, self.attention, self.layers)
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
        self.layers = {n: (one_stack or stack_of(n) or "encoder", 0) for n in outer}
        self.repeated = set(outer)
        self.stacks.update({n: stack_of(n) for n in modules if n and STACK.search(n)
                            and any(c.startswith(n + ".") for c in self.layers)})
        self.sublayers = {n for n, m in modules.items()
                          if re.search(r"sublayer|residual", type(m).__name__, re.I)
                          and owner_layer(n, self.layers) is not None}
        return bool(outer)

    # -- recording ---------------------------------------------------------------------------
    @contextmanager
    def recording(self, reads=("all",), trace: Trace | None = None, *, until_stacks: bool = False,
                  stop_before: str | None = None):
        """Record `reads` into `trace`; with `until_stacks`, the forward stops (StacksEntered)
        once every stack has been entered; with `stop_before` (a module path), as that module
        is called (HeadReached)."""
        trace = trace if trace is not None else Trace()
        state = State(self, trace, frozenset(reads))
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
        state = State(self, None, frozenset())
        state.alpha = alpha
        with self._installed(state, sorted(self.attention)):
            yield

    @contextmanager
    def swapping_kv(self):
        """Every attention's grouped-query key/value heads in the other order (interleaved <->
        tiled) at the score and value products and SDPA (nothing recorded); yields the list of
        the orders found, one per operand swapped (empty: no grouped-query heads repeated in
        the model's code)."""
        state = State(self, None, frozenset())
        state.kv_swap = True
        with self._installed(state, sorted(self.attention)):
            yield state.kv_orders

    def _paths_for(self, state: "State") -> list[str]:
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
    def _installed(self, state: "State", paths: list[str]):
        """Hooks on `paths`; torch's attention primitives patched when an attention's insides
        are recorded or scaled; MHA fast path off (it runs a layer as one call, past the hooks
        inside it); all undone."""
        # the lines that made each tensor (origins.py): on recordings with a Trace only (probed
        # passes), never on tndebug's own model, whose lines are not the user's. The notes run
        # while the model's own forward runs (its root's hooks open and close them), not through
        # a backward that a step's recording may stay open into
        if state.trace is not None and not type(self.model).__module__.startswith("tndebug."):
            state.origins = Origins(state)
            paths = paths if "" in paths else ["", *paths]
        handles = []
        for name in paths:
            module = self.model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(state.pre_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(state.post_hook(name), with_kwargs=True))
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        patching = patched(state) if state.intercept or state.alpha is not None \
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
