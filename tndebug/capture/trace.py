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

from dataclasses import dataclass, field

import torch

ATTN_FIELDS = ("q", "k", "v", "scores", "masked_scores", "probs", "z", "out")
READS = frozenset({f"attn.{f}" for f in ATTN_FIELDS} |
                  {"stream", "embed", "ffn.hidden", "logits", "grad.stream", "all"})
KINDS = ("enc_self", "dec_self", "cross")


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

    def records(self, kind: str | None = None) -> list[AttentionRecord]:
        return [r for r in self.attention.values() if kind is None or r.kind == kind]
