"""The residual-stream and embedding half of a recording's state.
"""
from __future__ import annotations


import torch
from torch import nn

from tndebug.capture.trace import StreamPoint
from tndebug.capture.structure import position_only


def is_norm(module: nn.Module) -> bool:
    """A normalisation module (a hint: what it is used for is told from behaviour)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()


class Streams:
    """The residual stream and embedding points of a recording (mixed into `recording.State`: the
    attention internals are the rest of it)."""

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
        self._note_norm(len(self.streams) - 1, out)
        live = self._grad_hook(name, out)
        if kind == "sublayer":
            self._renorm_ends()               # a norm on the last sum that no residual took
            self.last_add = (len(self.streams) - 1, out, live)

    def _norm_output(self, module: nn.Module, out) -> None:
        """Keep the last few normalisation outputs with the module's per-feature weight and
        bias, so a stream point that *is* one of them can be checked by undoing the norm."""
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 2:
            return
        d = out.shape[-1]
        affine = []
        for attr in ("weight", "bias"):
            p = getattr(module, attr, None)
            ok = isinstance(p, torch.Tensor) and p.dim() == 1 and p.shape[0] == d
            affine.append(p.detach() if ok else None)
        if getattr(module, "weight", None) is not None and affine[0] is None:
            return                            # a weight of another shape: cannot be undone
        self.norm_outs = [*self.norm_outs[-3:], (out, tuple(affine))]

    def _note_norm(self, i: int, out: torch.Tensor) -> None:
        hit = next((aff for t, aff in self.norm_outs if t is out), None)
        if hit is not None:
            self.stream_norm[i] = hit
        else:
            self.stream_norm.pop(i, None)

    def _grad_hook(self, name: str, out: torch.Tensor) -> dict:
        """trace.grads[name] := d loss / d out, while the returned switch is on."""
        live = {"on": True}
        if "grad.stream" in self.reads and out.requires_grad:
            # The hook lives in the autograd graph, which the user's model may keep (The
            # Annotated Transformer stores `self.attn`): it must not reach the model, or the
            # model, graph and hook hold each other out of the collector's sight.
            trace, layout = self.trace, self.layout
            out.register_hook(lambda g, name=name, live=live: trace.grads.__setitem__(
                name, layout.bt(g.detach())) if live["on"] else None)
        return live

    # Post-norm code that adds in one module and normalises after it (x-transformers' `Residual`,
    # then the layer's `post_main_norm`): the stream is the norm's output, the tensor the next
    # residual adds, not the sum. Told from behaviour, not from names: a norm was called on the
    # last residual sum, and the next residual-add module is handed that norm's output and not
    # the sum (Pre-LN hands it the sum: its norm output feeds only the branch).
    def _norm_called(self, x_in, out) -> None:
        if self.last_add is not None and x_in is self.last_add[1] and isinstance(out, torch.Tensor) \
                and out.shape == x_in.shape:
            self.normed = out

    def _add_called(self, args, kwargs) -> None:
        if self.last_add is None or self.normed is None:
            return
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(a is self.last_add[1] for a in given):        # the sum goes on: not post-norm
            self.last_add = self.normed = None
        elif any(a is self.normed for a in given):
            self._renorm(self.last_add, self.normed)
            self.post_norm_stacks.add(self.streams[self.last_add[0]][1])
            self.last_add = self.normed = None

    def _renorm(self, last_add, normed: torch.Tensor) -> None:
        i, _, live = last_add
        name, stack, layer, kind, _ = self.streams[i]
        self.streams[i] = (name, stack, layer, kind, normed.detach())
        self._note_norm(i, normed)
        live["on"] = False
        self._grad_hook(name, normed)

    def _renorm_ends(self) -> None:
        """The last sum of a post-norm stack is normalised too, though no residual follows."""
        if self.last_add is not None and self.normed is not None \
                and self.streams[self.last_add[0]][1] in self.post_norm_stacks:
            self._renorm(self.last_add, self.normed)
        self.last_add = self.normed = None

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
                    if path in t.made:          # the embedding addition's line (origins.py)
                        t.made.setdefault(f"{stack}:embedding", t.made[path])
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
                and not position_only(self._bt(out) - self._bt(tok)):
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
