"""A user's Pre-RMSNorm encoder-decoder with a T5-like learned relative position bias (one
scalar per head and clipped distance, added to the scores; no absolute positions), einsum
attention divided by sqrt(d_k), masks applied with masked_fill(torch.finfo(dtype).min), and a
forward that returns (logits, decoder hidden states).

    tndebug triage ckpt.pt --model relbias.py:build --adapter relbias.py:forward

build(bug=...):
    no_scale           the einsum's scores are not divided by sqrt(d_k)
    no_causal          the decoder's self-attention gets the padding mask only
    inverted_pad_mask  keep = tokens == pad
    shared_qkv         one Linear serves as q, k and v
    zero_positions     the relative bias tables are zero and frozen
"""
from __future__ import annotations

import math

import torch
from torch import nn

BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "shared_qkv", "zero_positions")


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RelativeBias(nn.Module):
    """bias[h, i, j] = table[clip(j - i, -max_distance, max_distance), h]."""

    def __init__(self, heads, max_distance=8, bidirectional=True, frozen_zero=False):
        super().__init__()
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.table = nn.Embedding(2 * max_distance + 1, heads)
        if frozen_zero:
            nn.init.zeros_(self.table.weight)
            self.table.weight.requires_grad_(False)

    def forward(self, q_len, k_len, device):
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        if not self.bidirectional:
            rel = rel.clamp(max=0)
        rel = rel.clamp(-self.max_distance, self.max_distance) + self.max_distance
        return self.table(rel).permute(2, 0, 1)                              # [h, T, S]


class Attention(nn.Module):
    def __init__(self, d, heads, bug=None):
        super().__init__()
        self.heads, self.d_k, self.bug = heads, d // heads, bug
        self.q = nn.Linear(d, d, bias=False)
        self.k = self.q if bug == "shared_qkv" else nn.Linear(d, d, bias=False)
        self.v = self.q if bug == "shared_qkv" else nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, kv, keep, position_bias=None):                     # keep [B, 1|T, S]
        B, T, d = x.shape
        split = lambda t: t.view(B, -1, self.heads, self.d_k).transpose(1, 2)   # [B, h, L, dk]
        q, k, v = split(self.q(x)), split(self.k(kv)), split(self.v(kv))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k)                       # [B, h, T, S]
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d_k)
        if position_bias is not None:
            scores = scores + position_bias
        scores = scores.masked_fill(~keep[:, None], torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1)
        out = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        return self.o(out.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d, heads, d_ff, cross, bug=None):
        super().__init__()
        self.norm1, self.attn = RMSNorm(d), Attention(d, heads, bug)
        self.cross = Attention(d, heads, bug) if cross else None
        self.norm2 = RMSNorm(d) if cross else None
        self.norm3 = RMSNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff, bias=False), nn.ReLU(), nn.Linear(d_ff, d, bias=False))

    def forward(self, x, keep, bias, memory=None, memory_keep=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, keep, bias)
        if self.cross is not None:
            x = x + self.cross(self.norm2(x), memory, memory_keep)
        return x + self.ff(self.norm3(x))


class RelSeq2Seq(nn.Module):
    def __init__(self, vocab=16, d_model=32, heads=4, layers=2, d_ff=64, bug=None):
        super().__init__()
        self.bug = bug
        self.shared = nn.Embedding(vocab, d_model)
        self.enc_bias = RelativeBias(heads, frozen_zero=bug == "zero_positions")
        self.dec_bias = RelativeBias(heads, bidirectional=False, frozen_zero=bug == "zero_positions")
        self.encoder = nn.ModuleList([Block(d_model, heads, d_ff, False, bug) for _ in range(layers)])
        self.decoder = nn.ModuleList([Block(d_model, heads, d_ff, True, bug) for _ in range(layers)])
        self.enc_norm, self.dec_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def keep(self, ids, pad):                                                 # [B, 1, L]
        return ((ids == pad) if self.bug == "inverted_pad_mask" else (ids != pad))[:, None, :]

    def encode(self, src, pad):
        x, keep = self.shared(src), self.keep(src, pad)
        bias = self.enc_bias(src.shape[1], src.shape[1], src.device)
        for block in self.encoder:
            x = block(x, keep, bias)
        return self.enc_norm(x)

    def forward(self, src, tgt, pad=0):
        memory = self.encode(src, pad)
        T = tgt.shape[1]
        keep = self.keep(tgt, pad)
        if self.bug != "no_causal":
            keep = keep & torch.ones(T, T, dtype=torch.bool, device=tgt.device).tril()   # [B, T, T]
        bias = self.dec_bias(T, T, tgt.device)
        x = self.shared(tgt)
        for block in self.decoder:
            x = block(x, keep, bias, memory, self.keep(src, pad))
        hidden = self.dec_norm(x)
        return self.lm_head(hidden), hidden                                   # ([B, T, V], [B, T, d])


def build(**kw):
    return RelSeq2Seq(**kw)


def forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)                                            # (logits, hidden)


def encode(model, src, pad_id):
    return model.encode(src, pad_id)
