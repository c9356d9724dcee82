"""A finished attention call becomes a site of the Trace (`AttentionSites`, mixed into
`recording.State`): a wrapper around a site is none; q and k are traced back to the projections
that made them; its kind (self- or cross-attention, encoder or decoder) and layer.
"""
from __future__ import annotations

import torch

from tndebug.capture.attention_calls import AttnCall
from tndebug.capture.projections import find_projection, looks_like_probs, same_map, same_tensor
from tndebug.capture.source import forward_def
from tndebug.capture.structure import CROSS_NAME, layer_index, owner_layer, stack_of
from tndebug.capture.trace import AttentionRecord


class AttentionSites:
    """The sites half of a recording's state (mixed into `recording.State`)."""

    def finish_attention(self, call: AttnCall, module, output) -> bool:
        """Record `call` as an attention site; False when it is only a wrapper around one (the
        softmax or SDPA call happened in an attention module inside it, or nowhere)."""
        t = self.trace
        if call.raw is None and not call.softmaxed:
            weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
            if call.nested or not looks_like_probs(weights):
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

    def _link_projections(self, call: AttnCall) -> None:
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
            hit = find_projection(operand, pool, hints.get((call.path, role)), q_shape=call.q.shape)
            if hit is None:
                return
            hints[(call.path, role)] = hit[3]
            found.append(hit)
        (sq, q_in, q_map, q_at), (sk, k_in, k_map, k_at) = found
        call.q, call.k = call.q / sq, call.k / sk
        call.extra.update(qk_source="projection", shared_projection=same_map(q_map, k_map),
                          kv_from_other_input=not same_tensor(q_in, k_in),
                          qk_match=next((m for m in ("norms", "position0") if m in (q_at[-1], k_at[-1])),
                                        "values"),
                          kv_order=k_at[-2])        # grouped-query k: "interleaved" | "tiled" | ""

    def _classify(self, call: AttnCall) -> tuple[str, int | None]:
        layer = layer_index(call.path)
        owner = owner_layer(call.path, self.cap.layers) if self.block_call else None
        if owner in self.block_call:                 # inside a repeated block: its call's layer
            layer = self.block_call[owner][0]
        q, k = call.query, call.key
        comparable = (q is not None and k is not None and q.is_floating_point()
                      and k.is_floating_point() and k.dim() == q.dim() and k.shape[-1] == q.shape[-1])
        differ = comparable and k is not q and (k.shape != q.shape or not torch.equal(k, q))
        if "kv_from_other_input" in call.extra:      # behaviour: what the key projection was fed
            if call.extra["kv_from_other_input"]:
                return "cross", layer
        elif differ or CROSS_NAME.search(call.path.rpartition(".")[2]):
            return "cross", layer
        stack = stack_of(call.path)
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


def _forward_source(module) -> dict:
    """{"forward": the module's forward def}, where no op's line was seen."""
    loc = forward_def(module)
    return {"forward": loc} if loc else {}
