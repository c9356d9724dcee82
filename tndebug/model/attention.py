"""Multi-head scaled dot-product attention (paper §3.2), every intermediate a tap point.

Masks are boolean "keep" masks: True where a query may attend to a key, as in
`F.scaled_dot_product_attention`. Shapes: [B, 1, 1, S] for padding (broadcast over heads and
queries), [B, 1, T, T] for padding & causal. The opposite convention, True = ignore, is
`nn.MultiheadAttention`'s.

With rotary positions (`cfg.pos == "rotary"`, tndebug/model/rotary.py) q and k are rotated by
their tokens' positions after the head split, before the taps: hook_q and hook_k show what
enters q k^T. Only self-attention is rotary (the config allows it in the decoder-only model).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tndebug.config import ModelConfig
from tndebug.model.dropout import make_dropout
from tndebug.model.hooks import HookPoint, tap
from tndebug.model.rotary import Rotary


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.d_k = cfg.n_heads, cfg.d_k
        d = cfg.d_model
        self.w_q = nn.Linear(d, d)
        self.w_k = nn.Linear(d, d)
        self.w_v = nn.Linear(d, d)
        self.w_o = nn.Linear(d, d)
        self.dropout = make_dropout(cfg)
        self.scale = 1.0 / math.sqrt(self.d_k)
        self.rope = Rotary(self.d_k) if cfg.pos == "rotary" else None
        # The fused path computes what the explicit one does (tests/model/test_equivalence.py);
        # code that changes a step of the explicit path (tndebug/inject.py) turns it off.
        self.fusable = True

        self.hook_q = HookPoint()              # [B, h, T, d_k] (rotary: rotated)
        self.hook_k = HookPoint()              # [B, h, S, d_k] (rotary: rotated)
        self.hook_v = HookPoint()              # [B, h, S, d_k]
        self.hook_scores = HookPoint()         # scaled q k^T before the mask  [B, h, T, S]
        self.hook_masked_scores = HookPoint()  # after masked_fill             [B, h, T, S]
        self.hook_probs = HookPoint()          # softmax                       [B, h, T, S]
        self.hook_z = HookPoint()              # per-head outputs              [B, h, T, d_k]
        self.hook_out = HookPoint()            # after w_o                     [B, T, d_model]
        self._internal = (self.hook_q, self.hook_k, self.hook_v, self.hook_scores,
                          self.hook_masked_scores, self.hook_probs, self.hook_z)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)  # [B, h, T, d_k]

    def merge_heads(self, z: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = z.shape
        return z.transpose(1, 2).reshape(B, T, self.h * self.d_k)   # [B, T, d_model]

    def fill_value(self, dtype: torch.dtype) -> float:
        """What masked scores are filled with: the dtype's most negative finite number, so a row
        with every key masked stays finite (uniform) instead of NaN."""
        return torch.finfo(dtype).min

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor, keep: torch.Tensor | None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """pos [B, T]: the positions of the tokens of a self-attention (x_q is x_kv), for the
        rotary embedding; None: no rotation."""
        if self.fusable and not any(p.active for p in self._internal):
            # Fused path: same numbers as the explicit one (tests/model/test_equivalence.py),
            # taken only when no tap inside attention is observed.
            q, k, v = self.positioned(*self.project_fused(x_q, x_kv), pos)
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.scale,
                                               dropout_p=self.dropout.p if self.training else 0.0)
            if keep is not None:
                # A query with no key kept (a sequence all pads) comes out 0 from SDPA; the explicit
                # path's finite fill gives uniform weights there, i.e. the mean of v.
                empty = ~keep.any(dim=-1, keepdim=True)                       # [B, 1, T|1, 1]
                z = z + empty * v.mean(dim=-2, keepdim=True)                  # [B, h, T, d_k]
        else:
            q, k, v = self.positioned(self.split_heads(self.w_q(x_q)), self.split_heads(self.w_k(x_kv)),
                                      self.split_heads(self.w_v(x_kv)), pos)    # [B, h, T|S, d_k]
            q, k, v = tap(self.hook_q, q), tap(self.hook_k, k), tap(self.hook_v, v)
            z = self.explicit(q, k, v, keep)
        return tap(self.hook_out, self.w_o(self.merge_heads(z)))      # [B, T, d_model]

    def project_fused(self, x_q: torch.Tensor, x_kv: torch.Tensor):
        """q, k, v from one matmul (self-attention) or two (cross: q, then k|v stacked).

        The weights are concatenated on the fly, so parameters stay w_q, w_k, w_v; one wide
        matmul is faster on CPU than three narrow ones.
        """
        d = self.h * self.d_k
        if x_q is x_kv:
            w = torch.cat([self.w_q.weight, self.w_k.weight, self.w_v.weight])   # [3d, d]
            b = torch.cat([self.w_q.bias, self.w_k.bias, self.w_v.bias])         # [3d]
            q, k, v = F.linear(x_q, w, b).split(d, dim=-1)                       # 3 x [B, T, d]
        else:
            q = self.w_q(x_q)                                                    # [B, T, d]
            w = torch.cat([self.w_k.weight, self.w_v.weight])                    # [2d, d]
            b = torch.cat([self.w_k.bias, self.w_v.bias])
            k, v = F.linear(x_kv, w, b).split(d, dim=-1)                         # 2 x [B, S, d]
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)    # [B, h, T|S, d_k]

    def positioned(self, q, k, v, pos):
        """Rotary positions on q and k (RoFormer §3.4); v is left as it is. Both paths call this,
        so the fused one rotates as the explicit one does.  # 3 x [B, h, T|S, d_k]"""
        if self.rope is None or pos is None:
            return q, k, v
        return self.rope(q, pos), self.rope(k, pos), v

    def explicit(self, q, k, v, keep):
        scores = tap(self.hook_scores, (q @ k.transpose(-2, -1)) * self.scale)   # [B, h, T, S]
        scores = tap(self.hook_masked_scores, self.masked(scores, keep))
        probs = tap(self.hook_probs, self.normalised(scores, keep))
        return tap(self.hook_z, self.dropout(probs) @ v)     # [B, h, T, d_k]

    def masked(self, scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Scores of keys a query may not attend to -> fill_value, before the softmax."""
        if keep is None:
            return scores
        return scores.masked_fill(~keep, self.fill_value(scores.dtype))

    def normalised(self, scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Attention weights: a softmax over the keys."""
        return scores.softmax(dim=-1)
