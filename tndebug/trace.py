"""What probes see of one forward (and backward) pass: a `Trace`, filled by a capture.

Probes read a small interface, not our classes, so that `tndebug triage` can fill the same
interface from a user's own model (see `tndebug/triage/capture.py`):

* per attention module: an `AttentionRecord` with q, k, v, scores (scaled, pre-mask),
  masked scores, probabilities, per-head outputs and the output (any may be None when the
  model does not expose it, e.g. fused attention);
* the residual stream at each point along depth (`Trace.streams`, in execution order);
* embeddings (token part, position part, sum), FFN hidden activations, logits;
* every captured tensor in execution order (`Trace.order`), for NaN provenance;
* gradients at the stream points when asked for (`Trace.grads`).

`reads` names what a probe needs: "attn.q", "attn.k", "attn.v", "attn.scores",
"attn.masked_scores", "attn.probs", "attn.z", "attn.out", "stream", "embed", "ffn.hidden",
"logits", "grad.stream", "all". Unknown names fail at registration.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

ATTN_FIELDS = ("q", "k", "v", "scores", "masked_scores", "probs", "z", "out")
READS = frozenset({f"attn.{f}" for f in ATTN_FIELDS} |
                  {"stream", "embed", "ffn.hidden", "logits", "grad.stream", "all"})
KINDS = ("enc_self", "dec_self", "cross")


def check_reads(probe_name: str, reads) -> None:
    for r in reads:
        if r not in READS:
            raise ValueError(f"probe {probe_name!r} reads {r!r}; no such tap "
                             f"(known: {', '.join(sorted(READS))})")


@dataclass
class AttentionRecord:
    site: str                       # module path, e.g. "encoder.layers.0.self_attn"
    kind: str = "enc_self"          # "enc_self" | "dec_self" | "cross"
    layer: int | None = None
    q: torch.Tensor | None = None              # [B, h, T, d_k]
    k: torch.Tensor | None = None              # [B, h, S, d_k]
    v: torch.Tensor | None = None              # [B, h, S, d_k]
    scores: torch.Tensor | None = None         # [B, h, T, S] scaled, before the mask
    masked_scores: torch.Tensor | None = None  # [B, h, T, S]
    probs: torch.Tensor | None = None          # [B, h, T, S]
    z: torch.Tensor | None = None              # [B, h, T, d_k]
    out: torch.Tensor | None = None            # [B, T, d_model]
    head_averaged: bool = False                # probs averaged over heads (nn.MultiheadAttention)
    qk_source: str = "projection"              # "projection": q, k as projected (before any scale);
                                               # "operands": the product's inputs, not traced back
    shared_projection: bool = False            # q and k come from one slice of one weight

    @property
    def tag(self) -> str:
        """`enc_self/layer0`, the TensorBoard prefix of this module."""
        return f"{self.kind}/layer{self.layer if self.layer is not None else '?'}"

    def key_keep(self) -> torch.Tensor | None:
        """Which (query, key) pairs the mask let through, derived from the tensors.  # [B, h, T, S]"""
        if self.scores is not None and self.masked_scores is not None:
            return self.masked_scores == self.scores
        return None


@dataclass
class StreamPoint:
    name: str                    # module path of the tap
    stack: str                   # "encoder" | "decoder" | "embed"
    layer: int | None
    kind: str                    # "embed" | "sublayer" | "layer" | "stack"
    x: torch.Tensor              # [B, T, d_model]


@dataclass
class Trace:
    step: int = 0
    src: torch.Tensor | None = None
    tgt: torch.Tensor | None = None
    pad_id: int = 0
    attention: dict[str, AttentionRecord] = field(default_factory=dict)
    streams: list[StreamPoint] = field(default_factory=list)
    embed: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)   # {"src_embed": {"tok", "pe", "out"}}
    ffn_hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    order: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def records(self, kind: str | None = None) -> list[AttentionRecord]:
        return [r for r in self.attention.values() if kind is None or r.kind == kind]


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
    def recording(self, reads, trace: Trace | None = None):
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
