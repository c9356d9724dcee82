"""The capture of tndebug's own tap points: a `Trace` from the model's HookPoints, named by
their module paths (`encoder.layers.0.self_attn.hook_scores`)."""
from __future__ import annotations

import re
from contextlib import contextmanager

from torch import nn

from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace


_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)")


def classify_site(path: str) -> tuple[str, int | None]:
    """(kind, layer) for an attention module path in tndebug's naming."""
    m = _LAYER.search(path)
    layer = int(m.group(2)) if m else None
    if "cross" in path or "src_attn" in path or "multihead_attn" in path:
        return "cross", layer
    if m and m.group(1) == "decoder":
        return "dec_self", layer
    return "enc_self", layer


class TapCapture:
    """Fills a Trace from tndebug's own HookPoints. Hooks live only inside `recording()`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.points = {n: m for n, m in model.named_modules() if hasattr(m, "add_grad_hook")}

    def _wanted(self, name: str, reads: frozenset) -> bool:
        leaf = name.rsplit(".", 1)[-1]
        if "all" in reads:
            return True
        if ".self_attn." in name or ".cross_attn." in name:
            field_ = leaf.removeprefix("hook_")
            return f"attn.{field_}" in reads
        if "_embed." in name:
            return "embed" in reads or ("stream" in reads and leaf == "hook_out")
        if ".ffn." in name:
            return leaf == "hook_hidden" and "ffn.hidden" in reads
        if leaf == "hook_logits":
            return "logits" in reads
        return "stream" in reads or "grad.stream" in reads

    @contextmanager
    def recording(self, reads, trace: Trace | None = None, *, until_stacks: bool = False):
        """`until_stacks` is accepted and ignored: tndebug's own model runs whole (its taps
        have no stop point; the record is the same)."""
        reads = frozenset(reads)
        trace = trace or Trace()
        handles = []
        try:
            for name, point in self.points.items():
                if not self._wanted(name, reads):
                    continue
                handles.append(point.register_forward_hook(self._make_hook(name, trace)))
                if "grad.stream" in reads and _stream_meta(name) is not None:
                    handles.append(point.add_grad_hook(
                        lambda n, g: trace.grads.__setitem__(n, g.detach())))
            yield trace
        finally:
            for h in handles:
                h.remove()

    @staticmethod
    def _make_hook(name: str, trace: Trace):
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        field_ = leaf.removeprefix("hook_")
        meta = _stream_meta(name)

        def hook(module, inputs, output):
            x = output.detach()
            trace.order.append((name, x))
            if owner.endswith("attn"):
                rec = trace.attention.get(owner)
                if rec is None:
                    kind, layer = classify_site(owner)
                    rec = trace.attention[owner] = AttentionRecord(owner, kind, layer)
                setattr(rec, field_, x)
            elif owner.endswith("_embed"):
                trace.embed.setdefault(owner, {})[field_] = x
                if field_ == "out":
                    trace.streams.append(StreamPoint(name, "embed", None, "embed", x))
            elif owner.endswith(".ffn"):
                trace.ffn_hidden[owner] = x
            elif leaf == "hook_logits":
                trace.logits = x
            elif meta is not None:
                trace.streams.append(StreamPoint(name, *meta, x))
        return hook


def _stream_meta(name: str):
    """(stack, layer, kind) for a residual-stream tap, else None."""
    m = _LAYER.search(name)
    if name.endswith("hook_resid"):
        return (m.group(1), int(m.group(2)), "sublayer") if m else None
    if m and name == f"{m.group(0)}.hook_out":
        return m.group(1), int(m.group(2)), "layer"
    if name in ("encoder.hook_out", "decoder.hook_out"):
        return name.split(".")[0], None, "stack"
    return None
