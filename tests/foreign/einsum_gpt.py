"""A decoder-only model whose attention is written with `torch.einsum` in another axis order,
the scale folded into q: the way several third-party packages write it (issue 45).

    style "seq_first": x [T, B, d], q/k/v [T, B, h, d_k], "ibhd,jbhd->ijbh", softmax over dim 1
    style "bthd":      x [B, T, d], q/k/v [B, T, h, d_k], "bqhd,bkhd->bhqk", softmax over dim -1

bugs: no_scale (q not scaled), no_causal (no mask), softmax_dim (the softmax over the queries).
"""
from __future__ import annotations

import torch
from torch import nn

BUGS = ("no_scale", "no_causal", "softmax_dim")
STYLES = ("seq_first", "bthd")


class Attention(nn.Module):
    def __init__(self, d, h, style, bug):
        super().__init__()
        self.h, self.dk, self.style, self.bug = h, d // h, style, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, keep):                      # keep [T, S] bool (True = may attend) or None
        lead = x.shape[:2]
        q, k, v = (f(x).view(*lead, self.h, self.dk) for f in (self.q, self.k, self.v))
        if self.bug != "no_scale":
            q = q * self.dk ** -0.5
        if self.style == "seq_first":                                   # [T, B, h, d_k]
            att = torch.einsum("ibhd,jbhd->ijbh", q, k)                  # [T, S, B, h]
            if keep is not None:
                att = att.masked_fill(~keep[:, :, None, None], float("-inf"))
            att = att.softmax(dim=0 if self.bug == "softmax_dim" else 1)
            z = torch.einsum("ijbh,jbhd->ibhd", att, v)                  # [T, B, h, d_k]
        else:                                                            # [B, T, h, d_k]
            att = torch.einsum("bqhd,bkhd->bhqk", q, k)                  # [B, h, T, S]
            if keep is not None:
                att = att.masked_fill(~keep, float("-inf"))
            att = att.softmax(dim=-2 if self.bug == "softmax_dim" else -1)
            z = torch.einsum("bhqk,bkhd->bqhd", att, v)                  # [B, T, h, d_k]
        return self.o(z.reshape(*lead, -1))


class Block(nn.Module):
    def __init__(self, d, h, style, bug):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, h, style, bug)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))

    def forward(self, x, keep):
        x = x + self.attn(self.n1(x), keep)
        return x + self.ff(self.n2(x))


class EinsumLM(nn.Module):
    def __init__(self, style="seq_first", bug=None, V=24, d=32, h=4, layers=2, max_len=64):
        super().__init__()
        self.style, self.bug = style, bug
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, h, style, bug) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, V)

    def forward(self, ids):                 # seq_first: ids [T, B] -> [T, B, V]; bthd: [B, T]
        T = ids.shape[0] if self.style == "seq_first" else ids.shape[1]
        pos = self.pos(torch.arange(T, device=ids.device))
        x = self.emb(ids) + (pos[:, None] if self.style == "seq_first" else pos)
        keep = None if self.bug == "no_causal" else \
            torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        for b in self.blocks:
            x = b(x, keep)
        return self.head(self.norm(x))


def forward(model, ids, pad_id):
    """The user's adapter: batch-first ids in, batch-first logits out."""
    if model.style == "seq_first":
        return model(ids.T).transpose(0, 1)
    return model(ids)
