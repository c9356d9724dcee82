"""A user's compact model on F.scaled_dot_product_attention with one fused QKV projection
(nanoGPT style, encoder-decoder), batch-first, written independently of tndebug's model.

Bugs behind constructor arguments:

    scale=False        SDPA called with scale=1.0 (no 1/sqrt(d_k))
    causal=False       the decoder's self-attention is not causal
    shared_qk=True     the QKV projection's Q and K rows are one shared block (W_Q = W_K)

`forward` below is its adapter (`--adapter sdpa_model.py:forward`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d, h, scale=True, causal=False, shared_qk=False):
        super().__init__()
        self.h, self.scale, self.causal, self.shared_qk = h, scale, causal, shared_qk
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad_keep):                       # x [B, T, d], pad_keep [B, T]
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        if self.shared_qk:
            k = q
        q, k, v = (t.view(B, T, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))   # [B, h, T, dk]
        mask = pad_keep[:, None, None, :]                 # [B, 1, 1, T]
        if self.causal:
            mask = mask & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           scale=None if self.scale else 1.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class CrossAttention(nn.Module):
    def __init__(self, d, h, scale=True):
        super().__init__()
        self.h, self.scale = h, scale
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, memory, src_keep):
        B, T, d = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.h, d // self.h).transpose(1, 2)
        k, v = (t.view(B, S, self.h, d // self.h).transpose(1, 2) for t in self.kv(memory).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=src_keep[:, None, None, :],
                                           scale=None if self.scale else 1.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.fc = nn.Linear(d, d_ff)
        self.fc2 = nn.Linear(d_ff, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc(x)))


class EncBlock(nn.Module):
    def __init__(self, d, h, d_ff, **bugs):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, h, scale=bugs.get("scale", True), shared_qk=bugs.get("shared_qk", False))
        self.mlp = MLP(d, d_ff)

    def forward(self, x, keep):
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class DecBlock(nn.Module):
    def __init__(self, d, h, d_ff, **bugs):
        super().__init__()
        self.ln_1, self.ln_2, self.ln_3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, h, scale=bugs.get("scale", True), causal=bugs.get("causal", True),
                                  shared_qk=bugs.get("shared_qk", False))
        self.cross = CrossAttention(d, h, scale=bugs.get("scale", True))
        self.mlp = MLP(d, d_ff)

    def forward(self, x, memory, tgt_keep, src_keep):
        x = x + self.attn(self.ln_1(x), tgt_keep)
        x = x + self.cross(self.ln_2(x), memory, src_keep)
        return x + self.mlp(self.ln_3(x))


class Seq2Seq(nn.Module):
    def __init__(self, vocab=11, d=32, h=4, n_layer=2, d_ff=64, max_len=64, **bugs):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)               # learned positions
        self.enc = nn.ModuleList([EncBlock(d, h, d_ff, **bugs) for _ in range(n_layer)])
        self.dec = nn.ModuleList([DecBlock(d, h, d_ff, **bugs) for _ in range(n_layer)])
        self.ln_e, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def embed(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))

    def encode(self, src, pad_id=0):
        x, keep = self.embed(src), src != pad_id
        for block in self.enc:
            x = block(x, keep)
        return self.ln_e(x)

    def forward(self, src, tgt, pad_id=0):
        memory = self.encode(src, pad_id)
        x = self.embed(tgt)
        for block in self.dec:
            x = block(x, memory, tgt != pad_id, src != pad_id)
        return self.lm_head(self.ln_f(x))


def build(**kw):
    return Seq2Seq(**kw)


def forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)


def encode(model, src, pad_id):
    return model.encode(src, pad_id)
