"""What probes see of one forward (and backward) pass: a `Trace`, filled by a capture.

Probes read a small interface, not our classes, so that `tndebug triage` can fill the same
interface from a user's own model (`tndebug/capture/generic.py`; our own tap points:
`tndebug/capture/taps.py`):

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

from dataclasses import dataclass, field, replace

import torch

ATTN_FIELDS = ("q", "k", "v", "scores", "masked_scores", "probs", "z", "out")
READS = frozenset({f"attn.{f}" for f in ATTN_FIELDS} |
                  {"stream", "embed", "ffn.hidden", "logits", "grad.stream", "all"})
KINDS = ("enc_self", "dec_self", "cross")
# each kind in words, as findings name an attention by its kind (mask-broadcast's `where`)
KIND_WORDS = {"enc_self": "encoder (self-attention)", "dec_self": "decoder (self-attention)",
              "cross": "decoder (cross-attention)"}


class StopForward(BaseException):
    """A recording asked to stop early ends the forward here: the rest of the model never runs
    and `trace.logits` stays None. A BaseException, so a model's own `except Exception` does
    not swallow it; Subject.trace catches it."""


class StacksEntered(StopForward):
    """`Subject.trace(..., until_stacks=True)`: every stack has been entered; what enters the
    stacks (the embeddings) is recorded, the layers are never run."""


class HeadReached(StopForward):
    """`Subject.trace(..., stop_before=path)`: the module at `path` (the output head) is about
    to run; every stream point below it is recorded, the head's logits are never computed."""


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
    qk_match: str = "values"                   # how q, k were traced: "values" (s * the
                                               # projection's output), "norms" (rotated per
                                               # vector after it, RoPE: s from the norms)
    sources: dict = field(default_factory=dict)  # op role ("scores", "softmax", "mask", "add",
                                               # "sdpa"; else "forward") -> the user's line
                                               # that ran it (capture/source.py)

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
    # x is the output of a normalisation module: its (weight, bias) per feature (either None
    # when the module has none), so the norm can be undone and checked (_depth_stats)
    norm: tuple | None = None


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
    # module path -> the user's line that made its output (capture/origins.py; probed passes)
    made: dict[str, dict] = field(default_factory=dict)

    def records(self, kind: str | None = None) -> list[AttentionRecord]:
        return [r for r in self.attention.values() if kind is None or r.kind == kind]

    @staticmethod
    def joined(parts: list["Trace"], src: torch.Tensor, tgt: torch.Tensor) -> "Trace | None":
        """One trace of the batch (src, tgt) from traces of its consecutive row blocks, each
        recorded alike (and emptied on the way: they are the caller's temporaries): stream
        points, embedding parts, FFN hidden and logits joined along the batch (all [B, ...]: the captures hand them over batch-first). None when the parts hold
        what cannot be joined row-wise (attention records, gradients, per-module outputs, whose
        batch dimension a model may put elsewhere) or differ in what they recorded."""
        first = parts[0]
        if any(p.attention or p.grads or p.order for p in parts):
            return None
        if any([(sp.name, sp.kind) for sp in p.streams] != [(sp.name, sp.kind) for sp in first.streams]
               or {k: sorted(v) for k, v in p.embed.items()} != {k: sorted(v) for k, v in first.embed.items()}
               or sorted(p.ffn_hidden) != sorted(first.ffn_hidden)
               or (p.logits is None) != (first.logits is None) for p in parts):
            return None
        cat = lambda xs: torch.cat(list(xs), dim=0)   # noqa: E731
        try:
            streams = []
            for i, sp in enumerate(first.streams):    # each point's blocks let go once joined:
                x = cat(p.streams[i].x for p in parts)  # one point held twice, not the trace
                streams.append(StreamPoint(sp.name, sp.stack, sp.layer, sp.kind, x, sp.norm))
                for p in parts:
                    p.streams[i] = replace(p.streams[i], x=x[:0])
            embed = {site: {k: cat(p.embed[site][k] for p in parts) for k in kinds}
                     for site, kinds in first.embed.items()}
            ffn = {k: cat(p.ffn_hidden[k] for p in parts) for k in first.ffn_hidden}
            logits = None if first.logits is None else cat(p.logits for p in parts)
        except RuntimeError:                          # shapes that do not line up
            return None
        return Trace(step=first.step, src=src, tgt=tgt, pad_id=first.pad_id, streams=streams,
                     embed=embed, ffn_hidden=ffn, logits=logits)
